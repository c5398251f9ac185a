"""What drafts cost a batch step: a fixed cost for a step that verifies any
draft, and a cost per draft token.

A batch of ``--rows`` requests (one prompt padded to about ``--context``
tokens, each request a different suffix so no two are identical) decodes
``--tokens`` tokens with ``ignore_eos``. ``debug_random_tree`` drafts random
chains (always rejected, so every step commits one token a row and every
shape runs the same number of steps). One engine; each shape is a row-size
pattern (``random_sizes``: the i-th request of a batch drafts sizes[i]):

* ``none``: a speculative engine whose rows draft nothing;
* ``one``: one row drafts one token, the others nothing;
* ``all1``: every row drafts one token;
* ``allK``: every row drafts ``--k`` tokens;

and a plain engine (no speculative config) for reference. A step's time is
(long batch - short batch) / (tokens - 4), the best of ``--rounds``, so
prefill (cached after the first batch) drops out.

From these: the fixed cost of a step with drafts, ``one - none`` less one
token's cost, and a draft token's cost, ``(allK - all1) / (rows * (K - 1))``.
Usage: python scripts/measure_batch_draft_cost.py [--rows 16] [--tokens 40]
       [--context 170] [--k 4] [--rounds 2] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import time

from measure_tree_cost import PADDING   # the same padding, so the contexts compare

PROMPT = "Write a long story about a lighthouse keeper, part {i}."


def batch_seconds(llm, prompts: list[str], tokens: int) -> float:
    from vllm import SamplingParams

    t = time.perf_counter()
    llm.chat([[{"role": "user", "content": p}] for p in prompts],
             SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
             use_tqdm=False)
    return time.perf_counter() - t


def step_ms(llm, prompts: list[str], tokens: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        long_s = batch_seconds(llm, prompts, tokens)
        short_s = batch_seconds(llm, prompts, 4)
        best = min(best, (long_s - short_s) / (tokens - 4))
    return 1000 * best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--context", type=int, default=170)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="batch_draft_cost.json")
    args = ap.parse_args()
    from vllm_specplug.bench.engine import build_llm
    from vllm_specplug.models import default_model_path

    rows, k = args.rows, args.k
    pad = PADDING * max(args.context // 25, 1)
    prompts = [pad + PROMPT.format(i=i) for i in range(rows)]
    model = default_model_path()
    max_len = max(2048, args.context + args.tokens + 256)
    shapes = {"none": [0] * rows, "one": [1] + [0] * (rows - 1), "all1": [1] * rows,
              f"all{k}": [k] * rows}
    res: dict = {"rows": rows, "tokens": args.tokens, "context": args.context, "k": k,
                 "rounds": args.rounds}
    llm = build_llm(model, None, max_model_len=max_len)
    batch_seconds(llm, prompts, 4)
    res["plain_ms"] = step_ms(llm, prompts, args.tokens, args.rounds)
    print("plain", f"{res['plain_ms']:.1f} ms/step", flush=True)
    llm.llm_engine.engine_core.shutdown()
    # every batch (long or short) starts `rows` requests: the sizes list holds,
    # per shape, one batch's sizes for each batch that shape runs
    order = list(shapes)
    per_shape = 1 + 2 * args.rounds   # warm-up, then (long, short) per round
    sizes = [s for name in order for _ in range(per_shape) for s in shapes[name]]
    llm = build_llm(model, {"method": "debug_random_tree", "num_speculative_tokens": k,
                            "random_shape": "chain", "batch_budget": "off",
                            "random_sizes": ",".join(map(str, sizes))},
                    max_model_len=max_len)
    for name in order:
        batch_seconds(llm, prompts, 4)   # warm-up: this shape's first batch
        res[f"{name}_ms"] = step_ms(llm, prompts, args.tokens, args.rounds)
        print(name, f"{res[f'{name}_ms']:.1f} ms/step", flush=True)
    llm.llm_engine.engine_core.shutdown()
    token = (res[f"all{k}_ms"] - res["all1_ms"]) / (rows * (k - 1))
    res["draft_token_ms"] = token
    res["fixed_ms"] = res["one_ms"] - res["none_ms"] - token
    res["spec_engine_overhead_ms"] = res["none_ms"] - res["plain_ms"]
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
