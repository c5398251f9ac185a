"""DEL (early-exit self-speculation) inside a real vLLM engine with the embedded model.

One DEL engine (plus the shared plain one): a mixed Spec-Bench batch must be
token-identical to plain decoding, and the drafts the engine made (recorded
in the worker) must be what a plain transformers forward truncated at the
exit layer (plus final norm and LM head) predicts.
"""
from __future__ import annotations

import os

import pytest

from helpers import chat, pick, tau_of

pytestmark = pytest.mark.engine

MAX_TOKENS = 40
DEL = {"method": "del", "num_speculative_tokens": 4, "del_probe_every": 2, "del_probe_max": 2}
CATEGORIES = ["writing", "coding", "math", "summarization", "rag", "translation"]


def _start_recording(worker):
    worker.model_runner.drafter.proposer.hook.recent = []


def _recent(worker):
    return list(worker.model_runner.drafter.proposer.hook.recent or [])


def _stats(worker):
    return worker.model_runner.drafter.stats()


@pytest.fixture(scope="module")
def prompts(spec_bench_prompts):
    return [r["prompt"] for r in pick(spec_bench_prompts, CATEGORIES, 1)]


@pytest.fixture(scope="module")
def del_run(get_llm, prompts):
    plain = chat(get_llm("plain"), prompts, max_tokens=MAX_TOKENS)
    llm = get_llm("del", DEL)
    llm.llm_engine.collective_rpc(_start_recording)
    tau, delta, outs = tau_of(llm, lambda: chat(llm, prompts, max_tokens=MAX_TOKENS))
    recent = llm.llm_engine.collective_rpc(_recent)[0]
    stats = llm.llm_engine.collective_rpc(_stats)[0]
    return plain, outs, tau, delta, recent, stats


def test_del_greedy_is_token_identical_to_plain_in_a_batch(del_run):
    plain, outs, tau, delta, recent, stats = del_run
    assert len(plain) == len(outs) == len(CATEGORIES)
    for i, (a, b) in enumerate(zip(plain, outs)):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids), (
            f"prompt {i} differs:\nplain: {a.outputs[0].text!r}\ndel:   {b.outputs[0].text!r}")
    assert stats["errors"] == 0, stats
    p = stats["proposer"]
    # Drafting really happened, through the model, and was verified.
    assert p["unbound"] == 0 and p["num_layers"] == 30, p
    assert delta["drafts"] > 0 and delta["draft_tokens"] > 0, delta
    # identity is trivial if nothing is accepted: 8 of 126 drafted tokens were
    # (2026-12-04, 108 drafts, 116 probes)
    assert delta["accepted"] >= 3, delta
    assert p["drafts"] > 0 and p["probes"] > 0 and p["layer_acceptance"], p
    assert sum(p["exit_layer"].values()) > 0 and sum(p["draft_length_planned"].values()) > 0
    assert recent and any(r["tokens"] for r in recent)


def test_del_drafts_equal_truncated_transformers_forward(del_run, model_path):
    """Each recorded draft token (and shadow token) is the argmax of the
    transformers model cut after the exit layer, + final norm + LM head."""
    import torch
    from transformers import AutoModelForCausalLM

    recent = [r for r in del_run[4] if r["tokens"] or r["shadows"]]
    assert recent
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    checked = mismatched = 0
    layers_seen = set()
    for r in recent[:: max(1, len(recent) // 16)][:16]:
        ids = r["context"] + r["tokens"][:-1]
        p = len(r["context"]) - 1
        with torch.no_grad():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        want = [(r["exit_layer"], p + j, t) for j, t in enumerate(r["tokens"])]
        want += [(int(c), p, t) for c, t in r["shadows"].items()]
        for layer, pos, tok in want:
            with torch.no_grad():
                logits = model.lm_head(model.model.norm(hs[layer][0, pos]))
            top2 = torch.topk(logits, 2)
            if float(top2.values[0] - top2.values[1]) < 1e-3:
                continue  # a near tie: float order of operations decides
            checked += 1
            layers_seen.add(layer)
            if int(top2.indices[0]) != tok:
                mismatched += 1
    assert checked >= 20 and len(layers_seen) >= 3, (checked, layers_seen)
    assert mismatched == 0, f"{mismatched} of {checked} draft/shadow tokens differ"


@pytest.mark.slow  # 15 minutes on 2 cores: DEL drafts request by request
def test_del_sampling_matches_plain_sampling(get_llm, plain_samples):
    """At temperature 0.8 (top-k 6) DEL's chains, verified by vLLM's rejection
    sampler, leave the first three tokens distributed as plain sampling's
    (the chi-square tolerance of test_engine_tree). A deep fixed exit layer
    (layer 8 drafts were accepted once in 1,200) and no confidence stop, so
    a draft is made every step; batch-aware budgets off (batches of 200).
    Passed on 2026-12-01 in 912 s."""
    from helpers import N_SAMPLES, chi2_same_distribution, first_three

    from vllm_specplug.bench.engine import counter_delta, read_spec_counters

    plain = plain_samples
    llm = get_llm("del_sampling", {"method": "del", "num_speculative_tokens": 2,
                                   "del_exit_layer": 24, "del_confidence": 0.0,
                                   "batch_budget": "off"})
    before = read_spec_counters(llm)
    samples = first_three(llm)
    delta = counter_delta(read_spec_counters(llm), before)
    assert delta["drafts"] > 0.5 * N_SAMPLES and delta["accepted"] > 0.05 * N_SAMPLES, delta
    assert chi2_same_distribution(plain, samples) > 1e-3
