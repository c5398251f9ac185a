"""Tenants do not see each other through drafts, on a real server
(docs/security.md; issue 45). The offline twin is tests/test_engine_isolation.py;
the fast tests are tests/test_isolation.py.

One ``specplug vllm serve`` with ``sam`` (its global store on, the default
``isolation`` "salt"), queried one request at a time through the OpenAI API
with ``cache_salt`` in the request body; what each request accepted is the
delta of vLLM's own ``vllm:spec_decode_num_accepted_tokens`` counter
(``/metrics``) over it. Greedy answers repeat word for word, so a request
that may read an earlier answer to its prompt drafts most of it from the
global store, and one that may not accepts only what its own context gives.

* phase 1: tenant A ("tenant-a") answers the prompts ``PROMPTS``;
* phase 2: tenant B ("tenant-b") answers the same prompts: it accepts no
  more than A's first pass (within ``TOLERANCE``), however many answers A's
  store holds;
* phase 3: tenant A answers them again: it accepts far more than its first
  pass (``RISE``), the positive control that lets phase 2 fail;
* opt-out: tenant C ("tenant-c") answers ``OPT_OUT_PROMPT`` (a prompt nobody
  else sends) with ``"vllm_xargs": {"specplug_share": 0}``, then without it:
  the second accepts no more than the first (a fresh tenant's pass: the
  opted-out answer fed nothing), and a third (normal) request accepts far
  more (C's store does record its normal answers); an opted-out request of
  tenant A after phase 3 reads nothing either.

Every answer to the same prompt is the same text and token ids, whichever
tenant asks. Checked to fail with ``"isolation": "none"`` in the speculative
config (phase 2 then accepts as much as phase 3). About 2-3 minutes on the
2-core machine, most of it the server's start.
"""
from __future__ import annotations

import time

import pytest

from helpers import serve

pytestmark = pytest.mark.server

SAM = {"method": "sam", "num_speculative_tokens": 8}
MAX_TOKENS = 64
PROMPTS = [
    "Explain in a few sentences what a hash table is and why lookups are fast.",
    "Describe a sunrise over the mountains in one paragraph.",
    "Give some advice to a student who is starting to learn the piano.",
]
OPT_OUT_PROMPT = "Write a short story about a lighthouse keeper and a storm."
WARMUP_PROMPT = "Say hello."
# B may accept a little more than A's first pass: the acceptance estimates
# that size sam's drafts are shared by every tenant (docs/security.md,
# "Residual channels"), so B's drafts may differ a little from A's. A's
# whole answers drafted back by B would add about MAX_TOKENS * 3/4 a prompt.
TOLERANCE = 0.10       # of the first pass's accepted tokens, and at least
MIN_TOLERANCE = 4      # tokens
# A request that may draft its prompt's earlier answer from the store
# accepts at least RISE times a fresh pass, and MAX_TOKENS / 4 tokens more
# per prompt.
RISE = 1.5


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    yield from serve(model_path, tmp_path_factory, SAM)


def _accepted(base: str) -> int:
    """vLLM's accepted-token counter, once it has stopped moving (the API
    server counts a step just after handing on its outputs)."""
    from vllm_specplug.bench.served import read_spec_metrics

    last = read_spec_metrics(base)["accepted"]
    for _ in range(20):
        time.sleep(0.3)
        now = read_spec_metrics(base)["accepted"]
        if now == last:
            return now
        last = now
    return last


def _ask(base: str, prompt: str, salt: str, share: bool = True) -> dict:
    """One greedy chat completion of tenant ``salt``: its text, token ids and
    the tokens its drafts got accepted (nothing else runs meanwhile)."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    body = {"cache_salt": salt, "return_token_ids": True}
    if not share:
        body["vllm_xargs"] = {"specplug_share": 0}
    before = _accepted(base)
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": prompt}], temperature=0,
        max_tokens=MAX_TOKENS, extra_body=body)
    choice = r.choices[0]
    return {"text": choice.message.content, "token_ids": choice.model_extra["token_ids"],
            "accepted": _accepted(base) - before}


def _tolerance(first_pass: int) -> int:
    return max(MIN_TOLERANCE, int(TOLERANCE * first_pass))


def test_tenants_with_different_salts_never_draft_each_others_outputs(server):
    _ask(server, WARMUP_PROMPT, "warmup")
    a1 = [_ask(server, p, "tenant-a") for p in PROMPTS]
    b = [_ask(server, p, "tenant-b") for p in PROMPTS]
    a3 = [_ask(server, p, "tenant-a") for p in PROMPTS]
    a_opted_out = _ask(server, PROMPTS[0], "tenant-a", share=False)
    c_opted_out = _ask(server, OPT_OUT_PROMPT, "tenant-c", share=False)
    c_after = _ask(server, OPT_OUT_PROMPT, "tenant-c")
    c_again = _ask(server, OPT_OUT_PROMPT, "tenant-c")

    acc = {"a1": [r["accepted"] for r in a1], "b": [r["accepted"] for r in b],
           "a3": [r["accepted"] for r in a3], "a_opted_out": a_opted_out["accepted"],
           "c_opted_out": c_opted_out["accepted"], "c_after": c_after["accepted"],
           "c_again": c_again["accepted"],
           "generated": [len(r["token_ids"]) for r in a1] + [len(c_again["token_ids"])]}
    print("\nserved isolation, accepted tokens:", acc)

    # greedy and lossless: one answer per prompt, whichever tenant asks
    for i, runs in enumerate(zip(a1, b, a3)):
        assert len({r["text"] for r in runs}) == 1, (i, [r["text"] for r in runs])
        assert len({tuple(r["token_ids"]) for r in runs}) == 1, i
    assert a_opted_out["token_ids"] == a1[0]["token_ids"]
    assert c_opted_out["token_ids"] == c_after["token_ids"] == c_again["token_ids"]
    assert c_opted_out["text"] == c_after["text"] == c_again["text"]
    # answers long enough to be drafted back
    assert min(acc["generated"]) >= MAX_TOKENS // 2, acc

    first, tol = sum(acc["a1"]), _tolerance(sum(acc["a1"]))
    # the positive control: the same tenant drafts its earlier answers
    assert sum(acc["a3"]) >= max(RISE * first, first + len(PROMPTS) * MAX_TOKENS // 4), acc
    # another tenant does not, though A's store holds every answer
    assert sum(acc["b"]) <= first + tol, acc
    # an opted-out request reads nothing of its tenant's store
    assert acc["a_opted_out"] <= acc["a1"][0] + _tolerance(acc["a1"][0]), acc
    # ... and feeds nothing: C's next request drafts as a fresh tenant's,
    # while C's store does keep its normal answers (the positive control)
    fresh = acc["c_opted_out"]
    assert acc["c_after"] <= fresh + _tolerance(fresh), acc
    assert acc["c_again"] >= max(RISE * fresh, fresh + MAX_TOKENS // 4), acc
