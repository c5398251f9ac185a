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
