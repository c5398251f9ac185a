"""One markdown table per workload from `specplug bench --workload` results.

    python scripts/workload_tables.py OUT_DIR [OUT_DIR ...]

Each OUT_DIR is a `specplug bench --out` folder (its results.json). Per
method: tau, tokens/s and speedup against plain at batch size 1, outputs
differing from plain, and, when the run had `--batch-size N`, the batched
tokens/s, speedup and differing outputs; then the run's implausibility flags
(a speedup above tau, a busy machine), which mean the tokens/s of that run
must not be quoted.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def table(res: dict) -> str:
    s = res["settings"]
    methods = res["methods"]
    n = len(methods["plain"]["per_prompt"])
    head = (f"**{s.get('workload', 'spec_bench')}**: {n} requests, {s['max_tokens']} tokens "
            f"max, temperature {s['temperature']}; run {res['environment']['date']}")
    batched = any("batch" in e for e in methods.values())
    cols = ["method", "tau", "tok/s", "speedup", "differ"]
    if batched:
        bs = next(e["batch"].get("batch_size", "all") for e in methods.values() if "batch" in e)
        cols += [f"tok/s (batches of {bs})", "speedup", "differ"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, e in methods.items():
        o = e["overall"]
        row = [f"`{name}`", _f(o["tau"]), _f(o["tokens_per_second"], "{:.1f}"),
               _f(o.get("speedup"), "{:.2f}x"), str(e["outputs_differing_from_plain"])]
        if batched:
            b = e.get("batch")
            row += ([_f(b["tokens_per_second"], "{:.1f}"), _f(b.get("speedup"), "{:.2f}x"),
                     str(b["outputs_differing_from_plain"])] if b else ["-", "-", "-"])
        lines.append("| " + " | ".join(row) + " |")
    if res.get("implausible"):
        lines += ["", "Implausible (do not quote this run's tokens/s): "
                  + "; ".join(res["implausible"])]
    return "\n".join(lines)


def main() -> None:
    for d in sys.argv[1:]:
        res = json.loads((Path(d) / "results.json").read_text())
        print(table(res))
        print()


if __name__ == "__main__":
    main()
