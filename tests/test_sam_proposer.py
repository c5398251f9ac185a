"""SamProposer life cycle and drafts, and the Draft container. No vLLM."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_specplug.proposers.base import Draft, Proposer
from vllm_specplug.proposers.sam import SamProposer
from vllm_specplug.proposers.suffix_automaton import SuffixAutomaton

CTX = [1, 2, 3, 4, 5, 1, 2, 3]  # match [1, 2, 3] (length 3), then 4 5 1 2 3 follow


def draft_of(prop: SamProposer, tokens, budget=None, req="r") -> list[int]:
    prop.start(req, tokens)
    d = prop.propose(req, prop.num_speculative_tokens if budget is None else budget)
    assert isinstance(d, Draft) and d.is_chain
    return d.tokens.tolist()


# ------------------------------------------------------------ hand examples
def test_is_a_registered_proposer():
    assert issubclass(SamProposer, Proposer)
    assert SamProposer.name == "sam"
    assert not SamProposer.drafts_trees
    assert {o.name for o in SamProposer.options} == {"sam_min_match_len", "sam_spec_factor"}
    defaults = {o.name: o.default for o in SamProposer.options}
    prop = SamProposer(4)
    assert prop.min_match_len == defaults["sam_min_match_len"] == 2
    assert prop.spec_factor == defaults["sam_spec_factor"] == 4.0


def test_draft_is_what_followed_the_earlier_occurrence():
    # K = 8, factor 4 -> up to 12 by factor, 8 by K; only 5 tokens follow [1, 2, 3]
    assert draft_of(SamProposer(8), CTX) == [4, 5, 1, 2, 3]


@pytest.mark.parametrize("k, expected", [(1, [4]), (2, [4, 5]), (3, [4, 5, 1]),
                                         (5, [4, 5, 1, 2, 3]), (128, [4, 5, 1, 2, 3])])
def test_draft_limited_by_k(k, expected):
    assert draft_of(SamProposer(k), CTX) == expected


@pytest.mark.parametrize("budget, expected", [(0, []), (-1, []), (1, [4]), (3, [4, 5, 1]),
                                              (100, [4, 5, 1, 2, 3])])
def test_draft_limited_by_budget(budget, expected):
    assert draft_of(SamProposer(8), CTX, budget=budget) == expected


@pytest.mark.parametrize("factor, expected", [
    (0.01, [4]),           # max(1, ceil(0.03)) = 1
    (0.34, [4, 5]),        # ceil(1.02) = 2
    (0.5, [4, 5]),         # ceil(1.5) = 2
    (1.0, [4, 5, 1]),      # ceil(3) = 3
    (1.2, [4, 5, 1, 2]),   # ceil(3.6) = 4
    (4.0, [4, 5, 1, 2, 3]),
])
def test_draft_limited_by_spec_factor(factor, expected):
    assert draft_of(SamProposer(8, sam_spec_factor=factor), CTX) == expected


@pytest.mark.parametrize("min_match, expected", [(1, [4, 5, 1, 2, 3]), (2, [4, 5, 1, 2, 3]),
                                                 (3, [4, 5, 1, 2, 3]), (4, []), (100, [])])
def test_no_draft_below_min_match(min_match, expected):
    assert draft_of(SamProposer(8, sam_min_match_len=min_match), CTX) == expected


def test_no_draft_without_a_match():
    prop = SamProposer(8, sam_min_match_len=1)
    assert draft_of(prop, []) == []
    assert draft_of(prop, [1, 2, 3, 4]) == []
    assert draft_of(prop, [9]) == []


def test_observe_extends_the_context():
    prop = SamProposer(8)  # min match 2
    prop.start("r", [1, 2, 3, 4, 5, 1])
    assert len(prop.propose("r", 8)) == 0  # match [1] is shorter than 2
    prop.observe("r", [2])
    # match [1, 2]: first earlier end 1, what follows: 3 4 5 1 2
    assert prop.propose("r", 8).tokens.tolist() == [3, 4, 5, 1, 2]
    prop.observe("r", [3], None)
    assert prop.propose("r", 8).tokens.tolist() == [4, 5, 1, 2, 3]
    prop.observe("r", [])  # an empty commit changes nothing
    assert prop.propose("r", 8).tokens.tolist() == [4, 5, 1, 2, 3]
    prop.observe("r", np.asarray([9, 9], dtype=np.int32))
    assert len(prop.propose("r", 8)) == 0


def test_start_rebuilds_from_scratch():
    prop = SamProposer(8)
    prop.start("r", CTX)
    prop.start("r", [1, 2, 7, 1, 2])  # e.g. after a preemption
    assert prop.active_requests() == 1
    assert prop.propose("r", 8).tokens.tolist() == [7, 1, 2]


def test_requests_are_independent_and_finish_frees_state():
    prop = SamProposer(8)
    assert prop.active_requests() == 0
    assert prop.state_nbytes() == 0
    prop.start("a", CTX)
    prop.start("b", [5, 6, 5, 6])
    assert prop.active_requests() == 2
    nbytes_two = prop.state_nbytes()
    assert nbytes_two > 0
    assert prop.propose("a", 8).tokens.tolist() == [4, 5, 1, 2, 3]
    assert prop.propose("b", 8).tokens.tolist() == [5, 6]
    prop.observe("b", [5])
    assert prop.propose("a", 8).tokens.tolist() == [4, 5, 1, 2, 3]
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


def test_state_grows_with_context():
    prop = SamProposer(8)
    prop.start("r", CTX)
    before = prop.state_nbytes()
    prop.observe("r", list(range(100, 200)))
    assert prop.state_nbytes() > before


# --------------------------------------------------------------- properties
@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=60), st.integers(1, 12), st.integers(0, 14),
       st.integers(1, 4), st.sampled_from([0.01, 0.5, 1.0, 1.5, 4.0, 100.0]))
def test_draft_properties(ctx, k, budget, min_match, factor):
    prop = SamProposer(k, sam_min_match_len=min_match, sam_spec_factor=factor)
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


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.data())
def test_observe_equals_start(ctx, data):
    cut = data.draw(st.integers(0, len(ctx)), label="cut")
    a, b = SamProposer(6, sam_min_match_len=1), SamProposer(6, sam_min_match_len=1)
    a.start("r", ctx[:cut])
    pos = cut
    while pos < len(ctx):
        step = data.draw(st.integers(1, 5), label="step")
        a.observe("r", ctx[pos:pos + step])
        pos += step
    b.start("r", ctx)
    assert a.propose("r", 6).tokens.tolist() == b.propose("r", 6).tokens.tolist()
    assert a.state_nbytes() == b.state_nbytes()


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
