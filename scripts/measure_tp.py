"""Tokens/s and memory per rank at tensor-parallel sizes 1 and 2 (CPU, ``mp``).

One engine per (TP size, method), each run in its own subprocess (so one
engine's memory is gone before the next starts): greedy, one prompt at a time
(bs = 1), the first ``--per-category`` Spec-Bench prompts of each category,
``--max-tokens`` each, one untimed warm-up prompt first. Memory: resident
set (RSS) and unique set (USS, memory no other process shares, e.g. not the
shared libraries) of every worker process, read in the worker itself after
the run, plus the engine-core process.

    python scripts/measure_tp.py [--model PADDED_MODEL] [--tp 1,2] [--methods plain,sam]

The model defaults to the embedded model with zero-padded heads
(``padded_heads_model_path(2)``), which both TP sizes can load. TP > 1 sets
``VLLM_CPU_OMP_THREADS_BIND`` to one core per rank (``0|1`` on 2 cores).
Prints one JSON line per engine and a Markdown table at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

METHODS = {"plain": None, "sam": {"method": "sam", "num_speculative_tokens": 8},
           "token_recycling": {"method": "token_recycling", "num_speculative_tokens": "auto"}}


def _memory(worker) -> dict:
    import os as _os

    import psutil

    p = psutil.Process()
    full = p.memory_full_info()
    return {"rank": worker.rank, "pid": _os.getpid(), "rss_mb": full.rss / 2**20,
            "uss_mb": full.uss / 2**20}


def run_one(model: str, tp: int, method: str, per_category: int, max_tokens: int) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    import psutil
    from vllm import SamplingParams

    from vllm_specplug.bench.engine import build_llm, counter_delta, read_spec_counters
    from vllm_specplug.bench.prompts import load_prompts

    t0 = time.perf_counter()
    llm = build_llm(model, METHODS[method], max_model_len=2048, tensor_parallel_size=tp,
                    **({"distributed_executor_backend": "mp"} if tp > 1 else {}))
    start_s = time.perf_counter() - t0
    prompts = [r["prompt"] for r in load_prompts(per_category=per_category)]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    def chat(p):
        return llm.chat([[{"role": "user", "content": p}]], sp, use_tqdm=False)

    chat(prompts[0])  # warm-up, untimed
    before = read_spec_counters(llm)
    generated, wall = 0, 0.0
    for p in prompts:
        t = time.perf_counter()
        out = chat(p)
        wall += time.perf_counter() - t
        generated += len(out[0].outputs[0].token_ids)
    delta = counter_delta(read_spec_counters(llm), before)
    workers = llm.llm_engine.collective_rpc(_memory)
    me = psutil.Process()
    others = []
    for child in me.children(recursive=True):
        if child.pid in {w["pid"] for w in workers}:
            continue
        try:
            info = child.memory_full_info()
            others.append({"pid": child.pid, "name": child.name(), "rss_mb": info.rss / 2**20,
                           "uss_mb": info.uss / 2**20})
        except psutil.Error:
            pass
    own = me.memory_full_info()
    return {"tp": tp, "method": method, "prompts": len(prompts), "generated": generated,
            "wall_s": wall, "tok_s": generated / wall, "tau": generated / (generated -
                                                                             delta["accepted"]),
            "start_s": start_s, "workers": workers, "other_processes": others,
            "driver": {"rss_mb": own.rss / 2**20, "uss_mb": own.uss / 2**20}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--methods", default="plain,sam")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.model is None:
        from vllm_specplug.models import padded_heads_model_path

        args.model = padded_heads_model_path(2)
    if args.one:
        res = run_one(args.model, int(args.tp), args.methods, args.per_category, args.max_tokens)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    rows = []
    for tp in [int(x) for x in args.tp.split(",")]:
        for method in args.methods.split(","):
            cmd = [sys.executable, os.path.abspath(__file__), "--one", "--model", args.model,
                   "--tp", str(tp), "--methods", method, "--per-category",
                   str(args.per_category), "--max-tokens", str(args.max_tokens)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"tp={tp} {method}: failed (rc {proc.returncode})")
            res = json.loads(line[-1][len("RESULT "):])
            print(json.dumps(res), flush=True)
            rows.append(res)
    print("\n| TP | method | tok/s | tau | RSS per rank (MB) | USS per rank (MB) | engine core RSS (MB) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        rss = ", ".join(f"{w['rss_mb']:.0f}" for w in r["workers"])
        uss = ", ".join(f"{w['uss_mb']:.0f}" for w in r["workers"])
        core = ", ".join(f"{o['rss_mb']:.0f}" for o in r["other_processes"]
                         if "EngineCore" in o["name"] or "VLLM" in o["name"]) or "-"
        print(f"| {r['tp']} | {r['method']} | {r['tok_s']:.1f} | {r['tau']:.2f} | {rss} | "
              f"{uss} | {core} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
