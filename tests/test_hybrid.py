"""SAM[TR] hybrid: branch choice by match length, both parts kept in sync."""
from __future__ import annotations

import numpy as np
import pytest

from vllm_specplug.config import build_proposer, translate
from vllm_specplug.options import SpecPlugConfigError
from vllm_specplug.proposers.base import TargetTopK
from vllm_specplug.proposers.hybrid import SamTokenRecyclingProposer


def _topk(inputs, rows):
    rows = np.asarray(rows, dtype=np.int32)
    return TargetTopK(np.asarray(inputs, dtype=np.int32), rows, np.zeros(rows.shape))


def test_long_match_drafts_sams_chain_else_a_tree():
    p = SamTokenRecyclingProposer(8, sam_tr_threshold=3, sam_min_accept_prob=0.0,
                                  tr_prompt_bigrams=False, tr_topk=2)
    text = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8]          # suffix 5 6 7 8 seen before
    p.start("a", text)
    assert p.match_len("a") == 4
    d = p.propose("a", 8)
    assert d.is_chain and d.tokens[:3].tolist() == [9, 10, 11]
    p.observe("a", [9, 10, 11, 12], _topk([8, 9, 10, 11], [[9, 1], [10, 1], [11, 1], [12, 1]]))
    # the matrix learned from the verify forward whichever branch drafted
    assert p.tr.matrix[8].tolist() == [9, 1]
    p.start("b", [40, 41, 8])                             # match of length 1 only
    d = p.propose("b", 8)
    assert p.match_len("b") < 3
    assert d.tokens[0] == 9                               # TR: row 8's best candidate
    s = p.debug_stats()
    assert s["sam_steps"] == 1 and s["sam_accepted"] == 3 and s["sam_tau"] == 4.0


def test_no_draft_when_neither_part_has_one():
    p = SamTokenRecyclingProposer(8, tr_prompt_bigrams=False)
    p.start("a", [1, 2, 3])
    assert len(p.propose("a", 8)) == 0
    p.observe("a", [4])
    assert p.debug_stats()["none_steps"] == 1
    p.finish("a")
    assert p.active_requests() == 0 and p.tr.active_requests() == 0


def test_config_keys_of_both_parts_and_auto_budget(tmp_path):
    _, plugin = translate({"method": "sam_tr", "sam_tr_threshold": 7,
                           "sam_continuation": "first", "tr_topk": 4})
    p = build_proposer(plugin)
    assert p.threshold == 7 and p.sam.continuation == "first" and p.tr.k == 4
    assert plugin["auto_budget"] and p.tr.auto_budget
    assert p.sam.num_speculative_tokens == 16
    with pytest.raises(SpecPlugConfigError, match="sam_tr_threshold"):
        translate({"method": "sam_tr", "sam_tr_threshold": 0})
    with pytest.raises(SpecPlugConfigError, match="tr_template"):
        translate({"method": "sam_tr", "tr_template": str(tmp_path / "none.json")})


# ------------------------------------------------------------ merged tree branch

def _paths(draft):
    """Root-to-node token paths of a draft, with each node's score."""
    parents = draft.parent_array()
    out = {}
    for i in range(len(draft)):
        path, j = [], i
        while j >= 0:
            path.append(int(draft.tokens[j]))
            j = int(parents[j])
        out[tuple(reversed(path))] = None if draft.scores is None else float(draft.scores[i])
    return out


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def trees(draw, vocab=3, max_nodes=8):
    """Random tries: no two siblings share a token."""
    n = draw(st.integers(0, max_nodes))
    tokens, parents, seen = [], [], set()
    for _ in range(n):
        p = draw(st.integers(-1, len(tokens) - 1))
        t = draw(st.integers(0, vocab - 1))
        if (p, t) not in seen:
            seen.add((p, t))
            parents.append(p)
            tokens.append(t)
    scores = draw(st.lists(st.floats(0, 1), min_size=len(tokens), max_size=len(tokens)))
    from vllm_specplug.proposers.base import Draft

    return Draft(np.asarray(tokens), np.asarray(parents), np.asarray(scores))


@settings(max_examples=300, deadline=None)
@given(trees(), trees())
def test_merge_drafts_is_the_union_of_paths_with_the_larger_score(a, b):
    from vllm_specplug.tree.structure import merge_drafts

    merged, index_of_b = merge_drafts(a, b)
    pa, pb, pm = _paths(a), _paths(b), _paths(merged)
    assert set(pm) == set(pa) | set(pb)
    assert len(pm) == len(merged)  # a trie: one node per path
    for path, s in pm.items():
        assert s == pytest.approx(max(x for x in (pa.get(path), pb.get(path)) if x is not None))
    merged_paths = list(pm)  # in node order
    for i, path in enumerate(pb):
        assert merged_paths[index_of_b[i]] == path


def test_short_match_tree_also_holds_sams_chain():
    """Below the threshold the draft is the union of TR's tree and SAM's chain;
    SAM learns only from the part of its chain that was verified."""
    from vllm_specplug.proposers.base import Draft
    from vllm_specplug.proposers.hybrid import path_length

    p = SamTokenRecyclingProposer(8, sam_tr_threshold=5, sam_min_accept_prob=0.0,
                                  sam_continuation="first", sam_spec_factor=1.0,
                                  tr_prompt_bigrams=False, tr_topk=2)
    p.start("a", [1, 2, 3, 9, 9, 1, 2])                  # match "1 2" (length 2) -> 3 9
    p.tr.update(np.array([2, 30]), np.array([[30, 31], [32, 33]]))
    d = p.propose("a", 8)
    paths = _paths(d)
    assert set(paths) == {(3,), (3, 9), (30,), (31,), (30, 32), (30, 33)}  # SAM + TR
    chain = p._sam_chain["a"]
    assert chain[:1].tolist() == [3]
    assert path_length(d, chain) == len(chain)
    # a batch cut that keeps only TR's nodes: SAM forgets its whole chain
    tr_only = Draft(np.array([30]), np.array([-1]), np.array([0.5]))
    p.draft_cut("a", tr_only)
    assert "a" not in p.sam._pending
    p.observe("a", [3])
    assert p.debug_stats()["merged_sam_nodes"] >= 1


@pytest.mark.parametrize("merge", [False, True])
def test_merge_can_be_turned_off(merge):
    """Off: exactly TR's tree (not a subset of it: an empty draft would pass
    that); on (the control), SAM's short-match chain is in the draft."""
    p = SamTokenRecyclingProposer(8, sam_tr_threshold=5, sam_min_accept_prob=0.0,
                                  tr_prompt_bigrams=False, tr_topk=2, sam_tr_merge=merge)
    p.start("a", [1, 2, 3, 9, 9, 1, 2])
    p.tr.update(np.array([2]), np.array([[30, 31]]))
    paths = set(_paths(p.propose("a", 8)))
    if merge:
        assert (3,) in paths and p.debug_stats()["merged_sam_nodes"] >= 1
    else:
        assert paths == {(30,), (31,)} and p.debug_stats()["merged_sam_nodes"] == 0
