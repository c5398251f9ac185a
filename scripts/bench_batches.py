"""Batched passes only: each method in a fresh engine runs a workload's
prompts in batches of N (sessions turn by turn), as `specplug bench
--batch-size N` does after its one-at-a-time pass, without that pass.

    python scripts/bench_batches.py --workload pipeline --half odd --limit 80 \
        --batch-size 16 --methods plain,suffix,sam --out results/runs/batches/pipeline16

Writes OUT/raw/METHOD.batch.json (token ids included), OUT/results.json and
a Markdown table on stdout: tau, tokens/s, speedup against plain, outputs
differing from plain's, and the drafter's batch-budget counters. The same
cells for several batch sizes, workloads and served concurrencies at once:
`specplug bench matrix` (docs/benchmarks.md, "Benchmark matrix").
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_specplug.bench.matrix import run_batch_pass
from vllm_specplug.bench.run import batch_entry, environment, method_config, parse_overrides
from vllm_specplug.bench.workloads import load_workload
from vllm_specplug.models import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", required=True)
    ap.add_argument("--half", choices=("even", "odd"))
    ap.add_argument("--limit", type=int)
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--methods", default="plain,suffix,sam")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--speculative-config", action="append", default=[],
                    metavar="METHOD=JSON",
                    help="override a method's config (METHOD@LABEL=JSON: a variant)")
    args = ap.parse_args()
    overrides = parse_overrides(args.speculative_config)
    prompts = load_workload(args.workload, half=args.half, limit=args.limit)
    methods = ["plain"] + [m for m in args.methods.split(",") if m and m != "plain"]
    (args.out / "raw").mkdir(parents=True, exist_ok=True)
    log = args.out / "engine.log"
    model = default_model_path()
    raw = {}
    for m in methods:
        raw[m] = run_batch_pass(model, m, method_config(m, overrides), prompts, args.batch_size,
                                args.max_tokens, log, args.out / "raw" / f"{m}.batch.json")
    res = {"workload": args.workload, "half": args.half, "limit": args.limit,
           "requests": len(prompts), "batch_size": args.batch_size,
           "max_tokens": args.max_tokens, "environment": environment(), "methods": {}}
    print(f"| method | tau | tokens/s | speedup | outputs differing | load after | "
          f"nodes proposed / kept / explored |")
    print("|---|---|---|---|---|---|---|")
    for m in methods:
        e = batch_entry(raw[m]["batch"], raw["plain"]["batch"])
        bb = (raw[m].get("drafter_stats") or {}).get("batch_budget") or {}
        res["methods"][m] = {**e, "batch_budget": bb, "load_1min": raw[m]["load_1min"]}
        nodes = (f"{bb.get('nodes_proposed', '-')} / {bb.get('nodes_kept', '-')} / "
                 f"{bb.get('nodes_explored', '-')}") if bb else "-"
        print(f"| {m} | {e['tau']:.2f} | {e['tokens_per_second']:.1f} | "
              f"{e['speedup']:.2f}x | {e['outputs_differing_from_plain']} | "
              f"{raw[m]['load_1min']:.1f} | {nodes} |")
    (args.out / "results.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
