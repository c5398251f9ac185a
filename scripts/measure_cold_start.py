"""The first requests of a fresh engine, per method, with an empty numba cache.

Each method runs in its own process and engine, with ``NUMBA_CACHE_DIR`` set
to a new empty folder (as on a fresh install, a container or a new node):
the engine's start time, then the first ``--requests`` requests one at a
time (``--max-tokens`` greedy tokens each; chat prompts from Spec-Bench),
each with its wall time and its time to first token. The step-cost cache is
left as it is (``VLLM_SPECPLUG_STEP_COST_CACHE``), so only compile-type cold
starts show.

    flock /tmp/specplug-engine.lock python scripts/measure_cold_start.py \
        --methods plain,sam,sam_tr,token_recycling --out results/runs/cold_start.json

Pass: for each method, the slowest of the first requests is within 10% of
plain decoding's slowest.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def one(method: str, requests: int, max_tokens: int) -> dict:
    """Run in the child: one fresh engine, the first requests."""
    import logging

    # the plugin's warm-up lines (INFO) in the engine's log
    logging.getLogger("vllm_specplug").setLevel(logging.INFO)
    logging.getLogger("vllm_specplug").addHandler(logging.StreamHandler())
    from vllm import SamplingParams

    from vllm_specplug.bench.engine import METHOD_CONFIGS, build_llm
    from vllm_specplug.bench.prompts import load_prompts
    from vllm_specplug.models import default_model_path

    prompts = [p["prompt"] for p in load_prompts(None, 1, None)][:requests]
    t0 = time.perf_counter()
    llm = build_llm(default_model_path(), METHOD_CONFIGS[method], max_model_len=2048)
    start = time.perf_counter() - t0
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    rows = []
    for p in prompts:
        t = time.perf_counter()
        out = llm.chat([[{"role": "user", "content": p}]], sp, use_tqdm=False)[0]
        dt = time.perf_counter() - t
        m = out.metrics
        rows.append({"seconds": dt, "generated": len(out.outputs[0].token_ids),
                     "ttft": m.first_token_latency if m is not None else None})
    return {"method": method, "engine_start_seconds": start, "requests": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="plain,sam,sam_tr,token_recycling")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("@@" + json.dumps(one(args.child, args.requests, args.max_tokens)), flush=True)
        return
    results = []
    for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
        with tempfile.TemporaryDirectory(prefix="numba-cold-") as cache:
            env = {**os.environ, "NUMBA_CACHE_DIR": cache, "VLLM_CPU_KVCACHE_SPACE": "1"}
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--child", method, "--requests",
                                   str(args.requests), "--max-tokens", str(args.max_tokens)],
                                  env=env, capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("@@")), None)
            if proc.returncode != 0 or line is None:
                sys.stderr.write(proc.stderr[-4000:])
                raise SystemExit(f"{method}: exit {proc.returncode}")
            res = json.loads(line[2:])
            res["process_seconds"] = time.perf_counter() - t
            res["log"] = [ln for ln in proc.stderr.splitlines() if "vllm_specplug:" in ln][-6:]
        results.append(res)
        print(f"{method:16s} start {res['engine_start_seconds']:5.1f} s  requests "
              + "  ".join(f"{r['seconds']:.2f} s (TTFT {r['ttft']:.2f})" for r in res["requests"]),
              flush=True)
    plain = next((r for r in results if r["method"] == "plain"), None)
    if plain is not None:
        bar = max(r["seconds"] for r in plain["requests"])
        for res in results:
            worst = max(r["seconds"] for r in res["requests"])
            res["slowest_over_plain"] = worst / bar
            res["engine_start_over_plain_seconds"] = (res["engine_start_seconds"]
                                                      - plain["engine_start_seconds"])
            print(f"{res['method']:16s} slowest / plain's slowest {worst / bar:.2f}; engine start "
                  f"{res['engine_start_over_plain_seconds']:+.1f} s against plain")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"max_tokens": args.max_tokens, "results": results,
                       "date": time.strftime("%Y-%m-%d %H:%M:%S")}, f, indent=1)


if __name__ == "__main__":
    main()
