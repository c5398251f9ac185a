"""The global store's byte accounting against what its arrays hold (no
engine): written for the survivors of mutation testing (docs/testing.md)."""
from __future__ import annotations

import numpy as np
import pytest

from vllm_specplug.proposers import global_store as gs
from vllm_specplug.proposers.global_store import GlobalStore

PER_STATE = ("st_len", "st_link", "st_first", "st_cnt", "head", "c_edge", "c_total", "c_stamp")
PER_EDGE = ("e_tok", "e_tgt", "e_next")


def _used_bytes(seg) -> int:
    """The doc's definition: the used parts of the arrays, the whole hash table."""
    states, edges = int(seg.counts[0]), int(seg.counts[1])
    return (seg.corpus[: seg.corpus_len].nbytes
            + sum(getattr(seg, a)[:states].nbytes for a in PER_STATE)
            + sum(getattr(seg, a)[:edges].nbytes for a in PER_EDGE)
            + seg.h_keys.nbytes + seg.h_edges.nbytes)


@pytest.mark.parametrize("max_tokens, segments", [(400, 4), (1000, 3), (90, 2)])
def test_max_nbytes_is_a_full_ring_of_reserved_segments(max_tokens, segments):
    g = GlobalStore(max_tokens, num_segments=segments)
    rng = np.random.default_rng(0)
    while len(g.segments) < segments or g.segments_dropped == 0:
        g.add(rng.integers(0, 50, size=g.segment_tokens).tolist())
    assert len(g.segments) == segments
    assert g.max_nbytes() == g.allocated_nbytes()
    assert g.resident_nbytes() < g.allocated_nbytes()


def test_resident_bytes_are_the_used_parts():
    g = GlobalStore(2000, num_segments=2)
    rng = np.random.default_rng(1)
    assert g.resident_nbytes() == 0
    for n in (5, 40, 300):
        g.add(rng.integers(0, 30, size=n).tolist())
        seg = g.segments[-1]
        assert seg.counts[0] > 1 and seg.counts[1] > 0
        assert seg.resident_nbytes() == _used_bytes(seg)
    assert g.resident_nbytes() == sum(_used_bytes(s) for s in g.segments)


@pytest.mark.parametrize("edges", [0, 1, 9, 10, 100, 1000, 12345])
def test_hash_capacity_is_the_smallest_power_of_two_with_room(edges):
    cap = gs._hash_capacity(edges)
    need = edges * 1.3 + 16
    assert cap & (cap - 1) == 0 and cap >= 16
    assert cap >= need and (cap // 2 < need or cap == 16)


def test_zeros():
    z = gs._zeros(7, np.int64)
    assert z.dtype == np.int64 and z.shape == (7,) and not z.any()
    assert gs._zeros(0, np.int32).shape == (0,)
