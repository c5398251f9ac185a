"""Floor probe: ms/step of a 16-row batch with no drafts, one engine per process."""
import json, sys, time, os
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../../scripts"))
from measure_tree_cost import PADDING
PROMPT = "Write a long story about a lighthouse keeper, part {i}."
CONFIGS = {
 "plain": None,
 "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 24, "prompt_lookup_max": 24},
 "rand0": {"method": "debug_random_tree", "num_speculative_tokens": 4, "random_shape": "chain", "batch_budget": "off", "random_sizes": "0"},
 "samoff": {"method": "sam", "num_speculative_tokens": 8, "disable_by_batch_size": 2},
}
def batch_seconds(llm, prompts, tokens):
    from vllm import SamplingParams
    t = time.perf_counter()
    llm.chat([[{"role": "user", "content": p}] for p in prompts],
             SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t
def main():
    name = sys.argv[1]; rows = int(os.environ.get("ROWS", 16)); tokens = 40; rounds = 3
    from vllm_specplug.offline_engine import build_llm
    from vllm_specplug.models import default_model_path
    prompts = [PADDING * 6 + PROMPT.format(i=i) for i in range(rows)]
    llm = build_llm(default_model_path(), CONFIGS[name], max_model_len=2048)
    batch_seconds(llm, prompts, 4)
    vals = []
    for _ in range(rounds):
        l = batch_seconds(llm, prompts, tokens); s = batch_seconds(llm, prompts, 4)
        vals.append(1000 * (l - s) / (tokens - 4))
    print("RESULT", json.dumps({"name": name, "rows": rows, "ms": [round(v, 2) for v in vals], "best": round(min(vals), 2)}), flush=True)
    llm.llm_engine.engine_core.shutdown()
if __name__ == "__main__":
    main()
