set -x
O=/work/runs/stepcost
cd $O
for code in new old; do
  D=/work/clone_new; [ $code = old ] && D=/work/clone
  rm -rf sc_dear_$code && mkdir -p sc_dear_$code
  # the cache file name the engine uses: copy the name from the mixed cache
  f=$(cd sc_after_mixed && find . -type f -name '*.json' | head -1)
  mkdir -p sc_dear_$code/$(dirname $f)
  echo '{"format": 2, "c0_s": 0.050, "row_s": 0.0045, "draft_s": 0.0067, "ratio": 0.1229, "samples": 512}' > sc_dear_$code/$f
  VLLM_SPECPLUG_STEP_COST_CACHE=$O/sc_dear_$code PYTHONPATH=$D python -m vllm_specplug.cli bench --workload pipeline --half odd --limit 16 --max-tokens 96 --methods sam \
    --speculative-config 'sam={"num_speculative_tokens": 8}' --no-plots --no-quality --out pipeline_dear_$code > p_dear_$code.log 2>&1
  date -u
done
