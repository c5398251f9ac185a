# usage: stepcost.sh NEW_CODE_DIR OLD_CODE_DIR OUT
set -x
NEW=$1; OLD=$2; O=$3
mkdir -p $O && cd $O
export VLLM_SPECPLUG_STEP_COST_CACHE=$O/sc
date -u
PYTHONPATH=$NEW python -m vllm_specplug.cli bench --workload spec_bench --half even --per-category 1 --max-tokens 64 --temperature 0.8 \
  --methods sam --batch-size 8 --no-plots --no-quality --out mixed_sampled_batch > mixed1.log 2>&1
PYTHONPATH=$NEW python -m vllm_specplug.cli bench --workload spec_bench --half even --per-category 1 --max-tokens 64 \
  --methods sam --speculative-config 'sam={"sam_min_accept_prob": 0, "batch_budget": "off"}' \
  --batch-size 13 --no-plots --no-quality --out mixed_uncut_batch > mixed2.log 2>&1
cp -r sc sc_after_mixed
date -u
for code in new old; do
  D=$NEW; [ $code = old ] && D=$OLD
  rm -rf sc_$code && cp -r sc_after_mixed sc_$code
  VLLM_SPECPLUG_STEP_COST_CACHE=$O/sc_$code PYTHONPATH=$D python -m vllm_specplug.cli bench --workload pipeline --half odd --limit 16 --max-tokens 96 --methods sam \
    --speculative-config 'sam={"num_speculative_tokens": 8}' --no-plots --no-quality --out pipeline_cached_$code > p_$code.log 2>&1
  date -u
done
VLLM_SPECPLUG_STEP_COST_CACHE=0 PYTHONPATH=$NEW python -m vllm_specplug.cli bench --workload pipeline --half odd --limit 16 --max-tokens 96 --methods sam \
  --speculative-config 'sam={"num_speculative_tokens": 8}' --no-plots --no-quality --out pipeline_nocache > p_nocache.log 2>&1
date -u
