"""Cost of one verify step against the number of draft nodes, tree vs chain.

Random drafts are (almost surely) all rejected, so every step verifies the
full draft and yields one token: seconds per step = seconds / tokens. One
engine per shape; the i-th request drafts sizes[i % len(sizes)] nodes
(``debug_random_tree``'s ``random_sizes``), so all sizes share an engine.
With ``--context N`` the prompt is padded to about N tokens (the cost of
verifying grows with the context the drafts attend to), and a step's time is
taken as the difference between a long and a 4-token request of the same
prompt, so the prompt's prefill (cached after the first request) drops out.
Usage: python scripts/measure_tree_cost.py [--nodes 1,8,16,32,64] [--tokens 32]
       [--context 1500] [--shapes chain]
"""
from __future__ import annotations

import argparse
import json
import time

PROMPT = "Write a long story about a lighthouse keeper."
PADDING = ("The keeper logged the weather, trimmed the wick, wound the clockwork and "
           "wrote a letter to his sister about the ships that passed the rocks. ")


def _request(llm, tokens: int, prompt: str) -> tuple[float, int]:
    from vllm import SamplingParams

    t = time.perf_counter()
    out = llm.chat([[{"role": "user", "content": prompt}]],
                   SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
                   use_tqdm=False)[0]
    return time.perf_counter() - t, len(out.outputs[0].token_ids)


def one_request(llm, tokens: int, prompt: str) -> float:
    """Seconds per generated token past the first four (one step each)."""
    long_s, long_n = _request(llm, tokens, prompt)
    short_s, short_n = _request(llm, 4, prompt)
    return (long_s - short_s) / (long_n - short_n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="1,8,16,32,64")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--context", type=int, default=0,
                    help="pad the prompt to about this many tokens")
    ap.add_argument("--shapes", default="chain,tree")
    ap.add_argument("--out", default="tree_cost.json")
    args = ap.parse_args()
    # ~25 tokens per padding sentence with SmolLM2's tokenizer
    prompt = PADDING * max(args.context // 25, 1) + PROMPT if args.context else PROMPT
    from vllm_specplug.bench.engine import build_llm
    from vllm_specplug.models import default_model_path

    model = default_model_path()
    sizes = [int(x) for x in args.nodes.split(",")]
    shapes = args.shapes.split(",")
    res: dict = {"tokens_per_request": args.tokens, "rounds": args.rounds,
                 "context": args.context}
    max_len = max(2048, args.context + args.tokens + 256)
    llm = build_llm(model, None, max_model_len=max_len)
    _request(llm, 4, prompt)
    res["plain_ms"] = 1000 * min(one_request(llm, args.tokens, prompt)
                                 for _ in range(args.rounds))
    print("plain", f"{res['plain_ms']:.1f} ms/step", flush=True)
    llm.llm_engine.engine_core.shutdown()
    for shape in shapes:
        llm = build_llm(model, {"method": "debug_random_tree",
                                "num_speculative_tokens": max(sizes),
                                "random_shape": shape,
                                # two requests (long, short) per measurement
                                "random_sizes": ",".join(f"{n},{n}" for n in sizes)},
                        max_model_len=max_len)
        for _ in sizes:  # warm-up: one measurement of each size
            one_request(llm, 8, prompt)
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for _ in range(args.rounds):
            for n in sizes:
                times[n].append(one_request(llm, args.tokens, prompt))
        for n in sizes:
            res[f"{shape}{n}_ms"] = 1000 * min(times[n])
            print(shape, n, f"{res[f'{shape}{n}_ms']:.1f} ms/step", flush=True)
        llm.llm_engine.engine_core.shutdown()
    if "tree" in shapes and "chain" in shapes:
        res["tree_over_chain"] = {n: res[f"tree{n}_ms"] / res[f"chain{n}_ms"] for n in sizes}
    for shape in shapes:
        res[f"{shape}_over_plain"] = {n: res[f"{shape}{n}_ms"] / res["plain_ms"] for n in sizes}
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
