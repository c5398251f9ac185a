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
from vllm_specplug.bench.stop_fit import default_training_sets, replay_speedup  # noqa: E402

VARIANTS = {
    "table": ("table", {}),
    "learned": ("learned", {}),
    "table_nostore": ("table", {"sam_global_tokens": 0}),
    "learned_nostore": ("learned", {"sam_global_tokens": 0}),
}


def store_report(report: dict, path: str) -> None:
    """sam with the global store against sam without it, per workload,
    cost line and category (the turn kind on agentic)."""
    out = ["sam with the global store against without it (replay, odd halves, budget 32); "
           "per category: tau and speedup, with / without", ""]
    for w, res in report["workloads"].items():
        for line, r in res.items():
            for rule in ("table", "learned"):
                a, b = r.get(rule), r.get(f"{rule}_nostore")
                if a is None or b is None:
                    continue
                out.append(f"{w} {line} {rule}: speedup {a['speedup']:.3f} / {b['speedup']:.3f} "
                           f"({a['speedup'] / b['speedup']:.3f}x); tau {a['tau']:.2f} / "
                           f"{b['tau']:.2f}; nodes {a['nodes_per_step']:.2f} / "
                           f"{b['nodes_per_step']:.2f}; drafting ms a step "
                           f"{a['draft_ms_per_step']:.3f} / {b['draft_ms_per_step']:.3f}")
                for c in sorted(a["by_category"]):
                    x, y = a["by_category"][c], b["by_category"].get(c)
                    if y is None:
                        continue
                    out.append(f"    {c:12s} tau {x['tau']:.2f} / {y['tau']:.2f}, speedup "
                               f"{x['speedup']:.3f} / {y['speedup']:.3f} "
                               f"({x['speedup'] / y['speedup']:.3f}x)")
    Path(path).write_text("\n".join(out) + "\n")
    print("\n".join(out))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="", help="stop model file (default: the shipped one)")
    ap.add_argument("--workloads", default="pipeline,agentic,spec_bench")
    ap.add_argument("--half", default="odd", choices=("odd", "even"),
                    help="even: the tuning halves the shipped model was fitted on (no "
                         "oracle recorded there: no oracle fraction)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="")
    ap.add_argument("--store-report", default="", metavar="FILE",
                    help="write the global store's effect per workload and category")
    args = ap.parse_args(argv)
    oracle = json.loads((REPO / "results" / "curves" / "oracle_bound.json").read_text())
    lines = [C.cpu_cost_line(), C.gpu_like_cost_line()]
    report = {"model": args.model or "shipped", "half": args.half, "workloads": {}}
    even = default_training_sets() if args.half == "even" else {}
    for w in args.workloads.split(","):
        rows = even[w] if even else C.load_records(RECORDS[w][0], None, half="odd")
        res = {}
        for ln in lines:
            if even:
                o = s = None
            else:
                ob = oracle["workloads"][w][f"speedup@{ln.name}"]
                o, s = ob["oracle"], ob["suffix"]
            res[ln.name] = {"oracle": o, "suffix": s}
            for v in args.variants.split(","):
                stop, opts = VARIANTS[v]
                t = time.time()
                r = replay_speedup(rows, ln, stop, args.model or None, **opts)
                if s is not None:
                    r["over_suffix"] = r["speedup"] / s
                    r["oracle_fraction"] = (r["speedup"] - s) / (o - s)
                r["seconds"] = round(time.time() - t, 1)
                res[ln.name][v] = r
                vs = (f" ({r['over_suffix']:.3f}x suffix, oracle {o / s:.3f}x; fraction "
                      f"{r['oracle_fraction']:+.2f})" if s is not None else "")
                print(f"{w:10s} {ln.name:8s} {v:16s} tau {r['tau']:.3f} nodes "
                      f"{r['nodes_per_step']:.2f} rejected {r['rejected_per_step']:.2f} "
                      f"cut early {r['cut_early_per_step']:.2f} "
                      f"source {r['wrong_source_per_step']:.2f} "
                      f"speedup {r['speedup']:.3f}{vs}", flush=True)
        report["workloads"][w] = res
    if args.store_report:
        store_report(report, args.store_report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
