"""The examples (examples/README.md) run as a user runs them, in their own
processes, against the embedded model: greedy output token-identical to
plain decoding, with a floor on accepted draft tokens so that an example
that stopped drafting fails too."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
EXTRACT = EXAMPLES / "offline_batch" / "extract.py"
MAX_TOKENS = 48


def _module(path: Path):
    """An example's module, imported without running its main()."""
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _env(**extra: str) -> dict:
    env = {**os.environ, **extra}
    env.pop("SPECPLUG_MODEL", None)  # the examples' default: the embedded model
    return env


def _run(cmd: list[str], env: dict, timeout: float = 600) -> str:
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd} exited {p.returncode}:\n{(p.stdout + p.stderr)[-4000:]}"
    return p.stdout


def _plain_token_ids(get_llm, chats: list[list[dict]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    outs = get_llm("plain").chat(chats, SamplingParams(temperature=0, max_tokens=max_tokens),
                                 use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _batch_job(get_llm, tmp_path, *args: str, records: int, floor: int, **env: str) -> None:
    """Run the offline batch example; its outputs equal plain decoding's at TP=1."""
    out = tmp_path / "outputs.json"
    # its own step-cost cache: the session's holds fits of earlier engines
    # (tree methods among them, whose verified tokens cost more). In a full
    # CI run of 2026-12-05 this engine accepted 20 of 122 draft tokens
    # (198 of 472 when run alone), most likely from such a prior
    cache = tmp_path / "step_cost"
    cache.mkdir()
    env.setdefault("VLLM_SPECPLUG_STEP_COST_CACHE", str(cache))
    stdout = _run([sys.executable, str(EXTRACT), "--records", str(records), "--max-tokens",
                   str(MAX_TOKENS), "--json", str(out), *args], _env(**env))
    res = json.loads(out.read_text())
    assert "tokens per target step" in stdout and "--- record 0" in stdout
    assert len(res["token_ids"]) == records and all(res["token_ids"]), res["texts"]
    expected = _plain_token_ids(get_llm, _module(EXTRACT).messages(records), MAX_TOKENS)
    assert res["token_ids"] == expected
    assert res["counters"]["accepted"] >= floor, res["counters"]


@pytest.mark.engine
def test_offline_batch_example_matches_plain_decoding(get_llm, tmp_path):
    # measured alone: 8 records x 48 tokens accepted 198 of 472 draft tokens;
    # in full CI runs of 2026-12-05, with its own step-cost cache, 20 of 122
    # and 14 of 89 (outputs identical): its engine kept far fewer drafts
    # there, for a reason not yet found. The floor guards against drafts
    # that are never accepted, not their number, which the batch budget
    # sets from the step costs it measures.
    _batch_job(get_llm, tmp_path, records=8, floor=10)


@pytest.mark.engine
@pytest.mark.slow
def test_offline_batch_example_at_tp2_matches_plain_tp1(get_llm, tmp_path):
    _batch_job(get_llm, tmp_path, "--tensor-parallel-size", "2", "--executor", "mp",
               "--batch-size", "4", records=4, floor=10, VLLM_CPU_OMP_THREADS_BIND="0|1")


def _wait_healthy(proc: subprocess.Popen, base: str, log: Path, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"serve.sh exited {proc.returncode}:\n{log.read_text()[-4000:]}"
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(2)
    pytest.fail(f"serve.sh did not become healthy in {timeout:.0f} s:\n{log.read_text()[-4000:]}")


@pytest.mark.server
def test_serve_example_and_openai_client(get_llm, tmp_path):
    from vllm_specplug.bench.server import free_port

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", str(EXAMPLES / "serve" / "serve.sh")], cwd=ROOT,
                                env=_env(PORT=str(port), METHOD="sam"),
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(proc, base, log)
        out = tmp_path / "replies.json"
        stdout = _run([sys.executable, str(EXAMPLES / "serve" / "client.py"), "--base-url", base,
                       "--max-tokens", str(MAX_TOKENS), "--json", str(out)], _env())
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
        proc.kill()  # a no-op once it has exited
    res = json.loads(out.read_text())
    assert "server counters" in stdout
    client = _module(EXAMPLES / "serve" / "client.py")
    chats = [[{"role": "user", "content": client.TEMPLATE.format(note=n)}] for n in client.NOTES]
    assert all(res["token_ids"])
    assert res["token_ids"] == _plain_token_ids(get_llm, chats, MAX_TOKENS)
    # measured here: 4 replies x 48 tokens accepted 98 of 397 draft tokens
    assert res["counters"]["spec_decode_num_accepted_tokens"] >= 25, res["counters"]
