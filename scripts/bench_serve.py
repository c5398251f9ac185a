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
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CONFIGS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 8,
              "prompt_lookup_max": 5, "prompt_lookup_min": 2},
    "sam": {"method": "sam", "num_speculative_tokens": 8},
    "token_recycling": {"method": "token_recycling"},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, base: str, log: Path, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.time() > deadline:
            sys.exit(f"server did not start in {timeout:.0f} s; see {log}")
        time.sleep(2)


def run_method(method: str, model: str, args: argparse.Namespace, out: Path) -> None:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vllm_specplug.cli", "vllm", "serve", model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--enforce-eager", "--max-model-len", "4096", "--served-model-name", "smollm2"]
    if CONFIGS[method] is not None:
        cmd += ["--speculative-config", json.dumps(CONFIGS[method])]
    env = {**os.environ}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    log = out / f"{method}.server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_healthy(proc, base, log)
        from vllm_specplug.bench.prompts import spec_bench_path

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
        (out / f"{method}.txt").write_text(r.stdout + r.stderr)
        if r.returncode != 0:
            sys.exit(f"vllm bench serve failed for {method}; see {out / (method + '.txt')}")
        start = r.stdout.find("============ Serving Benchmark Result")
        print(f"## {method}\n{r.stdout[start:] if start >= 0 else r.stdout[-3000:]}",
              flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


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
    unknown = [m for m in methods if m not in CONFIGS]
    if unknown:
        sys.exit(f"unknown method(s) {unknown}; choose from {sorted(CONFIGS)}")
    from vllm_specplug.models import default_model_path

    model = default_model_path()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for m in methods:
        run_method(m, model, args, out)


if __name__ == "__main__":
    main()
