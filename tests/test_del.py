"""DEL controller: TPL selection, shadow-token estimates, config checks (no vLLM)."""
from __future__ import annotations

import json

import pytest

from vllm_specplug.config import translate
from vllm_specplug.options import SpecPlugConfigError
from vllm_specplug.proposers.early_exit import (
    DelProposer, ExitDraft, candidate_layers, choose_exit, expected_tokens, tpl)

N = 30


# ------------------------------------------------------------------ TPL
def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_tpl_is_the_papers_formula():
    a, layer, d = 0.6, 8, 3
    assert tpl(a, layer, d, N) == pytest.approx(((1 - a ** (d + 1)) / (1 - a)) / (d * layer + N))
    # head cost: every draft token and the verify step pay the LM head once
    assert tpl(a, layer, d, N, 5.0) == pytest.approx(
        ((1 - a ** (d + 1)) / (1 - a)) / (d * (layer + 5) + N + 5))
    assert tpl(0.3, 4, 0, N) == pytest.approx(1 / N)


def _brute(rates, k, h):
    best = max(((tpl(a, layer, d, N, h), -layer, -d) for layer, a in rates.items()
                for d in range(1, k + 1)))
    return -best[1], -best[2], best[0]


@pytest.mark.parametrize("h", [0.0, 8.0])
def test_choose_exit_maximises_tpl_over_synthetic_rates(h):
    rates = {2: 0.30, 4: 0.45, 6: 0.70, 8: 0.80, 10: 0.86, 12: 0.90, 15: 0.93}
    layer, d, value = choose_exit(rates, N, 6, h)
    assert (layer, d) == _brute(rates, 6, h)[:2]
    assert value == pytest.approx(tpl(rates[layer], layer, d, N, h))
    # every other pair is no better
    assert all(tpl(a, c, e, N, h) <= value + 1e-15 for c, a in rates.items()
               for e in range(1, 7))


def test_choose_exit_known_answers():
    rates = {2: 0.30, 4: 0.45, 6: 0.70, 8: 0.80, 10: 0.85, 15: 0.90}
    assert choose_exit(rates, N, 6, 0.0)[:2] == (8, 3)
    # a costly LM head favours fewer, deeper-accepted drafts
    assert choose_exit(rates, N, 6, 8.0)[:2] == (8, 2)
    # high acceptance everywhere: the shallowest layer with long drafts
    assert choose_exit({4: 0.99, 8: 0.995}, N, 6, 0.0)[:2] == (4, 6)
    # the draft length is capped by the budget
    assert choose_exit({4: 0.99}, N, 2, 0.0)[:2] == (4, 2)


def test_choose_exit_declines_when_nothing_beats_plain_decoding():
    layer, d, value = choose_exit({2: 0.05, 6: 0.1, 12: 0.2}, N, 6, 8.0)
    assert (layer, d) == (0, 0) and value == pytest.approx(1 / (N + 8))


def test_candidate_layers():
    assert candidate_layers(30, 2, 0, 2) == [2, 4, 6, 8, 10, 12, 14, 15]
    assert candidate_layers(30, 3, 9, 3) == [3, 6, 9]
    assert candidate_layers(30, 4, 40, 10) == [4, 14, 24, 29]
    assert candidate_layers(4, 5, 0, 1) == []


# ------------------------------------------------------------------ a fake model
class FakeHook:
    """Layer L drafts the true next token when L >= good_from, else a wrong one."""

    num_layers = N
    head_cost = 0.0

    def __init__(self, truth, good_from=8):
        self.truth = truth      # position -> the token the target commits there
        self.good_from = good_from
        self.calls = []

    def predict(self, layer, position):
        t = self.truth(position)
        return t if layer >= self.good_from else t + 1000

    def draft(self, req_id, token, position, exit_layer, max_tokens, threshold, shadow_layers):
        self.calls.append((req_id, token, position, exit_layer, max_tokens, tuple(shadow_layers)))
        tokens = [self.predict(exit_layer, position + 1 + j) for j in range(max_tokens)]
        shadows = {c: self.predict(c, position + 1) for c in shadow_layers}
        return ExitDraft(tokens, shadows)


def _truth(position):
    return 100 + position


def _run(proposer, hook, req="r", steps=40, prompt_len=5):
    """Drive start/propose/observe like the drafter, greedy verification
    against ``_truth``; returns the number of target steps."""
    proposer.start(req, [_truth(i) for i in range(prompt_len)])
    n = prompt_len
    for _ in range(steps):
        draft = proposer.propose(req, 8).tokens.tolist()
        committed = []
        for t in draft:
            if t != _truth(n + len(committed)):
                break
            committed.append(t)
        committed.append(_truth(n + len(committed)))  # correction or bonus
        proposer.observe(req, committed)
        n += len(committed)
    return n


def _bound(hook, **opts):
    p = DelProposer(4, **opts)
    p.bind_target(hook)
    return p


def test_controller_learns_the_first_good_layer_from_shadow_tokens():
    hook = FakeHook(_truth, good_from=8)
    p = _bound(hook, del_probe_every=2, del_min_layer=2, del_max_layer=16, del_layer_step=2)
    _run(p, hook, steps=60)
    s = p.debug_stats()
    acc = {int(k): v for k, v in s["layer_acceptance"].items()}
    assert all(acc[c] < 0.2 for c in (2, 4, 6) if c in acc), acc
    assert acc[8] > 0.8, acc
    # after learning it drafts from layer 8 (the cheapest perfect layer), full length
    last = hook.calls[-10:]
    assert all(c[3] == 8 and c[4] == 4 for c in last), last
    assert s["exit_layer"]["8"] > 30 and s["accepted"] > 100, s


def test_controller_passes_position_and_last_token():
    hook = FakeHook(_truth, good_from=1)
    p = _bound(hook, del_exit_layer=6)
    _run(p, hook, steps=3, prompt_len=5)
    # first call: last committed token is the prompt's last (position 4)
    assert hook.calls[0][1:5] == (_truth(4), 4, 6, 4)
    # all 4 accepted + bonus: the next call starts 5 later
    assert hook.calls[1][1:3] == (_truth(9), 9)
    # fixed layer: no shadow layers are evaluated
    assert all(c[5] == () for c in hook.calls)


def test_controller_skips_when_no_layer_pays_and_still_probes():
    hook = FakeHook(_truth, good_from=99)  # no layer ever right
    p = _bound(hook, del_probe_every=4, del_probe_max=4, del_head_cost=8.0)  # no back-off
    _run(p, hook, steps=40)
    s = p.debug_stats()
    assert s["skipped"] > 20, s
    assert s["probes"] >= 10
    # probes still sample every candidate layer
    assert set(s["layer_acceptance"]) == {str(c) for c in p.candidates}


def _probe_steps(hook, candidates):
    return [i for i, c in enumerate(hook.calls) if c[5] == tuple(candidates)]


def test_probes_back_off_while_no_layer_pays_and_resume_when_one_does():
    hook = FakeHook(_truth, good_from=99)  # no layer ever right
    p = _bound(hook, del_probe_every=4, del_probe_max=32)
    _run(p, hook, steps=200)
    s = p.debug_stats()
    # step 0 drafts (unseen layers look good), then every probe finds nothing:
    # probes at steps 0, 4, 12, 28, 60, 92, 124, 156, 188 (fixed: 50 probes)
    assert s["probes"] == len(hook.calls) == 9, s
    assert s["probe_interval"] == 32 and s["accepted"] == 0
    # the model changes: layers from 4 on predict the target's token now
    hook.good_from = 4
    hook.calls.clear()
    skipped = s["skipped"]
    _run(p, hook, req="r2", steps=120)
    s = p.debug_stats()
    # the new request starts backed off: no probe before its step 32 ...
    assert s["skipped"] - skipped >= 32
    assert hook.calls[0][5] == tuple(p.candidates)
    # ... which sees the change: drafting resumes, the interval falls back to 4
    assert s["probe_interval"] == 4, s
    last = hook.calls[-10:]
    assert all(c[3] == 4 and c[4] == 4 for c in last), last
    assert s["accepted"] > 100, s


def test_new_request_probes_first_when_the_engine_has_not_backed_off():
    hook = FakeHook(_truth, good_from=99)
    p = _bound(hook, del_probe_every=4, del_probe_max=32, del_head_cost=8.0)
    p.start("a", [1, 2, 3])
    assert p.plan("a", 4)[2]  # step 0 of a fresh engine is a probe


def test_shadows_only_up_to_the_chosen_layer_between_probes():
    hook = FakeHook(_truth, good_from=4)
    p = _bound(hook, del_probe_every=5, del_min_layer=2, del_max_layer=14, del_layer_step=2)
    _run(p, hook, steps=30)
    probes = _probe_steps(hook, p.candidates)
    # probes every 5th step, each counted; the chosen layer (4) is below the
    # deepest candidate, so a step that shadows every candidate is a probe
    assert probes == list(range(0, 30, 5)) and len(probes) == p.debug_stats()["probes"], probes
    others = [c for i, c in enumerate(hook.calls) if i not in probes]
    for _, _, _, layer, _, shadows in others:
        assert shadows == tuple(c for c in p.candidates if c <= layer), (layer, shadows)
    assert sum(c[3] == 4 for c in others) >= 15  # it learned layer 4 and drafts from it


def test_new_requests_start_from_the_engine_wide_estimate():
    hook = FakeHook(_truth, good_from=6)
    p = _bound(hook, del_probe_every=2)
    _run(p, hook, req="a", steps=60)
    p.finish("a")
    p.start("b", [1, 2, 3])
    rates = p.rates(p._requests["b"])
    assert rates[6] > 0.8 and rates[2] < 0.3
    assert p.plan("b", 8)[0] == 6
    assert p.active_requests() == 1


def test_window_forgets_old_samples():
    hook = FakeHook(_truth, good_from=8)
    p = _bound(hook, del_window=4)
    p.start("r", [1])
    req = p._requests["r"]
    for hit in [1, 1, 1, 1, 0, 0, 0, 0]:
        p._sample(req, 8, bool(hit))
    assert list(req.window[8]) == [0, 0, 0, 0]


def test_unbound_proposer_drafts_nothing():
    p = DelProposer(4)
    p.start("r", [1, 2])
    assert len(p.propose("r", 4)) == 0
    assert p.debug_stats()["unbound"] == 1


# ------------------------------------------------------------------ config
def test_options_validated_before_the_engine():
    _, plugin = translate({"method": "del", "del_exit_layer": 6, "num_speculative_tokens": 3})
    assert plugin["options"]["del_exit_layer"] == 6 and plugin["num_speculative_tokens"] == 3
    assert translate({"method": "del"})[1]["num_speculative_tokens"] == 4
    for bad, key in [({"del_min_layer": 0}, "del_min_layer"),
                     ({"del_confidence": 1.5}, "del_confidence"),
                     ({"del_window": 0}, "del_window"),
                     ({"del_head_cost": -0.5}, "del_head_cost"),
                     ({"del_min_layer": 8, "del_max_layer": 4}, "del_min_layer"),
                     ({"del_probe_every": 8, "del_probe_max": 4}, "del_probe_max"),
                     ({"del_layer": 3}, "del_layer")]:
        with pytest.raises(SpecPlugConfigError, match=key):
            translate({"method": "del", **bad})


def test_model_checks_layers_and_architecture(tmp_path, model_path):
    with pytest.raises(SpecPlugConfigError, match="30 decoder layers"):
        translate({"method": "del", "del_exit_layer": 30}, tokenizer=model_path)
    translate({"method": "del", "del_exit_layer": 29}, tokenizer=model_path)
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "num_hidden_layers": 12}))
    with pytest.raises(SpecPlugConfigError,
                       match="LlamaForCausalLM, Qwen2ForCausalLM; this model is GPT2LMHeadModel"):
        translate({"method": "del"}, tokenizer=str(tmp_path))


def test_a_cut_draft_is_scored_only_on_what_was_kept():
    hook = FakeHook(_truth, good_from=1)
    p = _bound(hook, del_exit_layer=6)
    p.start("r", [_truth(i) for i in range(3)])
    draft = p.propose("r", 4)
    assert len(draft) == 4
    from vllm_specplug.proposers.base import Draft
    p.draft_cut("r", Draft.chain(draft.tokens[:1]))
    p.observe("r", [_truth(3), _truth(4)])  # the kept token accepted + bonus
    s = p.debug_stats()
    assert s["draft_tokens"] == 1 and s["accepted"] == 1
    assert list(p._requests["r"].window[6]) == [1]
