"""Faults are contained inside a real engine (docs/architecture.md, "Faults").

One ``sam_tr`` engine (its SAM part has the global store, its Token Recycling
part the shared matrix) is started with ``VLLM_SPECPLUG_INJECT_FAULT``: the
5th ``propose`` call and the first global-store insertion raise. Later rounds
arm more faults at run time (observe, complete inside vLLM's request-removed
hook, the batch budget). Every greedy output stays token-identical to plain
decoding, the engine serves every round, the drafter counts each fault, and
the other requests' drafts are still accepted. The fast tier is
tests/test_faults.py."""
from __future__ import annotations

import pytest

from helpers import assert_same_tokens, chat, engine_stats, tau_of
from vllm_specplug import faults
from vllm_specplug.options import SpecPlugConfigError

pytestmark = pytest.mark.engine

SPEC = {"method": "sam_tr", "num_speculative_tokens": 8, "batch_budget": "off"}
MAX_TOKENS = 40
# short prompts whose answers repeat themselves (drafts get accepted); each
# round asks a new batch of 4, the second round repeats the first's prompts
# (drafted from the global store)
ROUNDS = [
    ["Count from 1 to 40, separated by commas.",
     "Write the word 'apple' twenty times, separated by spaces.",
     "List the days of the week, twice.",
     "Repeat this sentence three times: the cat sat on the mat."],
    None,
    ["Count from 10 to 50, separated by commas.",
     "Write the word 'blue' twenty times, separated by spaces.",
     "List the months of the year.",
     "Repeat this sentence three times: the dog ran in the park."],
    ["Count down from 40 to 1, separated by commas.",
     "Write 'yes no' ten times.",
     "List the letters of the alphabet, separated by commas.",
     "Repeat this sentence three times: rain falls on the hills."],
]
ROUNDS[1] = ROUNDS[0]


def _inject(worker, spec: str) -> None:
    worker.model_runner.drafter.inject_faults(spec)


def _raised(worker) -> dict:
    return dict(worker.model_runner.drafter.faults.raised)


def test_a_bad_fault_spec_fails_before_the_engine_starts(model_path, monkeypatch):
    from vllm import LLM

    monkeypatch.setenv(faults.ENV, "sam_tr:proposee:1")
    with pytest.raises(SpecPlugConfigError, match=f"{faults.ENV}.*proposee.*METHOD:HOOK:N"):
        LLM(model=model_path, dtype="float32", enforce_eager=True, max_model_len=512,
            speculative_config={"method": "sam_tr"})


def test_faults_cost_one_requests_drafts_never_the_engine(get_llm, monkeypatch):
    plain = get_llm("plain")
    unique = ROUNDS[0] + ROUNDS[2] + ROUNDS[3]
    ref = dict(zip(unique, chat(plain, unique, max_tokens=MAX_TOKENS)))

    monkeypatch.setenv(faults.ENV, "sam_tr:propose:5,sam_tr:store_add:1")
    llm = get_llm("sam_tr_faults", SPEC)
    monkeypatch.delenv(faults.ENV)

    accepted = []
    for i, prompts in enumerate(ROUNDS):
        # armed at run time: round 3 observe and the batch budget; round 4
        # complete, called from vLLM's request-removed hook (an exception
        # there killed the engine before). A short request first drives the
        # request-removed hook of the round before.
        if i >= 2:
            chat(llm, ["Say hi."], max_tokens=2)
            llm.llm_engine.collective_rpc(_inject, args=(
                "sam_tr:observe:3,sam_tr:budget:4" if i == 2 else "sam_tr:complete:2",))
        _, delta, outs = tau_of(llm, lambda: chat(llm, prompts, max_tokens=MAX_TOKENS))
        assert_same_tokens([ref[p] for p in prompts], outs)
        accepted.append(delta["accepted"])
    chat(llm, ["Say hi."], max_tokens=2)
    print(f"\naccepted draft tokens by round: {accepted}")

    stats = engine_stats(llm)
    f = stats["faults"]
    # 3 requests lost their drafts: propose, observe, complete; the store
    # insertion's fault costs only that output, no request (issue 45 item 7:
    # sam contains it); 1 step fell back to none (budget)
    assert f["requests"] == 3 and f["steps"] == 1, f
    assert f["hooks"]["observe"] == 1 and f["hooks"]["complete"] == 1, f
    assert f["hooks"]["budget"] == 1, f
    assert f["hooks"].get("propose", 0) == 1 and "start" not in f["hooks"], f
    assert f["requests_without_drafts"] == 0, f   # all finished
    assert stats["errors"] == 4
    assert stats["proposer"]["sam"]["global_store_failed_documents"] == 1
    raised = llm.llm_engine.collective_rpc(_raised)[0]
    assert raised == {"complete": 1}, raised
    # the other requests kept drafting in every round (measured 49, 106, 36,
    # 44 accepted draft tokens on 2026-12-04); the repeated round drafts from
    # the store: round 1's other answers went in despite the failed insertion
    assert min(accepted) >= 20 and accepted[1] > accepted[0], accepted
    assert stats["active_requests"] <= 1, stats
