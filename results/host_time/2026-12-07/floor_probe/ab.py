"""Paired A/B: engines alive together, batches alternated, ms/step difference per round."""
import json, sys, time, os, statistics
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe import CONFIGS, batch_seconds, PADDING, PROMPT
def main():
    names = sys.argv[1].split(","); rows = int(os.environ.get("ROWS", 16)); tokens = int(os.environ.get("TOK", 40)); rounds = int(os.environ.get("ROUNDS", 6))
    from vllm_specplug.offline_engine import build_llm
    from vllm_specplug.models import default_model_path
    prompts = [PADDING * 6 + PROMPT.format(i=i) for i in range(rows)]
    llms = {n: build_llm(default_model_path(), CONFIGS[n], max_model_len=2048) for n in names}
    for n in names: batch_seconds(llms[n], prompts, 4)
    vals = {n: [] for n in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            l = batch_seconds(llms[n], prompts, tokens); s = batch_seconds(llms[n], prompts, 4)
            vals[n].append(1000 * (l - s) / (tokens - 4))
    base = names[0]
    out = {n: {"ms": [round(v, 1) for v in vals[n]], "median": round(statistics.median(vals[n]), 2),
               "paired_diff_median": round(statistics.median([a - b for a, b in zip(vals[n], vals[base])]), 2)} for n in names}
    print("RESULT", json.dumps({"rows": rows, "tokens": tokens, **out}), flush=True)
    for n in names: llms[n].llm_engine.engine_core.shutdown()
if __name__ == "__main__":
    main()
