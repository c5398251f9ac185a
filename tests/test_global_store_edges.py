"""Edges of the global store that its property tests (tests/test_global_store.py)
do not reach: the counters, refused inputs and their messages, a match longer
than the re-match window, forgotten segments, the empty match, and the types
of what it returns. Written for the survivors of mutation testing
(results/mutation/2026-12-04/global_store.txt; docs/testing.md)."""
from __future__ import annotations

import numpy as np
import pytest

from vllm_specplug.proposers import global_store as gs
from vllm_specplug.proposers.global_store import GlobalMatch, GlobalStore


def test_documents_added_held_and_segments_dropped_are_counted():
    # segments of 20 tokens: four 5-token documents each, the fifth starts a
    # new segment; two segments kept
    store = GlobalStore(40, num_segments=2)
    for i in range(1, 21):
        store.add([i, i + 1, i + 2, i + 3, i + 4])
        assert store.documents_added == i
        segments = -(-i // 4)
        assert store.segments_dropped == max(0, segments - 2)
        held = store.documents()
        assert store.num_documents == len(held) == i - 4 * max(0, segments - 2)
        assert held[-1] == [i, i + 1, i + 2, i + 3, i + 4]
    assert store.segments_dropped == 3


def test_bad_sizes_and_token_ids_are_refused_with_their_reason():
    with pytest.raises(ValueError, match=r"^a global store needs at least 2 segments$"):
        GlobalStore(100, num_segments=1)
    with pytest.raises(ValueError, match=r"^max_tokens must be at least 4, got 3$"):
        GlobalStore(3, num_segments=4)
    store = GlobalStore(4, num_segments=4)   # the smallest store: one token a segment
    store.add([5])
    store.add([6])
    assert store.documents() == [[5], [6]]
    for bad in ([-1], [2 ** 31]):
        with pytest.raises(ValueError, match=r"^token ids must be in \[0, 2\^31\)$"):
            store.add(bad)
    top = 2 ** 31 - 1                        # the largest token id is taken
    store.add([top])
    assert store.documents()[-1] == [top]
    assert store.match([top])[2] == 1


def test_a_segment_that_cannot_take_a_document_says_so(monkeypatch):
    """Cannot happen (a segment's arrays are sized for its worst case); if it
    does, the error names it as a bug."""
    store = GlobalStore(64)
    monkeypatch.setattr(gs, "_add_document", lambda *args: False)
    with pytest.raises(RuntimeError,
                       match=r"^global store segment outgrew its arrays \(a bug\)$"):
        store.add([1, 2, 3])


def test_a_match_longer_than_the_window_stays_exact():
    """A request's match in an unchanged segment is extended with its committed
    tokens, so it can grow past ``window``; only past ``window`` pending tokens
    is it recomputed from the context's last ``window`` tokens."""
    window = 16
    store = GlobalStore(4096, window=window)
    doc = list(range(1, 101))                 # every token once: match lengths are exact
    store.add(doc)
    m = GlobalMatch()
    store.refresh(m, doc[:30])                # a fresh match: the last 16 tokens
    assert store.best(m)[2] == window
    store.advance(m, doc[30:30 + window])     # exactly `window` pending: extended
    store.refresh(m, doc[:30 + window])
    assert store.best(m)[2] == 2 * window
    store.advance(m, doc[46:50])
    store.refresh(m, doc[:50])
    assert store.best(m)[2] == 2 * window + 4
    store.advance(m, doc[50:50 + window + 1])  # past the window: recomputed
    store.refresh(m, doc[:50 + window + 1])
    assert store.best(m)[2] == window


def test_matches_in_dropped_segments_are_forgotten():
    store = GlobalStore(40, num_segments=2)   # segments of 20 tokens
    m, context = GlobalMatch(), []
    for i in range(6):                        # one 12-token document a segment
        store.add([i + 1] * 12)
        store.advance(m, [i + 1] * 3)
        context += [i + 1] * 3
        store.refresh(m, context)
        assert set(m.per_segment) == {seg.id for seg in store.segments}
        assert store.best(m)[0::2] == (len(store.segments) - 1, 3)


def test_no_match_is_minus_one_zero_zero():
    store = GlobalStore(64)
    assert store.best(GlobalMatch()) == (-1, 0, 0)
    store.add([1, 2, 3])
    assert store.match([9]) == (-1, 0, 0)
    assert store.continuation(-1, 0, 4) == []


def test_continuations_are_lists_of_python_ints():
    store = GlobalStore(64)
    store.add([1, 2, 3, 1, 2, 4, 1, 2, 3])
    segment, state, length = store.match([1, 2])
    assert length == 2
    for mode in ("frequent", "first"):
        tokens = store.continuation(segment, state, 4, mode)
        assert tokens and all(type(t) is int for t in tokens), (mode, tokens)


def test_edge_keys_are_exact_integers():
    """Edge keys are ``(state << 32 | token) + 1``: past 2**53 (states from
    2**21 on, in a segment of a store of ~4M tokens or more) a float key
    would merge different edges."""
    store = GlobalStore(64)
    store.add([1, 2, 3])
    seg = store.segments[0]
    assert seg.h_keys.dtype == np.int64
    assert {a.dtype for a in (seg.corpus, seg.st_len, seg.st_link, seg.st_first, seg.st_cnt,
                              seg.head, seg.e_tok, seg.e_tgt, seg.e_next,
                              seg.h_edges)} == {np.dtype(np.int32)}


def test_the_longest_match_wins_over_a_newer_segment():
    """``best`` compares match lengths: an older segment's longer match wins
    over the newest segment's shorter one, however many documents that holds."""
    store = GlobalStore(40, num_segments=2)   # segments of 20 tokens
    store.add(list(range(1, 21)))             # segment 0, full: 1..20
    for doc in ([5], [30], [31], [32], [33]):  # segment 1: five documents
        store.add(doc)
    assert [s.num_documents for s in store.segments] == [1, 5]
    segment, _, length = store.match([3, 4, 5])
    assert (segment, length) == (0, 3)
    assert store.match([9, 5])[0::2] == (1, 1)    # a tie goes to the newest
