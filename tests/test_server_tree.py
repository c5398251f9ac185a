"""A real ``vllm serve`` with ``token_recycling`` (tree drafts verified in the
server's engine): concurrent greedy requests, streamed and not, give plain
decoding's token ids, and the shared matrix learns while serving."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import ask_served, chat, pick, serve

pytestmark = pytest.mark.server

TR = {"method": "token_recycling", "num_speculative_tokens": 12}
MAX_TOKENS = 40
CATEGORIES = ["summarization", "rag", "coding", "writing", "math_reasoning", "translation"]


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    yield from serve(model_path, tmp_path_factory, TR)


@pytest.fixture(scope="module")
def prompts_and_reference(get_llm, spec_bench_prompts):
    prompts = [r["prompt"] for r in pick(spec_bench_prompts, CATEGORIES, 1)]
    plain = get_llm("plain")
    ref = [list(o.outputs[0].token_ids) for o in chat(plain, prompts, max_tokens=MAX_TOKENS)]
    return prompts, ref


def _ask(base: str, prompt: str, stream: bool) -> list[int]:
    return ask_served(base, prompt, stream, MAX_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_served_token_recycling_concurrent_requests_match_plain(server, prompts_and_reference,
                                                               stream):
    """All prompts at once (the server batches them, each with its own tree)."""
    prompts, ref = prompts_and_reference
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: _ask(server, p, stream), prompts))
    for p, g, want in zip(prompts, got, ref):
        assert g == want, p[:80]


@pytest.mark.slow
def test_served_token_recycling_drafts_and_accepts(server, prompts_and_reference):
    """vLLM's own counters on /metrics show the trees were drafted and accepted."""
    import requests

    prompts, _ = prompts_and_reference
    _ask(server, prompts[0], stream=False)
    text = requests.get(server + "/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        for name in ("vllm:spec_decode_num_draft_tokens_total",
                     "vllm:spec_decode_num_accepted_tokens_total"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    assert values.get("vllm:spec_decode_num_draft_tokens_total", 0) > 0, values
    assert values.get("vllm:spec_decode_num_accepted_tokens_total", 0) > 0, values
