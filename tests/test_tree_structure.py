"""Tree helpers against brute force on random trees (hypothesis)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_specplug.tree import (ancestor_mask, children_lists, compaction_moves, depths,
                                node_positions, path_to, validate_parents)


@st.composite
def trees(draw, max_nodes=40):
    n = draw(st.integers(0, max_nodes))
    return np.array([draw(st.integers(-1, i - 1)) for i in range(n)], dtype=np.int32)


def brute_ancestors(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = int(parents[i])
        out.add(i)
    return out


@settings(max_examples=200, deadline=None)
@given(trees())
def test_mask_depth_paths_against_brute_force(parents):
    n = parents.size
    mask = ancestor_mask(parents)
    d = depths(parents)
    for i in range(n):
        anc = brute_ancestors(parents, i)
        assert set(np.flatnonzero(mask[i]).tolist()) == anc
        assert d[i] == len(anc)
        path = path_to(parents, i)
        assert path[-1] == i and len(path) == d[i] and set(path) == anc
        assert all(parents[b] == a for a, b in zip(path, path[1:]))
        assert parents[path[0]] == -1
    assert np.array_equal(node_positions(parents, 100), 100 + d)
    kids = children_lists(parents)
    assert sorted(c for ks in kids for c in ks) == list(range(n))
    for p1, ks in enumerate(kids):
        assert all(parents[c] == p1 - 1 for c in ks)


@settings(max_examples=200, deadline=None)
@given(trees(), st.data())
def test_compaction_moves_make_the_path_contiguous(parents, data):
    if parents.size == 0:
        return
    leaf = data.draw(st.integers(0, parents.size - 1))
    path = path_to(parents, leaf)
    kv = list(range(parents.size))  # kv[offset] = which node's KV sits there
    for src, dst in compaction_moves(path):
        kv[dst] = kv[src]
    assert kv[:len(path)] == path


def test_chain_is_a_degenerate_tree():
    parents = np.arange(-1, 4)
    assert depths(parents).tolist() == [1, 2, 3, 4, 5]
    assert ancestor_mask(parents).sum() == 15
    assert compaction_moves(path_to(parents, 4)) == []


@pytest.mark.parametrize("bad", [[0], [-2], [-1, 1], [-1, 0, 3]])
def test_invalid_parents(bad):
    with pytest.raises(ValueError):
        validate_parents(np.array(bad))
