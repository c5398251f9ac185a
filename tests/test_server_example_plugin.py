"""The example third-party plugin (examples/third_party_plugin), installed
with pip and used through a real ``vllm serve``.

The package is installed with ``pip install --no-deps --target`` into a
temporary directory (a copy of the sources is built, so the checkout stays
clean), which is put on ``PYTHONPATH`` of the subprocesses only: its
``.dist-info`` (and so its entry points) is visible to ``specplug list`` and
to the server and its engine process, and nothing outside the temporary
directory changes.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import chat

pytestmark = pytest.mark.server

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "third_party_plugin"
MAX_ACCEPT = 2
SPEC = {"method": "example_repeat_ngram", "num_speculative_tokens": 4, "repeat_n": 2,
        "acceptance": {"name": "example_capped", "max_accept": MAX_ACCEPT}}
MAX_TOKENS = 32
# The first two make SmolLM2 repeat a two-token cycle, which the example
# proposer (repeat the last 2 tokens) drafts right; the third does not.
PROMPTS = [
    "Repeat exactly ten times: the cat the cat the cat the cat the cat the cat",
    "Write the word 'hello' twenty times, separated by spaces.",
    "Write a Python function that returns the n-th Fibonacci number.",
]


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    """Environment for subprocesses that see the installed example plugin."""
    d = tmp_path_factory.mktemp("example_plugin")
    src, site = d / "src", d / "site"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__", "dist"))
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "--quiet", "--target", str(site),
         str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert list(site.glob("specplug_example-*.dist-info")), sorted(os.listdir(site))
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path}


def test_specplug_list_shows_the_example_scorer_and_proposer(plugin_env):
    r = subprocess.run([sys.executable, "-m", "vllm_specplug.cli", "list"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, **plugin_env})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "example_repeat_ngram" in r.stdout, r.stdout
    assert "example_capped" in r.stdout, r.stdout
    # and not in this process: the installation stayed in its directory
    import importlib.metadata

    assert not [d for d in importlib.metadata.distributions()
                if (d.metadata["Name"] or "").lower() == "specplug-example"]


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory, plugin_env):
    from vllm_specplug.bench.server import running_server

    log = tmp_path_factory.mktemp("server_example") / "server.log"
    args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
            "--served-model-name", "smollm2", "--speculative-config", json.dumps(SPEC)]
    try:
        with running_server(model_path, args, log,
                            env={"VLLM_CPU_KVCACHE_SPACE": "1", **plugin_env}) as base:
            yield base
    except RuntimeError as e:
        pytest.fail(str(e))


def _client(base):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)


def _spec_counters(base: str) -> dict:
    """vLLM's spec-decode counters on /metrics: drafts, accepted, and accepted
    per draft position."""
    import requests

    out = {"drafts": 0.0, "accepted": 0.0, "per_pos": {}}
    for line in requests.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        if name.startswith("vllm:spec_decode_num_drafts_total"):
            out["drafts"] += float(value)
        elif name.startswith("vllm:spec_decode_num_accepted_tokens_total"):
            out["accepted"] += float(value)
        elif name.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total"):
            pos = int(name.split('position="', 1)[1].split('"', 1)[0])
            out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + float(value)
    return out


@pytest.mark.slow
def test_served_example_plugin_greedy_matches_plain(server, get_llm):
    plain = get_llm("plain")
    want = [list(chat(plain, [p], max_tokens=MAX_TOKENS)[0].outputs[0].token_ids)
            for p in PROMPTS]
    client = _client(server)
    for p, w in zip(PROMPTS, want):
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": p}], temperature=0,
            max_tokens=MAX_TOKENS, extra_body={"return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == w, p
    counters = _spec_counters(server)
    print(f"\nexample plugin, greedy: {counters}")
    assert counters["drafts"] > 0, counters  # the example proposer drafted
    assert counters["accepted"] > 0, counters


@pytest.mark.slow
def test_served_example_scorer_caps_acceptance(server):
    """At temperature > 0 the example scorer decides: it never accepts more
    than ``max_accept`` drafted tokens per step."""
    before = _spec_counters(server)
    client = _client(server)
    for p in PROMPTS:
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": p}], temperature=0.7,
            max_tokens=MAX_TOKENS, seed=0)
        assert r.choices[0].finish_reason in ("stop", "length")
    after = _spec_counters(server)
    grew = {pos: after["per_pos"].get(pos, 0) - before["per_pos"].get(pos, 0)
            for pos in after["per_pos"]}
    print(f"\nexample plugin, temperature 0.7: accepted per position {grew}")
    assert after["drafts"] > before["drafts"]
    assert all(v == 0 for pos, v in grew.items() if pos >= MAX_ACCEPT), grew
    assert sum(v for pos, v in grew.items() if pos < MAX_ACCEPT) > 0, grew  # not vacuous
