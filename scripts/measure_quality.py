"""Quality of sampled outputs, method against plain sampling, with intervals.

For each method (one engine at a time) and temperature: ``--samples`` sampled
outputs (``--prompts`` Spec-Bench prompts, the rest as ``n`` independent
samples of each, no per-request seeds: every sample draws from the engine's own
generator), scored by the target's own mean log-likelihood per generated token
(``bench/quality.py``: temperature 1, no top-k/top-p). A lossless method
samples plain sampling's distribution, so its mean equals plain's up to noise;
the report gives each cell's mean with a 95% interval and the difference to
plain with a 95% Welch interval (conservative here: every cell has the same
number of samples per prompt).

    python scripts/measure_quality.py --methods plain,sam_tr,sam_tr@block \\
        --temperatures 0.7,1.0 --samples 200 --out results/quality/run.json
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

METHODS = {
    "plain": None,
    "sam_tr": {"method": "sam_tr", "num_speculative_tokens": 8, "batch_budget": "off"},
    "sam_tr@block": {"method": "sam_tr", "num_speculative_tokens": 8, "batch_budget": "off",
                     "acceptance": "block"},
    "token_recycling": {"method": "token_recycling", "num_speculative_tokens": 8,
                        "batch_budget": "off"},
    "eagle2": {"method": "eagle2", "num_speculative_tokens": 8, "batch_budget": "off"},
    "eagle2@block": {"method": "eagle2", "num_speculative_tokens": 8, "batch_budget": "off",
                     "acceptance": "block"},
}


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its normal 95% interval."""
    n = len(xs)
    m = sum(xs) / n
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, 1.96 * math.sqrt(var / n)


def diff_ci(a: list[float], b: list[float]) -> tuple[float, float]:
    """mean(a) - mean(b) and the half-width of its Welch 95% interval."""
    ma, ha = mean_ci(a)
    mb, hb = mean_ci(b)
    return ma - mb, math.hypot(ha, hb)


def run(args) -> dict:
    from vllm import SamplingParams

    from vllm_specplug.bench.engine import build_llm, counter_delta, read_spec_counters
    from vllm_specplug.bench.prompts import load_prompts
    from vllm_specplug.bench.quality import output_logprobs
    from vllm_specplug.models import default_model_path

    model = args.model or default_model_path()
    prompts = [r["prompt"] for r in load_prompts(per_category=1)][: args.prompts]
    per_prompt = math.ceil(args.samples / len(prompts))
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    temps = [float(t) for t in args.temperatures.split(",")]
    out: dict = {"settings": vars(args), "prompts": len(prompts), "per_prompt": per_prompt,
                 "cells": {}}
    for name in args.methods.split(","):
        spec = METHODS[name]
        if spec is not None and spec["method"] == "eagle2":
            spec = {**spec, "model": args.head}
        llm = build_llm(model, spec, max_model_len=2048, seed=args.seed)
        for t in temps:
            sp = SamplingParams(temperature=t, max_tokens=args.max_tokens, n=per_prompt)
            before = read_spec_counters(llm)
            t0 = time.time()
            outs = llm.chat(msgs, sp, use_tqdm=False)
            wall = time.time() - t0
            delta = counter_delta(read_spec_counters(llm), before)
            pairs = [(o.prompt_token_ids, c.token_ids) for o in outs for c in o.outputs]
            scores = output_logprobs(model, pairs)
            per_sample = [s / k for s, k in scores if k]
            generated = sum(len(c) for _, c in pairs)
            out["cells"][f"{name}@{t}"] = {
                "method": name, "temperature": t, "samples": len(per_sample),
                "per_sample": per_sample,
                "token_weighted": sum(s for s, _ in scores) / max(1, sum(k for _, k in scores)),
                "tau": generated / max(1, generated - delta["accepted"]),
                "wall_s": wall}
            m, h = mean_ci(per_sample)
            print(f"{name} T={t}: quality {m:.3f} +- {h:.3f} over {len(per_sample)} samples, "
                  f"tau {out['cells'][f'{name}@{t}']['tau']:.2f}", flush=True)
            save(args.out, out)  # after every cell: a long run stopped early keeps its cells
        llm.llm_engine.engine_core.shutdown()
        del llm
    return out


def save(path: str, res: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(res, indent=1))
    Path(path).with_suffix(".md").write_text(report(res) + "\n")


def report(res: dict) -> str:
    lines = ["| method | T | samples | tau | quality (mean, 95% CI) | minus plain (95% CI) |",
             "|---|---|---|---|---|---|"]
    cells = res["cells"]
    for key, c in cells.items():
        m, h = mean_ci(c["per_sample"])
        base = cells.get(f"plain@{c['temperature']}")
        d = ""
        if base is not None and c["method"] != "plain":
            dm, dh = diff_ci(c["per_sample"], base["per_sample"])
            d = f"{dm:+.3f} ({dm - dh:+.3f} .. {dm + dh:+.3f})"
        lines.append(f"| {c['method']} | {c['temperature']} | {c['samples']} | {c['tau']:.2f} "
                     f"| {m:.3f} ({m - h:.3f} .. {m + h:.3f}) | {d} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="plain,sam_tr,sam_tr@block")
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="engine seed")
    ap.add_argument("--model", default=None)
    ap.add_argument("--head", default=None, help="EAGLE head folder for eagle2 methods")
    ap.add_argument("--out", default="results/quality/quality.json")
    args = ap.parse_args()
    res = run(args)
    save(args.out, res)
    print(report(res))


if __name__ == "__main__":
    main()
