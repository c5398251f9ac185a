"""Serving-mode benchmark: vLLM's own `vllm bench serve --dataset-name spec_bench`
against `vllm serve` (through `specplug vllm`), one server per method.

Usage: python scripts/bench_serve.py [--methods plain,sam] [--num-prompts 26]
           [--output-len 128] [--concurrency 1] [--out serve_bench]
Writes OUT/<method>.json (vLLM's result file) and OUT/<method>.txt (its report).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def run_method(method: str, model: str, args: argparse.Namespace, out: Path) -> None:
    from vllm_specplug.bench.engine import METHOD_CONFIGS
    from vllm_specplug.bench.prompts import spec_bench_path
    from vllm_specplug.bench.server import running_server

    serve_args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
                  "--served-model-name", "smollm2"]
    if METHOD_CONFIGS[method] is not None:
        serve_args += ["--speculative-config", json.dumps(METHOD_CONFIGS[method])]
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    log = out / f"{method}.server.log"
    try:
        with running_server(model, serve_args, log, env=env) as base:
            bench = [sys.executable, "-m", "vllm_specplug.cli", "vllm", "bench", "serve",
                     "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
                     "--base-url", base, "--model", "smollm2", "--tokenizer", model,
                     "--dataset-name", "spec_bench", "--dataset-path", str(spec_bench_path()),
                     "--num-prompts", str(args.num_prompts),
                     "--spec-bench-output-len", str(args.output_len),
                     "--max-concurrency", str(args.concurrency), "--seed", "0",
                     "--temperature", "0", "--save-result", "--result-dir", str(out),
                     "--result-filename", f"{method}.json"]
            r = subprocess.run(bench, capture_output=True, text=True)
    except RuntimeError as e:
        sys.exit(f"{method}: {e}")
    (out / f"{method}.txt").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        sys.exit(f"vllm bench serve failed for {method}; see {out / (method + '.txt')}")
    start = r.stdout.find("============ Serving Benchmark Result")
    print(f"## {method}\n{r.stdout[start:] if start >= 0 else r.stdout[-3000:]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="plain,sam")
    ap.add_argument("--num-prompts", type=int, default=26)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--out", default="serve_bench")
    args = ap.parse_args()
    methods = args.methods.split(",")
    from vllm_specplug.bench.engine import METHOD_CONFIGS
    from vllm_specplug.models import default_model_path

    unknown = [m for m in methods if m not in METHOD_CONFIGS]
    if unknown:
        sys.exit(f"unknown method(s) {unknown}; choose from {sorted(METHOD_CONFIGS)}")

    model = default_model_path()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for m in methods:
        run_method(m, model, args, out)


if __name__ == "__main__":
    main()
