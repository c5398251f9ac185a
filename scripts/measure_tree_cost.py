"""Cost of one verify step against the number of draft nodes, tree vs chain.

Random drafts are (almost surely) all rejected, so every step verifies the
full draft and yields one token: seconds per step = seconds / tokens.
Usage: python scripts/measure_tree_cost.py [--nodes 1,8,16,32,64] [--tokens 48]
"""
from __future__ import annotations

import argparse
import json
import time


def step_seconds(llm, tokens: int) -> float:
    from vllm import SamplingParams

    msgs = [[{"role": "user", "content": "Write a long story about a lighthouse keeper."}]]
    llm.chat(msgs, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
                   use_tqdm=False)[0]
    return (time.perf_counter() - t) / len(out.outputs[0].token_ids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="1,8,16,32,64")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out", default="tree_cost.json")
    args = ap.parse_args()
    import gc
    import resource

    from vllm_specplug.bench.engine import build_llm
    from vllm_specplug.models import default_model_path

    model = default_model_path()
    res = {}
    configs = [("plain", None)]
    for n in map(int, args.nodes.split(",")):
        for shape in ("chain", "tree"):
            configs.append((f"{shape}{n}", {"method": "debug_random_tree",
                                            "num_speculative_tokens": n,
                                            "random_shape": shape}))
    for name, spec in configs:
        llm = build_llm(model, spec, max_model_len=2048)
        res[name] = step_seconds(llm, args.tokens)
        print(name, f"{res[name] * 1000:.1f} ms/step", flush=True)
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    res["max_rss_mb_main"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
