"""The goodput controller in a real engine (vllm_specplug.goodput): a method
whose drafts are always rejected ends up drafting almost nothing, counted
from the drafter's own stats; output stays plain decoding's. Speed is the
benchmark's business, never a timed test."""
from __future__ import annotations

import pytest

from helpers import assert_same_tokens, chat, engine_stats, pick

pytestmark = pytest.mark.engine

MAX_TOKENS = 64
K = 8
# Token 0 is <|endoftext|>: a chain of it is rejected wherever the target
# does not end the text, so nearly every draft fails.
REJECTED = {"method": "debug_random_tree", "num_speculative_tokens": K,
            "random_shape": "chain", "random_tokens": "0", "batch_budget": "off"}


@pytest.fixture(scope="module")
def prompts(spec_bench_prompts):
    rows = pick(spec_bench_prompts, ["writing", "qa", "coding", "math_reasoning"], 2)
    return [r["prompt"] for r in rows]


def drafted_per_row(llm, prompts):
    before = engine_stats(llm)["propose_time"]
    outs = chat(llm, prompts, max_tokens=MAX_TOKENS, ignore_eos=True)
    after = engine_stats(llm)
    rows = after["propose_time"]["rows"] - before["rows"]
    tokens = after["propose_time"]["draft_tokens"] - before["draft_tokens"]
    return outs, tokens / rows, after


def test_always_rejected_drafts_are_backed_off(get_llm, prompts):
    """A fixed batch of 8 requests, 64 tokens each (about 64 steps), drafting
    8 tokens of <|endoftext|> a step. Without the controller every decoding
    row drafts about 8 tokens a step; with it each request is muted after 3
    failed drafts and probed with 2 tokens after 4, 8, 16, 32 steps, so rows
    draft under 1 token a step over the run."""
    ref = chat(get_llm("plain"), prompts, max_tokens=MAX_TOKENS, ignore_eos=True)
    off, per_row_off, _ = drafted_per_row(get_llm("goodput_off", dict(REJECTED)), prompts)
    assert_same_tokens(ref, off)
    assert per_row_off > 6.0, per_row_off
    on, per_row_on, stats = drafted_per_row(
        get_llm("goodput_on", dict(REJECTED, goodput="on")), prompts)
    assert_same_tokens(ref, on)
    assert per_row_on < 1.0, (per_row_on, stats["backoff"], stats["goodput"])
    assert stats["backoff"]["mutes"] >= len(prompts), stats["backoff"]
    # every request left: the backoff keeps no record of it
    assert stats["sizes"]["backoff_requests"] == 0, stats["sizes"]


def _counts(llm, prompts, extra_args):
    from vllm import SamplingParams

    before = engine_stats(llm)["propose_time"]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, extra_args=extra_args)
    # one request at a time: a batch's budget would cut sam's drafts anyway
    outs = [llm.chat([[{"role": "user", "content": p}]], params, use_tqdm=False)[0]
            for p in prompts]
    after = engine_stats(llm)["propose_time"]
    return outs, after["draft_tokens"] - before["draft_tokens"], after["rows"] - before["rows"]


def test_a_request_turns_its_drafts_off_or_caps_them(get_llm, prompts):
    """Per request, offline: extra_args "specplug_draft": False decodes the
    request without drafts, "specplug_max_draft": 1 drafts at most one token
    a row-step. One request at a time; the prompts were answered once before,
    so sam's global store holds the answers and the same requests without the
    keys draft more than 2 tokens a row-step (the floor that lets this test
    fail). Outputs are plain's."""
    ref = chat(get_llm("plain"), prompts, max_tokens=MAX_TOKENS)
    llm = get_llm("sam_k8", {"method": "sam", "num_speculative_tokens": K,
                             "batch_budget": "off"})
    _counts(llm, prompts, None)          # the answers enter the global store
    free, drafted, rows = _counts(llm, prompts, None)
    assert_same_tokens(ref, free)
    assert drafted > 2 * rows, (drafted, rows)
    off, drafted, rows = _counts(llm, prompts, {"specplug_draft": False})
    assert_same_tokens(ref, off)
    assert drafted == 0 and rows > 0
    capped, drafted, rows = _counts(llm, prompts, {"specplug_max_draft": 1})
    assert_same_tokens(ref, capped)
    assert 0 < drafted <= rows, (drafted, rows)
