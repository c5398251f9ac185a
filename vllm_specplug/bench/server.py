"""A real ``vllm serve`` (through ``specplug vllm serve``) in a subprocess, for
the serving benchmark script and the server tests."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence


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
