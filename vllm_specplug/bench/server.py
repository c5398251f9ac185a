"""A real ``vllm serve`` (through ``specplug vllm serve``) in a subprocess, for
the serving benchmarks (scripts/bench_serve.py, ``specplug bench matrix``)
and the server tests."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence


def serve_args(speculative_config: dict | None, served_name: str,
               max_model_len: int = 4096) -> list[str]:
    """``vllm serve`` options matching the offline engine's
    (``offline_engine.engine_kwargs``: float32, eager, 4,096 tokens, seed 0),
    with the method's speculative config (None: plain decoding)."""
    args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len),
            "--served-model-name", served_name, "--seed", "0"]
    if speculative_config is not None:
        args += ["--speculative-config", json.dumps(speculative_config)]
    return args


def server_env(stats_file: Path) -> dict[str, str]:
    """The server's KV cache size (the user's, else 2 GB), and where our
    drafter writes its counters (batch budgets, its own time; cumulative
    over the server's life)."""
    return {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
            "VLLM_SPECPLUG_STATS_FILE": str(stats_file)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(model: str, args: Sequence[str], log: Path, env: dict | None = None,
                   timeout: float = 300) -> Iterator[str]:
    """Start ``specplug vllm serve MODEL --host 127.0.0.1 --port P ARGS...``,
    wait for ``/health``, yield its base URL, stop it afterwards. Raises
    ``RuntimeError`` with the end of ``log`` if it exits or does not start."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vllm_specplug.cli", "vllm", "serve", model,
           "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n"
                                   f"{Path(log).read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"server did not start in {timeout:.0f} s:\n"
                                   f"{Path(log).read_text()[-4000:]}")
            time.sleep(2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
