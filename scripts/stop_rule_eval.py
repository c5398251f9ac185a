"""Replay ``sam``'s stop rules on the odd (evaluation) halves: the table
rule (today's default) against the learned rule (``sam_stop: "learned"``),
with and without the global store, on this CPU's cost line and the
GPU-like line; the fraction of the oracle's lead over ``suffix`` captured
(``results/curves/oracle_bound.json``, same halves and lines).

    python scripts/stop_rule_eval.py [--model FILE] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from acceptance_curves import RECORDS  # noqa: E402
from vllm_specplug.bench import curves as C  # noqa: E402
from vllm_specplug.bench.stop_fit import replay_speedup  # noqa: E402

VARIANTS = {
    "table": ("table", {}),
    "learned": ("learned", {}),
    "table_nostore": ("table", {"sam_global_tokens": 0}),
    "learned_nostore": ("learned", {"sam_global_tokens": 0}),
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="", help="stop model file (default: the shipped one)")
    ap.add_argument("--workloads", default="pipeline,agentic,spec_bench")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    oracle = json.loads((REPO / "results" / "curves" / "oracle_bound.json").read_text())
    lines = [C.cpu_cost_line(), C.gpu_like_cost_line()]
    report = {"model": args.model or "shipped", "half": "odd", "workloads": {}}
    for w in args.workloads.split(","):
        rows = C.load_records(RECORDS[w][0], None, half="odd")
        res = {}
        for ln in lines:
            ob = oracle["workloads"][w][f"speedup@{ln.name}"]
            o, s = ob["oracle"], ob["suffix"]
            res[ln.name] = {"oracle": o, "suffix": s}
            for v in args.variants.split(","):
                stop, opts = VARIANTS[v]
                t = time.time()
                r = replay_speedup(rows, ln, stop, args.model or None, **opts)
                r["over_suffix"] = r["speedup"] / s
                r["oracle_fraction"] = (r["speedup"] - s) / (o - s)
                r["seconds"] = round(time.time() - t, 1)
                res[ln.name][v] = r
                print(f"{w:10s} {ln.name:8s} {v:16s} tau {r['tau']:.3f} nodes "
                      f"{r['nodes_per_step']:.2f} rejected {r['rejected_per_step']:.2f} "
                      f"speedup {r['speedup']:.3f} ({r['over_suffix']:.3f}x suffix, "
                      f"oracle {o / s:.3f}x; fraction {r['oracle_fraction']:+.2f})", flush=True)
        report["workloads"][w] = res
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
