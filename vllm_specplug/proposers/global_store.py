"""A bounded store of committed outputs shared by all requests of a worker.

``sam``'s third draft source (next to the request's own automaton and the
static corpus): what earlier requests produced, so a new request can draft
from it (Arctic Inference's SuffixDecoding keeps such a global tree).

Structure: a ring of ``num_segments`` generalized suffix automata. Each
segment holds whole documents (one finished request's output, optionally its
prompt) inserted from the root, so a match never spans two documents; its
arrays are preallocated for ``segment_tokens = max_tokens // num_segments``
tokens (the worst-case 2 states and 3 transitions a token, as
``corpus_automaton``'s builder, whose numba insertion it reuses, in anonymous
memory maps whose untouched pages cost nothing). Only the newest segment
grows. When a document does not fit in it, a new segment starts, and when
that makes one segment too many the oldest is dropped whole: eviction frees
arrays and never rebuilds anything. The store keeps the newest documents, at
most ``max_tokens`` tokens (each older segment was sealed because the next
document did not fit: with short documents the store holds between
``max_tokens - segment_tokens`` and ``max_tokens``). A document longer than a
segment keeps its last ``segment_tokens`` tokens.

Matching: each request keeps one (state, length) per segment, advanced with
its committed tokens (a hash-table transition lookup per token and segment)
when it next looks at the store.
A segment that received documents since a request's match was computed
(``version``) is re-matched from the last ``window`` tokens of the request's
context; a sealed segment never changes, so its match is exact over the whole
context. The draft continues from the segment with the longest match (the
newest on a tie): its most frequent continuations (occurrence counts, kept
for the ``count_depth`` longest suffixes of each inserted token, as
``SuffixAutomaton``), or the tokens after the match's first occurrence.

Documents are added by the caller in a deterministic order (``SamProposer``
adds a step's finished requests sorted by request id), so every process that
sees the same finished requests holds the same store.

No vLLM import: a plain algorithm, property-tested against brute force
(tests/test_global_store.py).
"""
from __future__ import annotations

import itertools
import mmap
from typing import Sequence

import numpy as np

from ..jit import njit
from .corpus_automaton import _find_edge, _insert_token, _new_state

#: Separator after each document in a segment's token array (never a token id).
SEPARATOR = -1
#: Segments in the ring (the newest grows; the oldest is dropped whole).
DEFAULT_SEGMENTS = 4
#: Occurrence counts are kept for this many longest suffixes of each token.
DEFAULT_COUNT_DEPTH = 32
#: A stale match is recomputed from this many last context tokens.
DEFAULT_WINDOW = 128


# ------------------------------------------------------------------ numba
@njit
def _add_document(doc, corpus, start, depth, st_len, st_link, st_first, st_cnt, head,
                  e_tok, e_tgt, e_next, h_keys, h_edges, counts):
    """Insert ``doc`` from the root at corpus position ``start`` (then the
    separator); count each token's occurrence in its ``depth + 1`` longest
    suffixes. False when the arrays are full (cannot happen when sized for the
    segment's tokens)."""
    last = 0
    for i in range(doc.size):
        t = doc[i]
        corpus[start + i] = t
        last = _insert_token(last, start + i, t, st_len, st_link, st_first, st_cnt, head,
                             e_tok, e_tgt, e_next, h_keys, h_edges, counts)
        if last < 0:
            return False
        st_cnt[last] += 1
        v = st_link[last]
        for _ in range(depth):
            if v <= 0:
                break
            st_cnt[v] += 1
            v = st_link[v]
    corpus[start + doc.size] = SEPARATOR
    return True


@njit
def _advance(h_keys, h_edges, e_tgt, st_link, st_len, state, length, tokens):
    """The match (state, length) extended by each of ``tokens`` in turn: the
    longest suffix of (matched text + token) that occurs in a document."""
    for i in range(tokens.size):
        t = tokens[i]
        while True:
            e = _find_edge(h_keys, h_edges, state, t)
            if e >= 0:
                state = e_tgt[e]
                length += 1
                break
            if state == 0:
                length = 0
                break
            state = st_link[state]
            length = st_len[state]
    return state, length


@njit
def _best_child(s, stamp, head, e_tok, e_tgt, e_next, st_cnt, c_edge, c_total, c_stamp):
    """State s's most frequent transition (the smallest token on a tie) and the
    total count of its transitions, cached per state until the segment changes
    (``stamp``): a state with thousands of transitions is scanned once per
    document added, not once per draft (a short match in a large segment)."""
    if c_stamp[s] != stamp:
        best_e, best_c, total = -1, -1, 0
        e = head[s]
        while e != -1:
            c = st_cnt[e_tgt[e]]
            total += c
            if c > best_c or (c == best_c and e_tok[e] < e_tok[best_e]):
                best_e, best_c = e, c
            e = e_next[e]
        c_edge[s] = best_e
        c_total[s] = total
        c_stamp[s] = stamp
    return c_edge[s], c_total[s]


@njit
def _frequent(head, e_tok, e_tgt, e_next, st_cnt, st_link, st_len, c_edge, c_total, c_stamp,
              stamp, state, k, min_prob, min_match, out):
    """Walk from ``state`` taking the most frequent next token (the smallest id
    on a tie) while its share is at least ``min_prob``; a state with no
    continuation (all its occurrences end documents) continues its longest
    shorter suffix that has one, while that is at least ``min_match`` long.
    Writes up to k tokens to ``out``; returns how many."""
    n = 0
    s = state
    while n < k:
        while head[s] == -1:
            s = st_link[s]
            if s <= 0 or st_len[s] < min_match:
                return n
        e, total = _best_child(s, stamp, head, e_tok, e_tgt, e_next, st_cnt, c_edge, c_total,
                               c_stamp)
        best_c = st_cnt[e_tgt[e]]
        if total <= 0 or best_c < min_prob * total:
            return n
        out[n] = e_tok[e]
        n += 1
        s = e_tgt[e]
    return n


# --------------------------------------------------------------- segments
def _zeros(n: int, dtype) -> np.ndarray:
    """A zeroed array in its own anonymous memory map: pages cost memory only
    once touched and are never transparent huge pages (numpy asks for those
    on large arrays; the kernel's compaction for them stalled the first
    insertion into a new 1M-token store's segment by 70-90 ms here, against
    ~20 ms without)."""
    dtype = np.dtype(dtype)
    return np.frombuffer(mmap.mmap(-1, max(n, 1) * dtype.itemsize), dtype=dtype, count=n)


def _hash_capacity(max_edges: int) -> int:
    return 1 << max(4, int(np.ceil(np.log2(max_edges * 1.3 + 16))))


class _Segment:
    """One generalized suffix automaton with room for ``capacity`` tokens."""

    _ids = itertools.count()

    def __init__(self, capacity: int, count_depth: int) -> None:
        self.id = next(self._ids)
        self.capacity = int(capacity)
        self.count_depth = int(count_depth)
        self.num_tokens = 0      # document tokens held (separators not counted)
        self.num_documents = 0
        self.version = 0         # documents added so far (a match older than this is stale)
        self.corpus_len = 0      # used positions of ``corpus`` (separators included)
        max_states = 2 * self.capacity + 2
        max_edges = 3 * self.capacity + 4
        self.corpus = _zeros(2 * self.capacity + 1, np.int32)
        self.st_len = _zeros(max_states, np.int32)
        self.st_link = _zeros(max_states, np.int32)
        self.st_first = _zeros(max_states, np.int32)
        self.st_cnt = _zeros(max_states, np.int32)
        self.head = _zeros(max_states, np.int32)
        # per state: most frequent transition, total count, segment version + 1
        # they were computed at (0: not yet)
        self.c_edge = _zeros(max_states, np.int32)
        self.c_total = _zeros(max_states, np.int32)
        self.c_stamp = _zeros(max_states, np.int32)
        self.e_tok = _zeros(max_edges, np.int32)
        self.e_tgt = _zeros(max_edges, np.int32)
        self.e_next = _zeros(max_edges, np.int32)
        cap = _hash_capacity(max_edges)
        self.h_keys = _zeros(cap, np.int64)
        self.h_edges = _zeros(cap, np.int32)
        self.counts = np.zeros(2, dtype=np.int64)  # states, edges
        _new_state(0, -1, -1, self.st_len, self.st_link, self.st_first, self.head, self.counts)
        self.st_cnt[0] = 0

    def fits(self, n: int) -> bool:
        return self.num_tokens + n <= self.capacity

    def add(self, doc: np.ndarray) -> None:
        ok = _add_document(doc, self.corpus, self.corpus_len, self.count_depth, self.st_len,
                           self.st_link, self.st_first, self.st_cnt, self.head, self.e_tok,
                           self.e_tgt, self.e_next, self.h_keys, self.h_edges, self.counts)
        if not ok:
            raise RuntimeError("global store segment outgrew its arrays (a bug)")
        self.corpus_len += doc.size + 1
        self.num_tokens += doc.size
        self.num_documents += 1
        self.version += 1

    def advance(self, state: int, length: int, tokens: np.ndarray) -> tuple[int, int]:
        s, n = _advance(self.h_keys, self.h_edges, self.e_tgt, self.st_link, self.st_len,
                        state, length, tokens)
        return int(s), int(n)

    def first_continuation(self, state: int, k: int) -> list[int]:
        start = int(self.st_first[state]) + 1
        seg = self.corpus[start:min(start + k, self.corpus_len)]
        stop = np.flatnonzero(seg == SEPARATOR)
        return (seg[: stop[0]] if stop.size else seg).tolist()

    def frequent_continuation(self, state: int, k: int, min_prob: float,
                              min_match: int) -> list[int]:
        out = np.empty(k, dtype=np.int32)
        n = _frequent(self.head, self.e_tok, self.e_tgt, self.e_next, self.st_cnt,
                      self.st_link, self.st_len, self.c_edge, self.c_total, self.c_stamp,
                      self.version + 1, state, k, float(min_prob), min_match, out)
        return out[:n].tolist()

    def resident_nbytes(self) -> int:
        """Bytes of the arrays' used parts and of the whole hash table (whose
        pages are all touched once it holds a few thousand edges): about what
        the segment holds in memory."""
        states, edges = int(self.counts[0]), int(self.counts[1])
        return (4 * self.corpus_len + 8 * 4 * states + 3 * 4 * edges
                + self.h_keys.nbytes + self.h_edges.nbytes)

    def allocated_nbytes(self) -> int:
        """Bytes reserved (the worst case, mostly never touched)."""
        return sum(a.nbytes for a in (self.corpus, self.st_len, self.st_link, self.st_first,
                                      self.st_cnt, self.head, self.c_edge, self.c_total,
                                      self.c_stamp, self.e_tok, self.e_tgt, self.e_next,
                                      self.h_keys, self.h_edges))


# ------------------------------------------------------------------ store
class GlobalMatch:
    """One request's matches in the store: segment id -> [state, length,
    version], and the tokens committed since they were last brought up to date."""

    __slots__ = ("per_segment", "pending")

    def __init__(self) -> None:
        self.per_segment: dict[int, list[int]] = {}
        self.pending: list[int] = []


def tokens_for_bytes(max_bytes: int, num_segments: int = DEFAULT_SEGMENTS) -> int:
    """The largest ``max_tokens`` whose store reserves at most ``max_bytes``
    (``GlobalStore.max_nbytes``, which grows with ``max_tokens``); 0 when not
    even the smallest store fits."""
    lo, hi = 0, max(int(max_bytes), 0)   # a store takes more than a byte a token
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid >= num_segments and GlobalStore(mid, num_segments).max_nbytes() <= max_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


class GlobalStore:
    """Bounded, append-only-with-eviction store of documents (token id lists)."""

    def __init__(self, max_tokens: int, num_segments: int = DEFAULT_SEGMENTS,
                 count_depth: int = DEFAULT_COUNT_DEPTH, window: int = DEFAULT_WINDOW) -> None:
        if num_segments < 2:
            raise ValueError("a global store needs at least 2 segments")
        if max_tokens < num_segments:
            raise ValueError(f"max_tokens must be at least {num_segments}, got {max_tokens}")
        self.max_tokens = int(max_tokens)
        self.num_segments = int(num_segments)
        self.segment_tokens = self.max_tokens // self.num_segments
        self.count_depth = int(count_depth)
        self.window = int(window)
        self.segments: list[_Segment] = []   # oldest first
        self.documents_added = 0
        self.segments_dropped = 0

    # -------------------------------------------------------------- adding
    def add(self, tokens: Sequence[int]) -> None:
        """Append one document; drop the oldest segment when the ring is full."""
        doc = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if doc.size == 0:
            return
        if doc.min() < 0 or doc.max() > np.iinfo(np.int32).max:
            raise ValueError("token ids must be in [0, 2^31)")
        doc = doc[-self.segment_tokens:].astype(np.int32)
        if not self.segments or not self.segments[-1].fits(doc.size):
            self.segments.append(_Segment(self.segment_tokens, self.count_depth))
            if len(self.segments) > self.num_segments:
                self.segments.pop(0)
                self.segments_dropped += 1
        self.segments[-1].add(doc)
        self.documents_added += 1

    def drop_oldest_segment(self) -> int:
        """Drop the oldest segment whole (as the ring does when full; for a
        shared budget, ``tenants.TenantStores``); the tokens it held (0:
        the store is empty)."""
        if not self.segments:
            return 0
        self.segments_dropped += 1
        return self.segments.pop(0).num_tokens

    # --------------------------------------------------------------- sizes
    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.segments)

    @property
    def num_documents(self) -> int:
        return sum(s.num_documents for s in self.segments)

    def documents(self) -> list[list[int]]:
        """The documents held, oldest first (for tests and inspection)."""
        out = []
        for seg in self.segments:
            flat = seg.corpus[: seg.corpus_len]
            ends = np.flatnonzero(flat == SEPARATOR)
            start = 0
            for end in ends:
                out.append(flat[start:end].tolist())
                start = end + 1
        return out

    def resident_nbytes(self) -> int:
        return sum(s.resident_nbytes() for s in self.segments)

    def allocated_nbytes(self) -> int:
        return sum(s.allocated_nbytes() for s in self.segments)

    def max_nbytes(self) -> int:
        """The bytes the store can ever hold: a full ring of segments, each
        with its arrays reserved in full (``allocated_nbytes``); what it
        holds resident (``resident_nbytes``) stays below."""
        states, edges = 2 * self.segment_tokens + 2, 3 * self.segment_tokens + 4
        per_segment = (4 * (2 * self.segment_tokens + 1) + 8 * 4 * states + 3 * 4 * edges
                       + 12 * _hash_capacity(edges))
        return self.num_segments * per_segment

    # ------------------------------------------------------------ matching
    def advance(self, match: GlobalMatch, tokens: Sequence[int]) -> None:
        """Note a request's newly committed tokens; ``refresh`` applies them
        (lazily: a step that does not look at the store costs nothing here).
        Past ``window`` pending tokens the matches are dropped and ``refresh``
        recomputes them from the context's last ``window`` tokens."""
        match.pending.extend(tokens)
        if len(match.pending) > self.window:
            match.per_segment.clear()
            match.pending.clear()

    def refresh(self, match: GlobalMatch, context: Sequence[int]) -> None:
        """Bring a request's matches up to date with its ``context`` (all its
        tokens): extend them with the pending tokens in segments unchanged
        since; recompute from the last ``window`` context tokens in segments
        that are new or received documents; forget dropped segments."""
        live = {seg.id for seg in self.segments}
        for sid in [s for s in match.per_segment if s not in live]:
            del match.per_segment[sid]
        pending = np.asarray(match.pending, dtype=np.int64) if match.pending else None
        match.pending.clear()
        tail = None
        for seg in self.segments:
            entry = match.per_segment.get(seg.id)
            if entry is not None and entry[2] == seg.version:
                if pending is not None:
                    entry[0], entry[1] = seg.advance(entry[0], entry[1], pending)
                continue
            if tail is None:
                tail = np.asarray(context[-self.window:], dtype=np.int64).reshape(-1)
            s, n = seg.advance(0, 0, tail)
            match.per_segment[seg.id] = [s, n, seg.version]

    def best(self, match: GlobalMatch) -> tuple[int, int, int]:
        """(segment index, state, length) of the longest match, the newest
        segment on a tie; (-1, 0, 0) when there is none."""
        best = (-1, 0, 0)
        for i, seg in enumerate(self.segments):
            entry = match.per_segment.get(seg.id)
            if entry is not None and entry[2] == seg.version and entry[1] >= best[2] \
                    and entry[1] > 0:
                best = (i, entry[0], entry[1])
        return best

    def match(self, query: Sequence[int]) -> tuple[int, int, int]:
        """``best`` for a fresh match of ``query`` (its last ``window`` tokens)."""
        m = GlobalMatch()
        self.refresh(m, list(query))
        return self.best(m)

    def continuation(self, segment: int, state: int, k: int, mode: str = "frequent",
                     min_prob: float = 0.0, min_match: int = 1) -> list[int]:
        """Up to k draft tokens from a match in segment ``segment`` (see the
        module doc): ``mode`` "frequent" or "first"."""
        if segment < 0 or k <= 0:
            return []
        seg = self.segments[segment]
        if mode == "first":
            return seg.first_continuation(state, k)
        return seg.frequent_continuation(state, k, min_prob, min_match)
