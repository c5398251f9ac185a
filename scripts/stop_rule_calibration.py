"""Calibration of sam's learned stopping rule in replay: the chosen drafts'
positions binned by their calibrated chance of acceptance (the chance that
the draft is accepted through that position), against how often they were.

    python scripts/stop_rule_calibration.py [--workloads pipeline,agentic,spec_bench]
        [--line cpu|gpu_like] [--model FILE]

Greedy replay of the odd halves (``bench.stop_fit.replay_speedup``: batch
size 1, budget 32, the global store on), the shipped model unless --model.
Prints, per workload and bin: positions, mean calibrated chance, mean raw
estimate, and the share accepted.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from acceptance_curves import RECORDS  # noqa: E402
from vllm_specplug.bench import curves as C  # noqa: E402
from vllm_specplug.bench import stop_fit  # noqa: E402
from vllm_specplug.proposers import stop_rule as SR  # noqa: E402

EDGES = [0, .1, .2, .3, .4, .5, .6, .7, .8, .9, .95, 1.01]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="pipeline,agentic,spec_bench")
    ap.add_argument("--line", default="cpu", choices=("cpu", "gpu_like"))
    ap.add_argument("--model", default="", help="stop model file (default: the shipped one)")
    args = ap.parse_args(argv)
    line = C.cpu_cost_line() if args.line == "cpu" else C.gpu_like_cost_line()
    pairs: list[tuple[float, float, int, int]] = []
    observe = SR.LearnedStop.observe

    def recording(self, req_id, drafted, accepted, committed):
        r = self._req.get(req_id)
        if r is not None and r.pending is not None and drafted > 0:
            _, raw, q = r.pending
            for i in range(min(drafted, q.size)):
                pairs.append((q[i], raw[i], i, int(i < accepted)))
        return observe(self, req_id, drafted, accepted, committed)

    SR.LearnedStop.observe = recording
    try:
        for w in args.workloads.split(","):
            rows = C.load_records(RECORDS[w][0], None, half="odd")
            pairs.clear()
            stop_fit.replay_speedup(rows, line, "learned", args.model or None)
            a = np.array(pairs)
            print(w, "positions", len(a), "c", line.relative_token_cost)
            for lo, hi in zip(EDGES, EDGES[1:]):
                m = (a[:, 0] >= lo) & (a[:, 0] < hi)
                if m.sum():
                    print(f"  q in [{lo:.2f},{hi:.2f}): n {m.sum():6d} mean q "
                          f"{a[m, 0].mean():.3f} raw {a[m, 1].mean():.3f} hit {a[m, 3].mean():.3f}")
    finally:
        SR.LearnedStop.observe = observe


if __name__ == "__main__":
    main()
