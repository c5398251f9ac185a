"""Run from the repository root: python results/mrv2/v1_tree_tau.py [CONFIG ...].
tau of the V1 (vLLM 0.32) tree versions of token_recycling / sam_tr, and sam's
chain, on the 0.34 engine tier's prompts (tests/test_vllm034_engine.py PROMPTS:
4 pipeline records + 2 agentic turns, 40 greedy tokens, one batch)."""
import json, sys, gc
from pathlib import Path
ROOT = Path(__file__).resolve().parents[2]   # the repository

def recorded(name, n, start=0):
    rows = [json.loads(l) for l in (ROOT / "results" / "curves" / f"{name}_greedy_hf.jsonl").open()]
    return [r["prompt_ids"] for r in rows[start:start + n]]

if __name__ == "__main__":
    from vllm import SamplingParams
    from vllm_specplug.offline_engine import build_llm
    from vllm_specplug.bench.engine import read_spec_counters
    from vllm_specplug.models import default_model_path
    prompts = recorded("pipeline", 4) + recorded("agentic", 2, 6)
    configs = {
        "plain": None,
        "sam_k4": {"method": "sam", "num_speculative_tokens": 4},
        "token_recycling_none_k4chain": {"method": "token_recycling", "num_speculative_tokens": 4, "isolation": "none"},
        "token_recycling_none_auto": {"method": "token_recycling", "isolation": "none"},
        "token_recycling_request_auto": {"method": "token_recycling", "isolation": "request"},
        "sam_tr_none_auto": {"method": "sam_tr", "isolation": "none"},
    }
    plain = None
    for name in (sys.argv[1:] or configs):
        llm = build_llm(str(default_model_path()), configs[name], max_model_len=4096)
        before = read_spec_counters(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
        after = read_spec_counters(llm)
        ids = [list(o.outputs[0].token_ids) for o in outs]
        if name == "plain":
            plain = ids
        acc = after["accepted"] - before["accepted"]
        drafts = after["drafts"] - before["drafts"]
        dt = after["draft_tokens"] - before["draft_tokens"]
        gen = sum(len(x) for x in ids)
        steps = gen - acc
        print(json.dumps({"config": name, "generated": gen, "accepted": acc, "drafts": drafts,
                          "draft_tokens": dt, "tau": round(gen / steps, 3),
                          "identical_to_plain": (ids == plain) if plain else None}), flush=True)
        llm.llm_engine.engine_core.shutdown(); del llm; gc.collect()
