"""sam with the learned stopping rule (sam_stop "learned") inside a real vLLM
engine with the embedded model: greedy outputs equal plain decoding's, the
rule drafts (a floor on accepted tokens), and its per-request state is freed."""
from __future__ import annotations

import pytest

from helpers import chat, pick, tau_of

pytestmark = pytest.mark.engine

LEARNED = {"method": "sam", "num_speculative_tokens": 8, "sam_stop": "learned",
           "batch_budget": "off"}
CATEGORIES = ["extraction", "summarization", "rag", "coding", "qa", "translation"]


def _drafter_stats(worker):
    return worker.model_runner.drafter.stats()


def test_learned_stop_is_token_identical_to_plain_and_drafts(get_llm, spec_bench_prompts,
                                                            monkeypatch):
    prompts = [r["prompt"] for r in pick(spec_bench_prompts, CATEGORIES, 2)]
    plain = chat(get_llm("plain"), prompts, max_tokens=48)
    # the floor below is about the rule, not about what earlier engines of the
    # session cached as the step cost: this engine starts from the built-in prior
    monkeypatch.setenv("VLLM_SPECPLUG_STEP_COST_CACHE", "0")
    llm = get_llm("sam_stop_learned", LEARNED)
    tau, delta, got = tau_of(llm, lambda: chat(llm, prompts, max_tokens=48))
    assert len(plain) == len(got) == len(prompts)
    for i, (a, b) in enumerate(zip(plain, got)):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids), (
            f"prompt {i} differs:\nplain:   {a.outputs[0].text!r}\nlearned: {b.outputs[0].text!r}")
    assert delta["drafts"] > 12 and delta["accepted"] >= 20, delta
    # one more short request lets the runner free the finished requests
    chat(llm, ["Say hi."], max_tokens=2)
    stats = llm.llm_engine.collective_rpc(_drafter_stats)[0]
    assert stats["errors"] == 0, stats
    assert stats["sizes"]["sam_stop_requests"] <= 1, stats["sizes"]
