"""Tenants do not see each other through drafts, in a real engine
(docs/security.md; the fast tests are tests/test_isolation.py).

One prompt is answered four times through ``LLM.generate`` by ``sam`` (its
global store on, with live windows: the defaults): by tenant A (``cache_salt``
"tenant-a"), then by tenant B (another salt), by A's salt again, and by A's
salt with the request's opt-out. Greedy answers repeat word for word, so a
request that may read A's output drafts most of its answer from the global
store. B and the opted-out request accept no draft from the store; the request
with A's salt accepts at least a third of its tokens from it (the floor that
lets this test fail). Every answer is plain decoding's.

A runs to MAX_TOKENS, so its live windows enter tenant A's store while it
runs. The later three stop at SHORT_TOKENS, before their own first live
window (``sam.LIVE_EVERY`` output tokens): every global-store draft they make
can only come from what earlier requests left there, so a draft of B's is a
leak, not B reading its own window.
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine

SAM_BUDGET_OFF = {"method": "sam", "num_speculative_tokens": 8, "batch_budget": "off"}
PROMPT = "Write a short poem about the sea, in four lines."
MAX_TOKENS = 48
# below sam.LIVE_EVERY (checked in the test): no live window of its own
SHORT_TOKENS = 12


def _generate(llm, ids, salt=None, extra_args=None, max_tokens=MAX_TOKENS):
    from vllm import SamplingParams

    prompt = {"prompt_token_ids": ids}
    if salt is not None:
        prompt["cache_salt"] = salt
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra_args)
    return llm.generate([prompt], params, use_tqdm=False)[0]


def _global(llm) -> dict:
    from helpers import engine_stats

    return engine_stats(llm)["proposer"]


def test_tenants_with_different_salts_never_draft_each_others_outputs(get_llm):
    from vllm_specplug.proposers.sam import LIVE_EVERY, SamProposer

    assert SHORT_TOKENS < LIVE_EVERY - 1
    live = next(o for o in SamProposer.options if o.name == "sam_global_live")
    assert live.default is True   # the shipped default is what this engine runs
    plain_llm = get_llm("plain")
    tokenizer = plain_llm.get_tokenizer()
    ids = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)
    plain = list(_generate(plain_llm, ids).outputs[0].token_ids)
    assert len(plain) >= 32

    llm = get_llm("sam_budget_off", SAM_BUDGET_OFF)
    runs = {}
    for name, salt, extra, n in (("a", "tenant-a", None, MAX_TOKENS),
                                 ("b", "tenant-b", None, SHORT_TOKENS),
                                 ("a_again", "tenant-a", None, SHORT_TOKENS),
                                 ("a_opted_out", "tenant-a", {"specplug_share": False},
                                  SHORT_TOKENS)):
        before = _global(llm)
        out = _generate(llm, ids, salt, extra, n)
        after = _global(llm)
        runs[name] = {"tokens": list(out.outputs[0].token_ids),
                      "global_drafts": after["global_drafts"] - before["global_drafts"],
                      "global_accepted": after["global_accepted"] - before["global_accepted"],
                      "tenants": after["global_store_tenants"]}
    for name, run in runs.items():
        assert run["tokens"] == plain[: len(run["tokens"])], name
        assert len(run["tokens"]) == (MAX_TOKENS if name == "a" else SHORT_TOKENS), name
    # A's output reaches the store at B's first step (when the runner frees A)
    assert runs["b"]["global_drafts"] == 0 and runs["b"]["global_accepted"] == 0, runs
    assert runs["a_opted_out"]["global_drafts"] == 0, runs
    # the same salt drafts A's answer (nothing else of tenant A is there yet):
    # the positive control, over the same short answer as B's
    assert runs["a_again"]["global_accepted"] >= SHORT_TOKENS // 3, runs
    # tenant-a and tenant-b each have a store (A's, then B's answer)
    assert runs["a_opted_out"]["tenants"] == 2, runs
