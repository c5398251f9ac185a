"""Where the drafter's host time goes: wall-clock timers around its hooks
and the proposer's parts, in one in-process engine (no profiler overhead
beyond one ``perf_counter`` pair a call).

One engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the worker's code runs
in this process), greedy, ``--max-tokens`` tokens a request. A first batch
(four requests of the workload's other half) warms it; then the timers are
reset and ``--limit`` requests of ``--half`` run at once with at most
``--batch-size`` in flight. Prints, per timed function, the total ms, its
calls and the microseconds a call; ``SpecPlugDrafter.propose`` is one call a
step, ``SpecPlugDrafter._propose_row`` one a decoding row. The functions are
named in ``TARGETS``; a name that no longer exists is reported and skipped.

Usage: python scripts/measure_host_time.py [--method sam] [--workload pipeline]
       [--half odd] [--limit 16] [--batch-size 16] [--max-tokens 48] [--k 8]
       [--out FILE.json]
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import time

TARGETS = [
    ("vllm_specplug.vllm_adapter.v1.drafter", "SpecPlugDrafter", "propose"),
    ("vllm_specplug.vllm_adapter.v1.drafter", "SpecPlugDrafter", "_propose_row"),
    ("vllm_specplug.vllm_adapter.v1.drafter", "SpecPlugDrafter", "_fit_to_batch"),
    ("vllm_specplug.vllm_adapter.v1.drafter", "SpecPlugDrafter", "_time_step"),
    ("vllm_specplug.proposers.sam", "SamProposer", "propose"),
    ("vllm_specplug.proposers.sam", "SamProposer", "_choose_learned"),
    ("vllm_specplug.proposers.sam", "SamProposer", "observe"),
    ("vllm_specplug.proposers.sam", "SamProposer", "_match"),
    ("vllm_specplug.proposers.sam", "SamProposer", "_add_completed"),
    ("vllm_specplug.proposers.suffix_automaton", "SuffixAutomaton", "extend"),
    ("vllm_specplug.proposers.stop_rule", "LearnedStop", "score"),
    ("vllm_specplug.proposers.stop_rule", "LearnedStop", "conditional"),
    ("vllm_specplug.proposers.stop_rule", "LearnedStop", "observe"),
    ("vllm_specplug.proposers.token_recycling", "TokenRecyclingProposer", "propose"),
    ("vllm_specplug.proposers.token_recycling", "TokenRecyclingProposer", "observe"),
]


def wrap(acc: dict, module: str, cls: str, name: str) -> None:
    owner = getattr(importlib.import_module(module), cls)
    fn = getattr(owner, name)
    key = f"{cls}.{name}"
    acc[key] = [0.0, 0]

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key][0] += time.perf_counter() - started
            acc[key][1] += 1

    setattr(owner, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="sam")
    ap.add_argument("--workload", default="pipeline")
    ap.add_argument("--half", default="odd", choices=("odd", "even"))
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    acc: dict = {}
    for target in TARGETS:
        try:
            wrap(acc, *target)
        except (ImportError, AttributeError) as e:
            print("not timed:", ".".join(target[1:]), f"({e})")
    from vllm import SamplingParams

    from vllm_specplug.bench.workloads import build_messages, load_workload
    from vllm_specplug.models import default_model_path
    from vllm_specplug.offline_engine import build_llm

    other = "even" if args.half == "odd" else "odd"
    warm = load_workload(args.workload, half=other, limit=4)
    rows = load_workload(args.workload, half=args.half, limit=args.limit)
    llm = build_llm(default_model_path(),
                    {"method": args.method, "num_speculative_tokens": args.k},
                    max_model_len=2048, max_num_seqs=args.batch_size)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.chat([build_messages(r, []) for r in warm], sp, use_tqdm=False)
    for v in acc.values():
        v[:] = [0.0, 0]
    started = time.perf_counter()
    llm.chat([build_messages(r, []) for r in rows], sp, use_tqdm=False)
    seconds = time.perf_counter() - started
    res = {"method": args.method, "workload": args.workload, "half": args.half,
           "requests": len(rows), "batch_size": args.batch_size, "seconds": round(seconds, 3),
           "timers": {k: {"ms": round(1000 * s, 2), "calls": n,
                          "us_per_call": round(1e6 * s / n, 1) if n else None}
                      for k, (s, n) in acc.items()}}
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
