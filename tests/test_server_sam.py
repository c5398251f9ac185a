"""A real ``vllm serve`` (through ``specplug vllm serve``) with SAM, queried with
the ``openai`` client: greedy outputs equal plain decoding's, streaming and not."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import requests

from helpers import chat, pick, serve

pytestmark = pytest.mark.server

SAM = {"method": "sam", "num_speculative_tokens": 8}
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    yield from serve(model_path, tmp_path_factory, SAM)


@pytest.fixture(scope="module")
def prompts_and_reference(get_llm, spec_bench_prompts):
    rows = pick(spec_bench_prompts, ["summarization", "rag", "coding", "writing"], 1)
    prompts = [r["prompt"] for r in rows]
    plain = get_llm("plain")
    # One request at a time, as the client below sends them.
    ref = [list(chat(plain, [p], max_tokens=MAX_TOKENS)[0].outputs[0].token_ids)
           for p in prompts]
    return prompts, ref


def _client(base):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)


def test_served_sam_non_streaming_matches_plain(server, prompts_and_reference):
    client = _client(server)
    prompts, ref = prompts_and_reference
    for p, want in zip(prompts, ref):
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": p}], temperature=0,
            max_tokens=MAX_TOKENS, extra_body={"return_token_ids": True})
        got = r.choices[0].model_extra["token_ids"]
        assert got == want


def test_served_sam_streaming_matches_plain(server, prompts_and_reference):
    client = _client(server)
    prompts, ref = prompts_and_reference
    for p, want in zip(prompts, ref):
        stream = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": p}], temperature=0,
            max_tokens=MAX_TOKENS, stream=True, extra_body={"return_token_ids": True})
        got: list[int] = []
        for chunk in stream:
            if chunk.choices:
                got.extend(chunk.choices[0].model_extra.get("token_ids") or [])
        assert got == want


def test_served_spec_decode_metrics(server, prompts_and_reference):
    prompts, _ = prompts_and_reference
    _client(server).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": prompts[0]}], temperature=0,
        max_tokens=MAX_TOKENS)
    text = requests.get(server + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    assert values.get("vllm:spec_decode_num_drafts_total", 0) > 0, values
    assert values.get("vllm:spec_decode_num_accepted_tokens_total", 0) > 0, values


def test_vllm_bench_serve_spec_bench_against_sam(server, model_path, tmp_path):
    """vLLM's own serving benchmark with its spec_bench dataset runs against us."""
    from vllm_specplug.bench.prompts import spec_bench_path

    r = subprocess.run(
        [sys.executable, "-m", "vllm_specplug.cli", "vllm", "bench", "serve",
         "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
         "--base-url", server, "--model", "smollm2", "--tokenizer", model_path,
         "--dataset-name", "spec_bench", "--dataset-path", str(spec_bench_path()),
         "--spec-bench-category", "summarization", "--num-prompts", "3",
         "--spec-bench-output-len", "32", "--max-concurrency", "1", "--seed", "0",
         "--save-result", "--result-dir", str(tmp_path), "--result-filename", "sam.json"],
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    res = json.loads((tmp_path / "sam.json").read_text())
    assert res["completed"] == 3 and res.get("failed", 0) == 0
    assert res["total_output_tokens"] > 0
    print(r.stdout[-3000:])


def _draft_tokens(server) -> float:
    text = requests.get(server + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:spec_decode_num_draft_tokens_total"))


def test_served_request_turns_drafts_off_or_caps_them(server, prompts_and_reference):
    """Per request through the OpenAI server's vllm_xargs: "specplug_draft": 0
    drafts nothing, "specplug_max_draft": 1 at most a token a step (counted
    by the server's metrics; one request at a time), a malformed value is a
    400 naming the key; outputs stay plain decoding's."""
    import openai

    client = _client(server)
    prompts, ref = prompts_and_reference

    def ask(xargs):
        before = _draft_tokens(server)
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": prompts[3]}], temperature=0,
            max_tokens=MAX_TOKENS, extra_body={"return_token_ids": True, "vllm_xargs": xargs})
        assert r.choices[0].model_extra["token_ids"] == ref[3]
        return _draft_tokens(server) - before

    assert ask({"specplug_share": 1}) > MAX_TOKENS / 4    # drafts flow without the keys
    assert ask({"specplug_draft": 0}) == 0
    assert 0 < ask({"specplug_max_draft": 1}) <= MAX_TOKENS
    with pytest.raises(openai.BadRequestError, match="specplug_max_draft"):
        ask({"specplug_max_draft": -1})
