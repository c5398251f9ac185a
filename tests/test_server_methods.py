"""A real ``vllm serve`` with the model-driven methods (``del`` drafts with
the target's own first layers, ``eagle2`` with an EAGLE head): concurrent
greedy requests, streamed and not, give plain decoding's token ids, and the
server drafted (vLLM's own counters on /metrics)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import ask_served, chat, pick, serve

pytestmark = pytest.mark.server

MAX_TOKENS = 40
CATEGORIES = ["summarization", "coding", "writing", "math_reasoning"]


@pytest.fixture(scope="module", params=["del", "eagle2"])
def server(request, model_path, tmp_path_factory):
    if request.param == "del":
        spec = {"method": "del", "num_speculative_tokens": 3}
    else:
        head = request.getfixturevalue("eagle_trained_head")
        spec = {"method": "eagle2", "model": head, "num_speculative_tokens": 8,
                "depth": 3, "topk": 4}
    yield from serve(model_path, tmp_path_factory, spec)


@pytest.fixture(scope="module")
def prompts_and_reference(get_llm, spec_bench_prompts):
    prompts = [r["prompt"] for r in pick(spec_bench_prompts, CATEGORIES, 1)]
    ref = [list(o.outputs[0].token_ids)
           for o in chat(get_llm("plain"), prompts, max_tokens=MAX_TOKENS)]
    return prompts, ref


@pytest.mark.slow
def test_served_method_concurrent_requests_match_plain(server, prompts_and_reference):
    import requests

    prompts, ref = prompts_and_reference
    # half streamed, half not, all at once
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda ip: ask_served(server, ip[1], ip[0] % 2 == 1, MAX_TOKENS),
                            enumerate(prompts)))
    for p, g, want in zip(prompts, got, ref):
        assert g == want, p[:80]
    metrics = requests.get(server + "/metrics", timeout=30).text
    drafts = [float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith("vllm:spec_decode_num_draft_tokens_total")]
    assert drafts and sum(drafts) > 0, metrics[-2000:]
