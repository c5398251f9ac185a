"""SamProposer life cycle, drafts and learned cut, and the Draft container. No vLLM."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_specplug.bench.simulate import replay
from vllm_specplug.proposers.base import Draft, Proposer
from vllm_specplug.proposers.sam import (COUNT_DEPTH, EXPLORE_EVERY, MAX_BUCKET, PRIOR_WEIGHT,
                                         STATS_HORIZON,
                                         AcceptanceByMatchLength)
from vllm_specplug.proposers.sam import SamProposer as _SamProposer
from vllm_specplug.proposers.suffix_automaton import SuffixAutomaton


class SamProposer(_SamProposer):
    """sam with the table rule unless told otherwise: what this file's cut
    tests are about (the learned rule, the default: tests/test_stop_rule.py)."""

    def __init__(self, *args, sam_stop: str = "table", **kwargs) -> None:
        super().__init__(*args, sam_stop=sam_stop, **kwargs)


CTX = [1, 2, 3, 4, 5, 1, 2, 3]  # match [1, 2, 3] (length 3), then 4 5 1 2 3 follow

# The SAM-Decoding continuation (tokens after the first occurrence of the match)
# without the learned cut: drafts depend on the context alone.
FIRST = {"sam_continuation": "first", "sam_min_accept_prob": 0.0}
DEFAULTS = {"sam_continuation": "frequent", "sam_min_match_len": 1,
            "sam_min_accept_prob": None, "sam_spec_factor": 4.0,
            "sam_corpus": "", "sam_corpus_bias": None, "sam_global_tokens": 500_000, "sam_global_bytes": 0,
            "sam_global_prompts": False, "sam_global_live": True, "sam_global_tenants": 16,
            "sam_stop": "auto", "sam_stop_file": ""}
# On CTX every earlier occurrence has a single continuation, so both ways of
# continuing draft the same tokens as far as "first" goes (and a fresh acceptance
# table cuts nothing): "first" copies the 5 tokens after [1, 2, 3] and stops at
# the end of the text; "frequent" reaches the end of the text too (CTX itself
# occurs nowhere else), falls back to its longest suffix that occurs elsewhere,
# the match [1, 2, 3], and goes round again: period 4 5 1 2 3.
BOTH = pytest.mark.parametrize("opts", [FIRST, {}], ids=["first", "frequent"])
CTX_PERIOD = [4, 5, 1, 2, 3]


def on_ctx(opts, first_draft: list[int], n: int) -> list[int]:
    """The draft on CTX: ``first_draft`` for "first", n tokens of the period for "frequent"."""
    if opts.get("sam_continuation") == "first":
        return first_draft
    return (CTX_PERIOD * max(n, 0))[:max(n, 0)]


def both(opts, first_draft: list[int], frequent_draft: list[int]) -> list[int]:
    return first_draft if opts.get("sam_continuation") == "first" else frequent_draft


def draft_of(prop: SamProposer, tokens, budget=None, req="r") -> list[int]:
    prop.start(req, tokens)
    d = prop.propose(req, prop.num_speculative_tokens if budget is None else budget)
    assert isinstance(d, Draft) and d.is_chain
    return d.tokens.tolist()


class RecordingSam(SamProposer):
    """A SamProposer that logs (match length, draft length) of every propose."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[int, int]] = []

    def propose(self, req_id, budget):
        match_len = self._automata[req_id].match_len
        d = super().propose(req_id, budget)
        self.log.append((match_len, len(d)))
        return d


# ------------------------------------------------------------ hand examples
def test_is_a_registered_proposer():
    assert issubclass(SamProposer, Proposer)
    assert SamProposer.name == "sam"
    assert not SamProposer.drafts_trees
    defaults = {o.name: o.default for o in SamProposer.options}
    assert defaults == DEFAULTS
    choices = {o.name: o.choices for o in SamProposer.options}
    assert list(choices["sam_continuation"]) == ["frequent", "first"]
    prop = SamProposer(4)
    assert prop.num_speculative_tokens == 4
    assert prop.continuation == "frequent"
    assert prop.min_match_len == 1
    assert prop.min_accept_prob is None   # draft lengths from the verify cost
    assert prop.spec_factor == 4.0
    assert isinstance(prop.acceptance, AcceptanceByMatchLength)
    assert prop.acceptance.tried.shape == (MAX_BUCKET + 1, 4)


@BOTH
def test_draft_is_what_followed_the_earlier_occurrence(opts):
    # K = 8, factor 4 -> up to 12 by factor, 8 by K; only 5 tokens follow [1, 2, 3]
    # ("frequent" then falls back to the match and repeats them)
    assert draft_of(SamProposer(8, **opts), CTX) == both(opts, [4, 5, 1, 2, 3],
                                                         [4, 5, 1, 2, 3, 4, 5, 1])


@BOTH
@pytest.mark.parametrize("k, expected", [(1, [4]), (2, [4, 5]), (3, [4, 5, 1]),
                                         (5, [4, 5, 1, 2, 3]), (128, [4, 5, 1, 2, 3])])
def test_draft_limited_by_k(opts, k, expected):
    assert draft_of(SamProposer(k, **opts), CTX) == on_ctx(opts, expected, k)


@BOTH
@pytest.mark.parametrize("budget, expected", [(0, []), (-1, []), (1, [4]), (3, [4, 5, 1]),
                                              (100, [4, 5, 1, 2, 3])])
def test_draft_limited_by_budget(opts, budget, expected):
    assert draft_of(SamProposer(8, **opts), CTX, budget=budget) == on_ctx(opts, expected,
                                                                          min(8, budget))


@pytest.mark.parametrize("factor, expected", [
    (0.01, [4]),           # max(1, ceil(0.03)) = 1
    (0.34, [4, 5]),        # ceil(1.02) = 2
    (0.5, [4, 5]),         # ceil(1.5) = 2
    (1.0, [4, 5, 1]),      # ceil(3) = 3
    (1.2, [4, 5, 1, 2]),   # ceil(3.6) = 4
    (4.0, [4, 5, 1, 2, 3]),
])
def test_draft_limited_by_spec_factor(factor, expected):
    assert draft_of(SamProposer(8, sam_spec_factor=factor, **FIRST), CTX) == expected


@pytest.mark.parametrize("factor", [0.01, 0.5, 4.0])
def test_spec_factor_does_not_limit_frequent(factor):
    assert draft_of(SamProposer(8, sam_spec_factor=factor), CTX) == [4, 5, 1, 2, 3, 4, 5, 1]


@BOTH
@pytest.mark.parametrize("min_match, expected", [(1, [4, 5, 1, 2, 3]), (2, [4, 5, 1, 2, 3]),
                                                 (3, [4, 5, 1, 2, 3]), (4, []), (100, [])])
def test_no_draft_below_min_match(opts, min_match, expected):
    # "frequent" falls back to the match [1, 2, 3] itself: min_match <= 3 allows it
    assert draft_of(SamProposer(8, sam_min_match_len=min_match, **opts), CTX) == on_ctx(
        opts, expected, 8 if expected else 0)


@BOTH
def test_no_draft_without_a_match(opts):
    prop = SamProposer(8, **opts)
    assert draft_of(prop, []) == []
    assert draft_of(prop, [1, 2, 3, 4]) == []
    assert draft_of(prop, [9]) == []


# The longest match is [1]: it was followed by 2 once and by 3 three times;
# [1, 3] always by 4; [1, 3, 4] by 6, 7 and 8 once each.
FREQ_CTX = [1, 2, 1, 3, 4, 6, 1, 3, 4, 7, 1, 3, 4, 8, 1]


def test_frequent_takes_the_most_frequent_continuation():
    assert SuffixAutomaton(FREQ_CTX).match_len == 1
    prop = SamProposer(8)
    prop.start("r", FREQ_CTX)
    d = prop.propose("r", 8)
    assert d.tokens.tolist()[:2] == [3, 4]  # shares 3/4, 1, then a tie (see below)
    # the scores are the acceptance table's estimates (the prior, 1/2, while fresh)
    assert d.scores.tolist() == [0.5] * len(d)
    assert draft_of(SamProposer(1), FREQ_CTX) == [3]
    # the first occurrence of [1] was followed by 2: that is what "first" drafts
    assert draft_of(SamProposer(8, **FIRST), FREQ_CTX) == [2, 1, 3, 4]  # ceil(4 * 1)


def test_frequent_at_a_tie():
    # at [1, 3, 4] the three continuations tie (1/3 each): any of them may be taken
    draft = draft_of(SamProposer(8), FREQ_CTX)
    assert draft[:2] == [3, 4] and draft[2] in (6, 7, 8)
    # after [1, 3, 4, x] the walk is forced; for x = 8 it reaches the end of the
    # text ([1, 3, 4, 8, 1]) and falls back to [1]: 3 (3/4), 4, and a tie again
    assert len(draft) == 8
    if draft[2] in (6, 7):
        assert draft[3:] == {6: [1, 3, 4, 7, 1], 7: [1, 3, 4, 8, 1]}[draft[2]]
    else:
        assert draft[3:6] == [1, 3, 4] and draft[6] in (6, 7, 8) and draft[7] == 1


@BOTH
def test_observe_extends_the_context(opts):
    # drafts whole (the cut's learning is tested below): this checks the content
    prop = SamProposer(8, sam_min_match_len=2, **{**opts, "sam_min_accept_prob": 0.0})
    prop.start("r", [1, 2, 3, 4, 5, 1])
    assert len(prop.propose("r", 8)) == 0  # match [1] is shorter than 2
    prop.observe("r", [2])
    # match [1, 2]: first earlier end 1, what follows: 3 4 5 1 2 ("frequent" then
    # falls back to [1, 2], of length 2: allowed)
    assert prop.propose("r", 8).tokens.tolist() == both(opts, [3, 4, 5, 1, 2],
                                                        [3, 4, 5, 1, 2, 3, 4, 5])
    prop.observe("r", [3], None)
    assert prop.propose("r", 8).tokens.tolist() == on_ctx(opts, [4, 5, 1, 2, 3], 8)
    prop.observe("r", [])  # an empty commit changes nothing
    assert prop.propose("r", 8).tokens.tolist() == on_ctx(opts, [4, 5, 1, 2, 3], 8)
    prop.observe("r", np.asarray([9, 9], dtype=np.int32))
    assert len(prop.propose("r", 8)) == 0


@BOTH
def test_start_rebuilds_from_scratch(opts):
    prop = SamProposer(8, **opts)
    prop.start("r", CTX)
    prop.start("r", [1, 2, 7, 1, 2])  # e.g. after a preemption
    assert prop.active_requests() == 1
    assert prop.propose("r", 8).tokens.tolist() == both(opts, [7, 1, 2],
                                                        [7, 1, 2, 7, 1, 2, 7, 1])


@BOTH
def test_requests_are_independent_and_finish_frees_state(opts):
    prop = SamProposer(8, **opts)
    assert prop.active_requests() == 0
    assert prop.state_nbytes() == 0
    prop.start("a", CTX)
    prop.start("b", [5, 6, 5, 6])
    assert prop.active_requests() == 2
    nbytes_two = prop.state_nbytes()
    assert nbytes_two > 0
    assert prop.propose("a", 8).tokens.tolist() == on_ctx(opts, [4, 5, 1, 2, 3], 8)
    assert prop.propose("b", 8).tokens.tolist() == both(opts, [5, 6], [5, 6] * 4)
    prop.observe("b", [5])
    assert prop.propose("a", 8).tokens.tolist() == on_ctx(opts, [4, 5, 1, 2, 3], 8)
    prop.finish("a")
    assert prop.active_requests() == 1
    assert 0 < prop.state_nbytes() < nbytes_two
    with pytest.raises(KeyError):
        prop.propose("a", 8)
    prop.finish("a")  # finishing twice (or an unknown id) is harmless
    prop.finish("never-started")
    prop.finish("b")
    assert prop.active_requests() == 0
    assert prop.state_nbytes() == 0


@BOTH
def test_state_grows_with_context(opts):
    prop = SamProposer(8, **opts)
    prop.start("r", CTX)
    before = prop.state_nbytes()
    prop.observe("r", list(range(100, 200)))
    assert prop.state_nbytes() > before


def test_frequent_keeps_counts_first_does_not():
    a, b = SamProposer(8), SamProposer(8, **FIRST)
    a.start("r", CTX)
    b.start("r", CTX)
    assert a._automata["r"].count_depth == COUNT_DEPTH
    assert b._automata["r"].count_depth == 0
    assert a.state_nbytes() > b.state_nbytes()  # one more array per state


# --------------------------------------------------------------- properties
@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=60), st.integers(1, 12), st.integers(0, 14),
       st.integers(1, 4), st.sampled_from([0.01, 0.5, 1.0, 1.5, 4.0, 100.0]))
def test_draft_properties_first(ctx, k, budget, min_match, factor):
    prop = SamProposer(k, sam_min_match_len=min_match, sam_spec_factor=factor, **FIRST)
    prop.start("r", ctx)
    draft = prop.propose("r", budget).tokens.tolist()
    match_len = SuffixAutomaton(ctx).match_len
    if match_len < min_match or budget <= 0:
        assert draft == []
        return
    cap = min(k, budget, max(1, math.ceil(factor * match_len)))
    assert 1 <= len(draft) <= cap
    # the draft follows an earlier occurrence of a suffix (>= min_match) of ctx
    n = len(ctx)
    assert any(
        ctx[e - length + 1:e + 1] == ctx[n - length:] and ctx[e + 1:e + 1 + len(draft)] == draft
        for length in range(min_match, match_len + 1)
        for e in range(length - 1, n - 1))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=60), st.integers(1, 12), st.integers(0, 14),
       st.integers(1, 4))
def test_draft_properties_frequent(ctx, k, budget, min_match):
    prop = SamProposer(k, sam_min_match_len=min_match)
    prop.start("r", ctx)
    d = prop.propose("r", budget)
    draft = d.tokens.tolist()
    sa = SuffixAutomaton(ctx, count_depth=COUNT_DEPTH)
    if sa.match_len < min_match or budget <= 0:
        assert draft == []
        return
    # a fresh acceptance table (1/2 everywhere) cuts nothing at the default 0.15
    expected, _ = sa.frequent_continuation(min(k, budget), 0.0, min_match)
    assert draft == expected
    assert len(draft) <= min(k, budget)
    if draft:
        assert d.scores.tolist() == [0.5] * len(draft)
    # each token followed, in ctx, an occurrence of a suffix (>= min_match) of
    # the match and the tokens before it (the walk stays in the text)
    walked = ctx[len(ctx) - sa.match_len:]
    n = len(ctx)
    for t in draft:
        assert any(ctx[e - length + 1:e + 1] == walked[len(walked) - length:] and ctx[e + 1] == t
                   for length in range(min_match, len(walked) + 1)
                   for e in range(length - 1, n - 1)), (ctx, walked, t)
        walked = walked + [t]
    # a context of at least min_match always continues: it drafts all
    assert len(draft) == min(k, budget)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.data(),
       st.sampled_from(["first", "frequent"]))
def test_observe_equals_start(ctx, data, continuation):
    cut = data.draw(st.integers(0, len(ctx)), label="cut")
    # (no live windows: a's own output would enter its store, b's prompt not)
    a = SamProposer(6, sam_continuation=continuation, sam_global_live=False)
    b = SamProposer(6, sam_continuation=continuation, sam_global_live=False)
    a.start("r", ctx[:cut])
    pos = cut
    while pos < len(ctx):
        step = data.draw(st.integers(1, 5), label="step")
        a.observe("r", ctx[pos:pos + step])
        pos += step
    b.start("r", ctx)
    assert a.propose("r", 6).tokens.tolist() == b.propose("r", 6).tokens.tolist()
    assert a.state_nbytes() == b.state_nbytes()


# --------------------------------------------------- acceptance by match length
def test_acceptance_prior_is_one_half():
    acc = AcceptanceByMatchLength(5)
    for match_len in (0, 1, 2, MAX_BUCKET - 1, MAX_BUCKET, 1000):
        assert acc.prob(match_len).tolist() == [0.5] * 5
    assert acc.tried.shape == acc.accepted.shape == (MAX_BUCKET + 1, 5)
    assert acc.proposals.tolist() == [0] * (MAX_BUCKET + 1)


def test_acceptance_buckets():
    assert [AcceptanceByMatchLength.bucket(n) for n in (0, 1, 7, MAX_BUCKET - 1, MAX_BUCKET,
                                                       MAX_BUCKET + 1, 10_000)] == [
        0, 1, 7, MAX_BUCKET - 1, MAX_BUCKET, MAX_BUCKET, MAX_BUCKET]


def reference_prob(acc: AcceptanceByMatchLength, b: int) -> list[float]:
    """The documented estimate, written out: Beta(1, 1) at the first position;
    position i shrinks (PRIOR_WEIGHT drafts) towards the estimate at i - 1
    times the decay over all buckets, min(q[i] / q[i - 1], 1), q[i] = (sum of
    accepted at i + 1) / (sum of tried at i + 2)."""
    q = [(sum(acc.accepted[:, i]) + 1) / (sum(acc.tried[:, i]) + 2)
         for i in range(acc.tried.shape[1])]
    out = [(acc.accepted[b, 0] + 1) / (acc.tried[b, 0] + 2)]
    for i in range(1, len(q)):
        prior = out[-1] * min(q[i] / q[i - 1], 1.0)
        out.append((acc.accepted[b, i] + PRIOR_WEIGHT * prior) / (acc.tried[b, i] + PRIOR_WEIGHT))
    return out


def test_acceptance_update_and_prob_arithmetic():
    assert PRIOR_WEIGHT == 2.0  # the hand-computed numbers below
    acc = AcceptanceByMatchLength(6)
    acc.update(3, drafted=4, accepted=2)
    assert acc.tried[3].tolist() == [1, 1, 1, 1, 0, 0]
    assert acc.accepted[3].tolist() == [1, 1, 0, 0, 0, 0]
    # over all buckets q = [2/3, 2/3, 1/3, 1/3, 1/2, 1/2]: decay [1, 1/2, 1, 1, 1]
    # position 1: (1 + 2 * 2/3) / 3; position 2: (0 + 2 * 7/9 * 1/2) / 3; then
    # (0 + 2 * 7/27) / 3, and the untried positions keep the last estimate
    assert acc.prob(3).tolist() == pytest.approx(
        [2 / 3, 7 / 9, 7 / 27, 14 / 81, 14 / 81, 14 / 81])
    # an untried bucket: 1/2, then the decay
    assert acc.prob(4).tolist() == pytest.approx([1 / 2, 1 / 2, 1 / 4, 1 / 4, 1 / 4, 1 / 4])
    acc.update(3, drafted=2, accepted=0)
    acc.update(3, drafted=6, accepted=6)
    # tried [3, 3, 2, 2, 1, 1], accepted [2, 2, 1, 1, 1, 1]
    assert acc.prob(3).tolist() == pytest.approx(reference_prob(acc, 3))
    for other in (0, 1, 2, 4, MAX_BUCKET):
        assert acc.tried[other].sum() == 0
        assert acc.prob(other).tolist() == pytest.approx(reference_prob(acc, other))
        assert acc.prob(other)[0] == 0.5
    # long matches share the last bucket
    acc.update(MAX_BUCKET + 5, drafted=1, accepted=0)
    assert acc.prob(MAX_BUCKET)[0] == pytest.approx(1 / 3)
    assert acc.prob(10 ** 6).tolist() == acc.prob(MAX_BUCKET).tolist()
    assert acc.prob(MAX_BUCKET - 1)[0] == 0.5


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, MAX_BUCKET + 3), st.integers(0, 6),
                          st.integers(0, 6)), max_size=40))
def test_acceptance_estimates_match_the_reference(updates):
    """Any sequence of updates: every bucket's estimates are the reference's,
    within [0, 1], and a deeper untried position never exceeds the one before."""
    acc = AcceptanceByMatchLength(6)
    for match_len, drafted, accepted in updates:
        acc.update(match_len, drafted, min(accepted, drafted))
        for b in {0, 1, acc.bucket(match_len), MAX_BUCKET}:
            p = acc.prob(b)
            assert p.tolist() == pytest.approx(reference_prob(acc, b))
            assert np.all((p >= 0) & (p <= 1))
            for i in range(1, 6):
                if acc.tried[b, i] == 0:
                    assert p[i] <= p[i - 1] + 1e-12


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, MAX_BUCKET + 3), st.integers(0, 6), st.integers(0, 6)),
                max_size=25),
       st.sampled_from([0.0, 0.01, 0.054, 0.3, 0.46, 1.0, 5.0]))
def test_best_length_is_best_node_count_of_the_monotone_prefix(updates, cost):
    """The cached one-pass best lengths equal ``budget.best_node_count`` over
    the non-increasing estimates cut at n, for every n, bucket and cost, after
    any updates (the cache is dropped by each)."""
    from vllm_specplug.budget import best_node_count

    acc = AcceptanceByMatchLength(6)
    for step, (match_len, drafted, accepted) in enumerate([(0, 0, 0)] + updates):
        if step:
            acc.update(match_len, drafted, min(accepted, drafted))
        for b in {0, 1, acc.bucket(match_len), MAX_BUCKET}:
            mono = np.minimum.accumulate(acc.prob(b))
            for n in range(0, 9):
                assert acc.best_length(b, n, cost) == best_node_count(mono[:n], cost, n)


def test_acceptance_cut():
    acc = AcceptanceByMatchLength(6)
    acc.update(3, drafted=4, accepted=2)  # prob [2/3, 7/9, 7/27, 14/81, 14/81, 14/81]
    assert acc.cut(3, 6, 0.4) == 2       # position 2 is the first below 0.4
    assert acc.cut(3, 2, 0.4) == 2       # nothing below within the first two
    assert acc.cut(3, 1, 0.4) == 1
    assert acc.cut(3, 6, 0.15) == 6      # nothing below 0.15
    assert acc.cut(3, 6, 0.0) == 6
    assert acc.cut(3, 6, 0.7) == 0       # already the first position is below
    assert acc.cut(3, 0, 0.7) == 0
    assert acc.proposals[3] == 7         # every call counts as a proposal of its bucket
    assert acc.cut(4, 6, 0.51) == 0      # the prior (1/2) is below 0.51
    assert acc.cut(4, 6, 0.5) == 2       # ... but not below 0.5, then the decay (1/2)
    assert acc.proposals.tolist() == [0, 0, 0, 7, 2] + [0] * (MAX_BUCKET - 4)


def test_acceptance_cut_explores_every_nth_proposal_of_a_bucket():
    acc = AcceptanceByMatchLength(8)
    for _ in range(10):
        acc.update(5, drafted=8, accepted=2)
    # prob: positions 0, 1 at 11/12; positions 2.. at 1/12
    got = [acc.cut(5, 8, 0.5) for _ in range(3 * EXPLORE_EVERY)]
    expected = [3 if i % EXPLORE_EVERY == 0 else 2 for i in range(1, 3 * EXPLORE_EVERY + 1)]
    assert got == expected
    # a proposal that is not cut is not extended, but still counts
    acc2 = AcceptanceByMatchLength(8)
    got = [acc2.cut(1, 8, 0.1) for _ in range(EXPLORE_EVERY - 1)]
    assert got == [8] * (EXPLORE_EVERY - 1)
    assert acc2.cut(1, 8, 0.1) == 8          # the EXPLORE_EVERY-th, nothing to extend
    acc2.update(1, drafted=8, accepted=0)
    acc2.update(1, drafted=8, accepted=0)   # prob 1/4 everywhere
    got = [acc2.cut(1, 8, 0.3) for _ in range(EXPLORE_EVERY)]
    assert got == [0] * (EXPLORE_EVERY - 1) + [1]
    # each bucket counts its own proposals
    acc3 = AcceptanceByMatchLength(4)
    acc3.update(2, 4, 0)
    acc3.update(2, 4, 0)
    acc3.update(7, 4, 0)
    acc3.update(7, 4, 0)
    got = [(acc3.cut(2, 4, 0.3), acc3.cut(7, 4, 0.3)) for _ in range(EXPLORE_EVERY)]
    assert got == [(0, 0)] * (EXPLORE_EVERY - 1) + [(1, 1)]


def test_acceptance_counts_are_halved_at_the_horizon():
    acc = AcceptanceByMatchLength(3)
    for _ in range(STATS_HORIZON - 1):
        acc.update(5, drafted=2, accepted=1)
    assert acc.tried[5].tolist() == [STATS_HORIZON - 1, STATS_HORIZON - 1, 0]
    assert acc.accepted[5].tolist() == [STATS_HORIZON - 1, 0, 0]
    acc.update(5, drafted=2, accepted=0)  # tried[5, 0] reaches the horizon
    assert acc.tried[5].tolist() == [STATS_HORIZON / 2, STATS_HORIZON / 2, 0]
    assert acc.accepted[5].tolist() == [(STATS_HORIZON - 1) / 2, 0, 0]
    p = acc.prob(5)
    assert p[0] == pytest.approx((STATS_HORIZON / 2 + 0.5) / (STATS_HORIZON / 2 + 2))
    assert p.tolist() == pytest.approx(reference_prob(acc, 5)) and p[1] < 1e-3
    # other buckets are not halved
    acc.update(6, drafted=1, accepted=1)
    assert acc.tried[6].tolist() == [1, 0, 0]
    # the next halving comes after another STATS_HORIZON / 2 drafts
    for _ in range(STATS_HORIZON // 2 - 1):
        acc.update(5, drafted=1, accepted=1)
    assert acc.tried[5, 0] == STATS_HORIZON - 1
    acc.update(5, drafted=1, accepted=1)
    assert acc.tried[5, 0] == STATS_HORIZON / 2


def test_acceptance_halving_follows_a_change_of_workload():
    # after a long run of rejections, a run of acceptances brings the estimate
    # back faster than it would without halving
    acc = AcceptanceByMatchLength(1)
    for _ in range(STATS_HORIZON - 1):
        acc.update(2, drafted=1, accepted=0)
    for _ in range(STATS_HORIZON):
        acc.update(2, drafted=1, accepted=1)
    # without halving: 4096 / 8193 < 1/2; with it, accepted dominates
    assert acc.prob(2)[0] > 0.6


# ------------------------------------------------- SamProposer and the table
def test_observe_counts_the_accepted_prefix_of_the_draft():
    # never cut: what is counted does not depend on what the table learned
    prop = SamProposer(8, sam_continuation="first", sam_min_accept_prob=0.0)
    prop.start("r", CTX)
    assert prop.propose("r", 8).tokens.tolist() == [4, 5, 1, 2, 3]  # match length 3
    prop.observe("r", [4, 5, 9])  # 4 and 5 accepted, 9 the bonus token
    assert prop.acceptance.tried[3].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert prop.acceptance.accepted[3].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]

    prop.start("s", CTX)
    prop.propose("s", 8)
    prop.observe("s", [4])  # only a bonus token: it equals draft[0], but it is not accepted
    assert prop.acceptance.tried[3].tolist() == [2, 2, 2, 2, 2, 0, 0, 0]
    assert prop.acceptance.accepted[3].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]

    prop.start("t", CTX)
    prop.propose("t", 8)
    prop.observe("t", [4, 5, 1, 2, 3, 4])  # all 5 accepted, then the bonus
    assert prop.acceptance.accepted[3].tolist() == [2, 2, 1, 1, 1, 0, 0, 0]

    prop.start("u", CTX)
    prop.propose("u", 2)  # budget 2: the draft [4, 5]
    prop.observe("u", np.asarray([4, 5, 1], dtype=np.int32))
    assert prop.acceptance.tried[3].tolist() == [4, 4, 3, 3, 3, 0, 0, 0]
    assert prop.acceptance.accepted[3].tolist() == [3, 3, 1, 1, 1, 0, 0, 0]
    # the other buckets saw nothing
    assert prop.acceptance.tried.sum() == prop.acceptance.tried[3].sum()


def test_observe_without_a_pending_draft_learns_nothing():
    prop = SamProposer(8)
    prop.start("r", CTX)
    prop.observe("r", [4, 5])  # nothing was proposed
    assert prop.acceptance.tried.sum() == 0
    assert prop.propose("r", 8).tokens.tolist()  # match [1, 2, 3, 4, 5]: a draft
    prop.start("r", CTX)  # a rebuild forgets the pending draft
    prop.observe("r", [4])
    assert prop.acceptance.tried.sum() == 0
    prop.propose("r", 8)
    prop.finish("r")  # so does finishing
    prop.start("r", CTX)
    prop.observe("r", [4])
    assert prop.acceptance.tried.sum() == 0
    prop.propose("r", 8)
    prop.observe("r", [4])
    assert prop.acceptance.tried.sum() > 0
    before = prop.acceptance.tried.copy()
    prop.observe("r", [5])  # a draft is learned from once
    assert np.array_equal(prop.acceptance.tried, before)
    # an empty draft leaves nothing pending
    prop.start("x", [1, 2, 3])
    assert len(prop.propose("x", 8)) == 0
    prop.observe("x", [1])
    assert np.array_equal(prop.acceptance.tried, before)


def test_scores_are_the_learned_estimates():
    prop = SamProposer(4, sam_continuation="first", sam_min_accept_prob=0.0)  # no cut
    prop.acceptance.update(3, drafted=4, accepted=1)
    prop.start("r", CTX)
    d = prop.propose("r", 4)
    assert d.tokens.tolist() == [4, 5, 1, 2]
    # q = [2/3, 1/3, 1/3, 1/3], decay [1/2, 1, 1]: 2/3, (0 + 2 * 1/3) / 3, ...
    assert d.scores.tolist() == pytest.approx([2 / 3, 2 / 9, 4 / 27, 8 / 81])


def test_min_accept_prob_cuts_the_draft():
    prop = SamProposer(8, sam_continuation="first", sam_min_accept_prob=0.4)
    prop.acceptance.update(3, drafted=8, accepted=2)  # [2/3, 2/3, 1/3, ...]
    assert draft_of(prop, CTX) == [4, 5]
    off = SamProposer(8, sam_continuation="first", sam_min_accept_prob=0.0)
    off.acceptance.update(3, drafted=8, accepted=0)
    off.acceptance.update(3, drafted=8, accepted=0)
    assert draft_of(off, CTX) == [4, 5, 1, 2, 3]  # 0 never cuts
    assert off.acceptance.proposals.sum() == 0     # and does not consult the table


def test_acceptance_table_is_shared_by_requests():
    prop = SamProposer(8, sam_continuation="first", sam_min_accept_prob=0.15)
    for i in range(5):  # five drafts from a match of length 3, all rejected
        rid = f"r{i}"
        prop.start(rid, CTX)
        d = prop.propose(rid, 8).tokens.tolist()
        # deeper positions learnt wrong are cut first
        assert d[:1] == [4] and d == [4, 5, 1, 2, 3][: len(d)]
        prop.observe(rid, [9])
        prop.finish(rid)
    # 1/7 < 0.15: a new request with a match of length 3 gets no draft ...
    assert draft_of(prop, CTX, req="new") == []
    # ... while other match lengths are unaffected
    assert draft_of(prop, [1, 2, 3, 4, 1, 2], req="other") == [3, 4, 1, 2]


# A crafted output where every draft is wrong: after the prompt, A is followed
# by a token never seen before, each time. Before each new token the match is
# [A] (length 1), whose draft is wrong; after it there is no match (no draft).
A = 0
WRONG_PROMPT = [A, 1000]
WRONG_OUT = [tok for i in range(1, 80) for tok in (A, 1000 + i)]


@pytest.mark.parametrize("opts", [{"sam_continuation": "first", "sam_min_accept_prob": 0.15},
                                  {"sam_continuation": "frequent",
                                   "sam_min_accept_prob": 0.15}],
                         ids=["first", "frequent"])
def test_learned_cut_shrinks_drafts_that_are_always_wrong(opts):
    # no global store: the next request below would draft from WRONG_OUT there
    prop = RecordingSam(8, sam_global_tokens=0, **opts)
    res = replay(prop, WRONG_PROMPT, WRONG_OUT, 8)
    assert res["accepted"] == 0 and res["steps"] == res["generated"] == len(WRONG_OUT)
    assert {m for m, _ in prop.log} == {0, 1}
    assert all(n == 0 for m, n in prop.log if m == 0)
    lengths = [n for m, n in prop.log if m == 1]
    assert len(lengths) == len(WRONG_OUT) // 2
    # every bucket-1 proposal had tokens to draft and consulted the table once
    assert prop.acceptance.proposals[1] == len(lengths)
    # with prior 1/2, the estimate after t rejections is 1/(t + 2): the first
    # t such that it is below 0.15 is 5; from then on only exploration drafts
    warm = next(t for t in range(100) if 1 / (t + 2) < 0.15)
    assert warm == 5
    # before: deeper positions are cut as they are learnt wrong (the decay
    # over positions), yet every proposal keeps its first token
    assert lengths[0] >= 2 and all(n >= 1 for n in lengths[:warm])
    assert lengths[warm:] == [1 if j % EXPLORE_EVERY == 0 else 0
                              for j in range(warm + 1, len(lengths) + 1)]
    assert res["drafts"] == warm + len(lengths) // EXPLORE_EVERY
    assert res["draft_tokens"] == sum(lengths)
    assert prop.acceptance.prob(1)[0] < 0.15
    # the next request with a length-1 match starts with what was learned
    nxt = prop.acceptance.proposals[1] + 1
    expected = 1 if nxt % EXPLORE_EVERY == 0 else 0
    assert len(draft_of(prop, [A, 5000, A], req="next")) == expected


@pytest.mark.parametrize("opts", [{"sam_continuation": "first"},
                                  {"sam_continuation": "frequent"}],
                         ids=["first", "frequent"])
def test_without_the_learned_cut_wrong_drafts_stay(opts):
    # the control for the test above: the same workload with sam_min_accept_prob=0
    prop = RecordingSam(8, sam_min_accept_prob=0.0, **opts)
    res = replay(prop, WRONG_PROMPT, WRONG_OUT, 8)
    lengths = [n for m, n in prop.log if m == 1]
    assert min(lengths) >= 2
    assert res["drafts"] == len(lengths)
    assert res["accepted"] == 0


@pytest.mark.parametrize("continuation", ["first", "frequent"])
def test_learned_cut_keeps_drafts_that_are_always_right(continuation):
    # period 12 > K: every draft is the next K tokens of the period
    pattern = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    k = 8
    prop = RecordingSam(k, sam_continuation=continuation)
    out = pattern * 30
    res = replay(prop, pattern * 2, out, k)
    assert [n for _, n in prop.log] == [k] * len(prop.log)
    assert all(m >= 12 for m, _ in prop.log)
    # every step but the last accepts the whole draft
    assert res["steps"] == 1 + math.ceil((len(out) - 1) / (k + 1))
    assert res["accepted"] == res["generated"] - res["steps"]
    assert res["generated"] / res["steps"] > k
    long = sum(1 for m, _ in prop.log if m >= MAX_BUCKET)
    assert long == len(prop.log) - 1  # the first match is 13 long (two periods + 1)
    assert prop.acceptance.tried[MAX_BUCKET].tolist() == [long] * k
    assert (prop.acceptance.prob(MAX_BUCKET) > 0.9).all()


@pytest.mark.parametrize("pattern", [[7], [1, 2, 3]])
def test_frequent_drafts_k_tokens_on_a_periodic_text(pattern):
    assert len(draft_of(SamProposer(8), pattern * 20)) == 8
# -------------------------------------------------------------------- Draft
def test_draft_chain_and_empty():
    d = Draft.chain([4, 5, 6])
    assert len(d) == 3
    assert d.tokens.dtype == np.int32
    assert d.tokens.tolist() == [4, 5, 6]
    assert d.parents is None and d.scores is None
    assert d.is_chain
    assert d.parent_array().tolist() == [-1, 0, 1]
    assert d.depths().tolist() == [1, 2, 3]
    e = Draft.empty()
    assert len(e) == 0 and e.is_chain
    assert e.parent_array().tolist() == [] and e.depths().tolist() == []


def test_draft_chain_scores():
    d = Draft.chain([1, 2], scores=[0.9, 0.5])
    assert d.scores.dtype == np.float32
    assert d.scores.tolist() == pytest.approx([0.9, 0.5])
    with pytest.raises(ValueError, match="scores"):
        Draft.chain([1, 2], scores=[0.9])


def test_draft_tokens_are_flattened_int32():
    d = Draft(np.asarray([[1, 2], [3, 4]], dtype=np.int64))
    assert d.tokens.shape == (4,) and d.tokens.dtype == np.int32


def test_draft_explicit_chain_parents():
    d = Draft(np.asarray([7, 8, 9]), np.asarray([-1, 0, 1]))
    assert d.is_chain
    assert d.parents.dtype == np.int32
    assert d.depths().tolist() == [1, 2, 3]


def test_draft_tree():
    #        root
    #       /    \
    #      0      4
    #     / \
    #    1   2
    #    |
    #    3
    d = Draft(np.asarray([10, 11, 12, 13, 14]), np.asarray([-1, 0, 0, 1, -1]))
    assert not d.is_chain
    assert d.parent_array().tolist() == [-1, 0, 0, 1, -1]
    assert d.depths().tolist() == [1, 2, 2, 3, 1]
    two_roots = Draft(np.asarray([1, 2]), np.asarray([-1, -1]))
    assert not two_roots.is_chain
    assert two_roots.depths().tolist() == [1, 1]


@pytest.mark.parametrize("parents", [
    [0],            # a node its own parent
    [-1, 1],        # self-loop
    [-1, 2, 0],     # points forward
    [-2, 0],        # below -1
    [-1, 0, 5],     # out of range
])
def test_draft_rejects_parents_not_pointing_backwards(parents):
    with pytest.raises(ValueError, match="earlier"):
        Draft(np.arange(len(parents)), np.asarray(parents))


def test_draft_rejects_parents_of_wrong_size():
    with pytest.raises(ValueError, match="parents"):
        Draft(np.asarray([1, 2, 3]), np.asarray([-1, 0]))


def test_draft_is_frozen():
    d = Draft.chain([1])
    with pytest.raises(Exception):
        d.tokens = np.zeros(0, dtype=np.int32)  # type: ignore[misc]


# ------------------------------- sam_min_accept_prob unset (default): cost-based length

def _rate_argmax(p, cost, n):
    """Brute force: the length maximising (1 + sum of the non-increasing
    estimates) / (1 + cost * length); the shortest of ties."""
    q = np.minimum.accumulate(np.asarray(p[:n], dtype=float))
    rates = [(1 + q[:m].sum()) / (1 + cost * m) for m in range(n + 1)]
    return int(np.argmax(rates))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(0, 8)), max_size=12),
       st.integers(1, 20), st.integers(0, 8), st.floats(0.0, 2.0))
def test_cost_length_maximises_tokens_per_cost(updates, match_len, n, cost):
    table = AcceptanceByMatchLength(8)
    for drafted, accepted in updates:
        table.update(match_len, drafted, min(accepted, drafted))
    assert table.best_length(match_len, n, cost) == _rate_argmax(table.prob(match_len), cost, n)


def test_cost_length_follows_the_verify_cost():
    """A match whose drafts were accepted through 2 of 8 positions: a costly
    verified token keeps 2 tokens, a nearly free one the whole draft."""
    for cost, want in ((0.5, [4, 5]), (0.001, [4, 5, 1, 2, 3])):
        prop = SamProposer(8, sam_continuation="first")
        prop.relative_token_cost = cost
        prop.acceptance.update(3, drafted=8, accepted=2)  # [2/3, 2/3, 1/3, ...]
        assert draft_of(prop, CTX) == want, cost


def test_cost_length_stops_drafts_that_are_always_wrong():
    """With every draft rejected, a first token is worth its cost c while its
    estimate 1/(t + 2) after t rejections exceeds c; then only exploration."""
    cost = 0.08
    prop = RecordingSam(8, sam_global_tokens=0, sam_continuation="first")
    prop.relative_token_cost = cost
    res = replay(prop, WRONG_PROMPT, WRONG_OUT, 8)
    assert res["accepted"] == 0
    lengths = [n for m, n in prop.log if m == 1]
    warm = next(t for t in range(100) if 1 / (t + 2) <= cost)
    assert all(n >= 1 for n in lengths[:warm])
    assert lengths[warm:] == [1 if j % EXPLORE_EVERY == 0 else 0
                              for j in range(warm + 1, len(lengths) + 1)]
