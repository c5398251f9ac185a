"""Cost of one verify step against the number of draft nodes, tree vs chain.

Random drafts are (almost surely) all rejected, so every step verifies the
full draft and yields one token: seconds per step = seconds / tokens. One
engine per shape; the i-th request drafts sizes[i % len(sizes)] nodes
(``debug_random_tree``'s ``random_sizes``), so all sizes share an engine.
Usage: python scripts/measure_tree_cost.py [--nodes 1,8,16,32,64] [--tokens 32]
"""
from __future__ import annotations

import argparse
import json
import time

PROMPT = "Write a long story about a lighthouse keeper."


def one_request(llm, tokens: int) -> float:
    from vllm import SamplingParams

    t = time.perf_counter()
    out = llm.chat([[{"role": "user", "content": PROMPT}]],
                   SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
                   use_tqdm=False)[0]
    return (time.perf_counter() - t) / len(out.outputs[0].token_ids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="1,8,16,32,64")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="tree_cost.json")
    args = ap.parse_args()
    from vllm_specplug.bench.engine import build_llm
    from vllm_specplug.models import default_model_path

    model = default_model_path()
    sizes = [int(x) for x in args.nodes.split(",")]
    res: dict = {"tokens_per_request": args.tokens, "rounds": args.rounds}
    llm = build_llm(model, None, max_model_len=2048)
    one_request(llm, 4)
    res["plain_ms"] = 1000 * min(one_request(llm, args.tokens) for _ in range(args.rounds))
    print("plain", f"{res['plain_ms']:.1f} ms/step", flush=True)
    llm.llm_engine.engine_core.shutdown()
    for shape in ("chain", "tree"):
        llm = build_llm(model, {"method": "debug_random_tree",
                                "num_speculative_tokens": max(sizes),
                                "random_shape": shape,
                                "random_sizes": ",".join(map(str, sizes))},
                        max_model_len=2048)
        for _ in sizes:  # warm-up: one request of each size
            one_request(llm, 4)
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for _ in range(args.rounds):
            for n in sizes:
                times[n].append(one_request(llm, args.tokens))
        for n in sizes:
            res[f"{shape}{n}_ms"] = 1000 * min(times[n])
            print(shape, n, f"{res[f'{shape}{n}_ms']:.1f} ms/step", flush=True)
        llm.llm_engine.engine_core.shutdown()
    res["tree_over_chain"] = {n: res[f"tree{n}_ms"] / res[f"chain{n}_ms"] for n in sizes}
    res["chain_over_plain"] = {n: res[f"chain{n}_ms"] / res["plain_ms"] for n in sizes}
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
