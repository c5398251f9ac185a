"""A static suffix automaton over a token corpus, memory-mapped from one file.

This is SAM-Decoding's *static* automaton (arXiv 2411.10666): built once,
offline, over many documents (``specplug build-sam``), then shared read-only
by every request and every process that maps the file. Each request keeps
only its own match, a ``(state, length)`` pair.

The automaton is a *generalized* suffix automaton: each document is inserted
from the root, so it accepts exactly the substrings of single documents and a
match never spans two documents. In the stored corpus every document is
followed by the EOS id, where continuations stop.

File format (version 1), all little-endian::

    bytes 0..7    MAGIC
    bytes 8..15   header length H (uint64)
    bytes 16..    header: H bytes of UTF-8 JSON
    then          the arrays, each at an offset that is a multiple of 64

The header holds ``format_version``, ``tokenizer`` (``name`` and
``vocab_sha256``: see ``tokenizer_identity``), ``eos_id``, ``num_documents``,
``num_tokens``, ``num_states``, ``num_edges`` and ``arrays`` (name ->
``[offset, count]``). The arrays (dtypes fixed by ``ARRAY_DTYPES``):

    corpus        int32 [num_tokens]   documents, each followed by eos_id
    state_len     int32 [num_states]   longest string of each state
    suffix_link   int32 [num_states]   -1 for the root (state 0)
    first_end     int32 [num_states]   corpus position where the state's strings
                                       first end (-1 for the root)
    edge_offsets  int64 [num_states+1] state s's transitions are edges
                                       edge_offsets[s] .. edge_offsets[s+1]-1
    edge_tokens   int32 [num_edges]    sorted within each state
    edge_targets  int32 [num_edges]

Build cost (numba, one core of this repository's 2-core development machine,
measured; CPU seconds and peak resident memory added by the build):

    3.3M SmolLM2 tokens of English docs and Python source: 0.9-1.2 s and 115 MB
        per million tokens; 1.50 states and 1.97 transitions per token;
        file 50 MB per million tokens
    8M synthetic Zipf(1.2) tokens: 1.2 s and 95 MB per million tokens

so a 100 MB text corpus (~26-29M SmolLM2 tokens at ~0.27 tokens a character)
should build in about a minute (extrapolated) with ~3.5 GB peak (the hash table, 12 bytes a
slot rounded up to a power of two, is half of it) and a ~1.4 GB file;
tokenizing it first (``specplug build-sam``) costs ~1.3 s of CPU per MB of
text, ~2 minutes. Loading maps the file and checks every array once (~0.06 s
per million tokens). A match step is a binary search in a state's sorted
transitions (~0.05 us a token in ``advance_many``, ~2-4 us per Python call).

No vLLM import.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..jit import njit

MAGIC = b"SPECSAM\x00"
FORMAT_VERSION = 1
ALIGN = 64
MAX_HEADER_BYTES = 1 << 20
ARRAY_DTYPES = {
    "corpus": np.dtype("<i4"),
    "state_len": np.dtype("<i4"),
    "suffix_link": np.dtype("<i4"),
    "first_end": np.dtype("<i4"),
    "edge_offsets": np.dtype("<i8"),
    "edge_tokens": np.dtype("<i4"),
    "edge_targets": np.dtype("<i4"),
}
# Corpus tokens inserted per numba call (between progress-bar updates).
BUILD_CHUNK_TOKENS = 1 << 20


# ---------------------------------------------------------------- identity
def tokenizer_identity(tokenizer) -> dict:
    """``{"name", "vocab_sha256"}`` of a Hugging Face tokenizer: its folder or
    hub name and the SHA-256 of its vocabulary (token -> id, sorted, as JSON).
    Only the hash is compared; the name is for messages."""
    vocab = sorted(tokenizer.get_vocab().items())
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()
    name = os.path.basename(os.path.normpath(str(tokenizer.name_or_path))) or "?"
    return {"name": name, "vocab_sha256": digest}


@lru_cache(maxsize=4)
def load_tokenizer_identity(tokenizer_path: str) -> dict:
    """``tokenizer_identity`` of the tokenizer at a model folder (or hub name)."""
    from transformers import AutoTokenizer

    return tokenizer_identity(AutoTokenizer.from_pretrained(tokenizer_path))


# ---------------------------------------------------------------- building
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SHIFT = np.uint64(32)


@njit
def _edge_key(state, token):
    """Never 0: 0 marks an empty hash slot (tables from ``np.zeros`` cost no
    memory or time until touched)."""
    return ((np.int64(state) << 32) | np.int64(token)) + 1


@njit
def _slot(key, mask):
    return np.int64((np.uint64(key) * _GOLDEN) >> _SHIFT) & mask


@njit
def _find_edge(h_keys, h_edges, state, token):
    """Index of state's edge on token, or -1 (open addressing, linear probing)."""
    key = _edge_key(state, token)
    mask = h_keys.size - 1
    i = _slot(key, mask)
    while True:
        k = h_keys[i]
        if k == key:
            return h_edges[i]
        if k == 0:
            return -1
        i = (i + 1) & mask


@njit
def _add_edge(state, token, target, head, e_tok, e_tgt, e_next, h_keys, h_edges, counts):
    """Append an edge to state's list and the hash table; False when full."""
    e = counts[1]
    if e >= e_tok.size:
        return False
    e_tok[e] = token
    e_tgt[e] = target
    e_next[e] = head[state]
    head[state] = e
    key = _edge_key(state, token)
    mask = h_keys.size - 1
    i = _slot(key, mask)
    while h_keys[i] != 0:
        i = (i + 1) & mask
    h_keys[i] = key
    h_edges[i] = e
    counts[1] = e + 1
    return True


@njit
def _new_state(length, link, first, st_len, st_link, st_first, head, counts):
    s = counts[0]
    if s >= st_len.size:
        return -1
    st_len[s] = length
    st_link[s] = link
    st_first[s] = first
    head[s] = -1
    counts[0] = s + 1
    return s


@njit
def _split(p, q, token, st_len, st_link, st_first, st_cnt, head, e_tok, e_tgt, e_next,
           h_keys, h_edges, counts):
    """Clone q as a state of length len(p)+1 (q's first occurrence, q's edges,
    q's occurrence count when ``st_cnt`` is kept, i.e. not empty), redirect p
    and its suffix-link ancestors from q to the clone; -1 when full."""
    clone = _new_state(st_len[p] + 1, st_link[q], st_first[q], st_len, st_link, st_first,
                       head, counts)
    if clone < 0:
        return -1
    if st_cnt.size:
        st_cnt[clone] = st_cnt[q]
    e = head[q]
    while e != -1:
        if not _add_edge(clone, e_tok[e], e_tgt[e], head, e_tok, e_tgt, e_next,
                         h_keys, h_edges, counts):
            return -1
        e = e_next[e]
    while p != -1:
        e = _find_edge(h_keys, h_edges, p, token)
        if e < 0 or e_tgt[e] != q:
            break
        e_tgt[e] = clone
        p = st_link[p]
    st_link[q] = clone
    return clone


@njit
def _insert_token(last, pos, t, st_len, st_link, st_first, st_cnt, head, e_tok, e_tgt, e_next,
                  h_keys, h_edges, counts):
    """Extend the document ending in state ``last`` by token t (at corpus
    position pos); the new last state, or -1 when the arrays are full.
    ``st_cnt`` (empty: not kept) gets 0 for a new state and q's count for a
    clone of q; the caller counts the new occurrence."""
    e = _find_edge(h_keys, h_edges, last, t)
    if e >= 0:
        # The extended string already occurs (in an earlier document).
        q = e_tgt[e]
        if st_len[last] + 1 == st_len[q]:
            return q
        return _split(last, q, t, st_len, st_link, st_first, st_cnt, head, e_tok, e_tgt,
                      e_next, h_keys, h_edges, counts)
    cur = _new_state(st_len[last] + 1, 0, pos, st_len, st_link, st_first, head, counts)
    if cur < 0:
        return -1
    if st_cnt.size:
        st_cnt[cur] = 0
    p = last
    while p != -1:
        e = _find_edge(h_keys, h_edges, p, t)
        if e >= 0:
            break
        if not _add_edge(p, t, cur, head, e_tok, e_tgt, e_next, h_keys, h_edges, counts):
            return -1
        p = st_link[p]
    if p != -1:
        q = e_tgt[e]
        if st_len[p] + 1 == st_len[q]:
            st_link[cur] = q
        else:
            clone = _split(p, q, t, st_len, st_link, st_first, st_cnt, head, e_tok, e_tgt,
                           e_next, h_keys, h_edges, counts)
            if clone < 0:
                return -1
            st_link[cur] = clone
    return cur


@njit
def _insert_tokens(corpus, doc_bounds, cursor, max_tokens, st_len, st_link, st_first, head,
                   e_tok, e_tgt, e_next, h_keys, h_edges, counts):
    """Insert up to max_tokens more corpus tokens, each document from the root
    (document d is corpus[doc_bounds[d]:doc_bounds[d+1]-1], then its EOS).
    ``cursor`` = (document, position, last state), updated. False when full."""
    num_docs = doc_bounds.size - 1
    d, pos, last = cursor[0], cursor[1], cursor[2]
    done = 0
    no_counts = np.zeros(0, dtype=np.int32)  # the static automaton keeps no counts
    while d < num_docs and done < max_tokens:
        if pos >= doc_bounds[d + 1] - 1:   # the document's EOS: the next one
            d += 1
            pos = doc_bounds[d]
            last = 0
            continue
        last = _insert_token(last, pos, corpus[pos], st_len, st_link, st_first,
                             no_counts, head, e_tok, e_tgt, e_next, h_keys, h_edges,
                             counts)
        if last < 0:
            return False
        pos += 1
        done += 1
    cursor[0], cursor[1], cursor[2] = d, pos, last
    return True


@njit
def _to_csr(num_states, head, e_tok, e_tgt, e_next, offsets, out_tok, out_tgt):
    """Edge lists -> CSR with tokens sorted within each state."""
    pos = 0
    for s in range(num_states):
        offsets[s] = pos
        start = pos
        e = head[s]
        while e != -1:
            out_tok[pos] = e_tok[e]
            out_tgt[pos] = e_tgt[e]
            pos += 1
            e = e_next[e]
        n = pos - start
        if n > 32:
            order = np.argsort(out_tok[start:pos])
            toks = out_tok[start:pos][order]
            tgts = out_tgt[start:pos][order]
            out_tok[start:pos] = toks
            out_tgt[start:pos] = tgts
        else:
            for i in range(start + 1, pos):  # insertion sort
                tk, tg = out_tok[i], out_tgt[i]
                j = i - 1
                while j >= start and out_tok[j] > tk:
                    out_tok[j + 1] = out_tok[j]
                    out_tgt[j + 1] = out_tgt[j]
                    j -= 1
                out_tok[j + 1] = tk
                out_tgt[j + 1] = tg
    offsets[num_states] = pos


def _collect(documents: Iterable[Sequence[int]], eos_id: int, progress: bool
             ) -> tuple[np.ndarray, np.ndarray]:
    """(corpus with an EOS after each document, document start offsets + end)."""
    from tqdm import tqdm

    chunks: list[np.ndarray] = []
    bounds = [0]
    bar = tqdm(desc="corpus tokens", unit="tok", unit_scale=True, disable=not progress)
    eos = np.array([eos_id], dtype=np.int32)
    for doc in documents:
        arr = np.asarray(doc, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
            raise ValueError("token ids must be in [0, 2^31)")
        chunks.append(arr.astype(np.int32))
        chunks.append(eos)
        bounds.append(bounds[-1] + arr.size + 1)
        bar.update(arr.size)
    bar.close()
    corpus = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
    if corpus.size >= np.iinfo(np.int32).max // 2:
        raise ValueError(f"corpus of {corpus.size} tokens is too large (at most 2^30)")
    return corpus, np.asarray(bounds, dtype=np.int64)


def _build_arrays(corpus: np.ndarray, doc_bounds: np.ndarray, progress: bool
                  ) -> dict[str, np.ndarray]:
    from tqdm import tqdm

    n = int(corpus.size)
    max_states = 2 * n + 2
    max_edges = 3 * n + 4
    capacity = 1 << max(4, int(np.ceil(np.log2(max_edges * 1.3 + 16))))
    st_len = np.empty(max_states, dtype=np.int32)
    st_link = np.empty(max_states, dtype=np.int32)
    st_first = np.empty(max_states, dtype=np.int32)
    head = np.empty(max_states, dtype=np.int32)
    e_tok = np.empty(max_edges, dtype=np.int32)
    e_tgt = np.empty(max_edges, dtype=np.int32)
    e_next = np.empty(max_edges, dtype=np.int32)
    h_keys = np.zeros(capacity, dtype=np.int64)
    h_edges = np.empty(capacity, dtype=np.int32)
    counts = np.zeros(2, dtype=np.int64)
    _new_state(0, -1, -1, st_len, st_link, st_first, head, counts)  # the root

    bar = tqdm(desc="building automaton", total=n, unit="tok", unit_scale=True,
               disable=not progress)
    cursor = np.zeros(3, dtype=np.int64)  # document, position, last state
    while cursor[0] < doc_bounds.size - 1:
        before = int(cursor[1])
        if not _insert_tokens(corpus, doc_bounds, cursor, BUILD_CHUNK_TOKENS, st_len,
                              st_link, st_first, head, e_tok, e_tgt, e_next, h_keys,
                              h_edges, counts):
            raise RuntimeError("suffix automaton outgrew its preallocated arrays (a bug)")
        bar.update(int(cursor[1]) - before)
    bar.close()
    del h_keys, h_edges
    num_states, num_edges = int(counts[0]), int(counts[1])
    offsets = np.empty(num_states + 1, dtype=np.int64)
    edge_tokens = np.empty(num_edges, dtype=np.int32)
    edge_targets = np.empty(num_edges, dtype=np.int32)
    _to_csr(num_states, head, e_tok, e_tgt, e_next, offsets, edge_tokens, edge_targets)
    return {
        "corpus": corpus,
        "state_len": st_len[:num_states],
        "suffix_link": st_link[:num_states],
        "first_end": st_first[:num_states],
        "edge_offsets": offsets,
        "edge_tokens": edge_tokens,
        "edge_targets": edge_targets,
    }


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def write_automaton_file(out_path: str | os.PathLike, arrays: dict[str, np.ndarray],
                         header: dict) -> None:
    """Write the header and arrays (atomically: a temporary file, then rename)."""
    layout: dict[str, list[int]] = {}
    # The header's size depends on the offsets it lists: reserve generously.
    offset = _align(16 + len(json.dumps(header)) + 100 * len(ARRAY_DTYPES) + 256)
    for name, dtype in ARRAY_DTYPES.items():
        layout[name] = [offset, int(arrays[name].size)]
        offset = _align(offset + arrays[name].size * dtype.itemsize)
    header = {**header, "arrays": layout}
    blob = json.dumps(header).encode("utf-8")
    data_start = layout["corpus"][0]
    if 16 + len(blob) > data_start:
        raise AssertionError("header outgrew its reserved space")
    out_path = Path(out_path)
    tmp = out_path.with_name(out_path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        f.write(np.uint64(len(blob)).astype("<u8").tobytes())
        f.write(blob)
        for name, dtype in ARRAY_DTYPES.items():
            f.write(b"\0" * (layout[name][0] - f.tell()))
            np.ascontiguousarray(arrays[name], dtype=dtype).tofile(f)
        f.write(b"\0" * (offset - f.tell()))
    os.replace(tmp, out_path)


def build_corpus_automaton(documents: Iterable[Sequence[int]], eos_id: int,
                           tokenizer_identity: dict, out_path: str | os.PathLike,
                           progress: bool = True) -> dict:
    """Build the static automaton of ``documents`` (token id sequences) and save
    it to ``out_path``. Returns the file's header."""
    eos_id = int(eos_id)
    if not 0 <= eos_id <= np.iinfo(np.int32).max:
        raise ValueError(f"eos_id must be a token id, got {eos_id}")
    corpus, doc_bounds = _collect(documents, eos_id, progress)
    arrays = _build_arrays(corpus, doc_bounds, progress)
    header = {
        "format_version": FORMAT_VERSION,
        "tokenizer": {"name": str(tokenizer_identity["name"]),
                      "vocab_sha256": str(tokenizer_identity["vocab_sha256"])},
        "eos_id": eos_id,
        "num_documents": int(doc_bounds.size - 1),
        "num_tokens": int(corpus.size),
        "num_states": int(arrays["state_len"].size),
        "num_edges": int(arrays["edge_tokens"].size),
    }
    write_automaton_file(out_path, arrays, header)
    return header


# ----------------------------------------------------------------- loading
@njit
def _first_bad_value(num_tokens, corpus, eos_id, st_len, st_link, st_first, offsets,
                     e_tok, e_tgt):
    """0 if the arrays are consistent enough that lookups stay in bounds and
    terminate; else the number of the first failed check (see _VALUE_CHECKS)."""
    ns = st_len.size
    if st_len[0] != 0 or st_link[0] != -1 or st_first[0] != -1:
        return 1
    if num_tokens > 0 and corpus[num_tokens - 1] != eos_id:
        return 2
    for i in range(num_tokens):
        if corpus[i] < 0:
            return 3
    for s in range(1, ns):
        p = st_link[s]
        if p < 0 or p >= ns or st_len[p] >= st_len[s]:
            return 4
        f = st_first[s]
        if f < 0 or f >= num_tokens or st_len[s] > f + 1:
            return 5
    if offsets[0] != 0 or offsets[ns] != e_tok.size:
        return 6
    for s in range(ns):
        lo, hi = offsets[s], offsets[s + 1]
        if hi < lo or hi > e_tok.size:
            return 6
        for i in range(lo, hi):
            t = e_tgt[i]
            if t <= 0 or t >= ns or st_len[t] <= st_len[s]:
                return 7
            if i > lo and e_tok[i] <= e_tok[i - 1]:
                return 8
    return 0


_VALUE_CHECKS = {
    1: "the root state (0) is malformed",
    2: "the corpus does not end with the EOS id",
    3: "the corpus holds negative token ids",
    4: "a suffix link is out of range or does not shorten",
    5: "a state's first occurrence is out of range",
    6: "the transition offsets are out of range or decreasing",
    7: "a transition target is out of range or does not lengthen",
    8: "transition tokens are not sorted within a state",
}


@njit
def _advance(offsets, e_tok, e_tgt, st_link, st_len, state, length, token):
    while True:
        lo, end = offsets[state], offsets[state + 1]
        hi = end
        while lo < hi:
            mid = (lo + hi) >> 1
            if e_tok[mid] < token:
                lo = mid + 1
            else:
                hi = mid
        if lo < end and e_tok[lo] == token:
            return e_tgt[lo], length + 1
        if state == 0:
            return 0, 0
        state = st_link[state]
        length = st_len[state]


@njit
def _advance_many(offsets, e_tok, e_tgt, st_link, st_len, state, length, tokens):
    for i in range(tokens.size):
        state, length = _advance(offsets, e_tok, e_tgt, st_link, st_len, state, length,
                                 tokens[i])
    return state, length


@dataclass(frozen=True, eq=False)
class CorpusAutomaton:
    """A read-only static suffix automaton mapped from a file (``load``)."""

    path: str
    header: dict
    corpus: np.ndarray
    state_len: np.ndarray
    suffix_link: np.ndarray
    first_end: np.ndarray
    edge_offsets: np.ndarray
    edge_tokens: np.ndarray
    edge_targets: np.ndarray

    @property
    def eos_id(self) -> int:
        return int(self.header["eos_id"])

    @property
    def tokenizer(self) -> dict:
        return dict(self.header["tokenizer"])

    @property
    def num_states(self) -> int:
        return int(self.state_len.size)

    @classmethod
    def load(cls, path: str | os.PathLike, check_values: bool = True) -> "CorpusAutomaton":
        """Map ``path``; a missing, truncated, corrupt or foreign file raises
        ``ValueError`` naming it. ``check_values`` also reads every array once
        to check that lookups stay in bounds."""
        path = str(path)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 16:
                    raise ValueError(f"truncated: {size} bytes, too short for a header")
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise ValueError(f"corpus automaton {path!r}: no such file") from None
        except (OSError, ValueError) as e:
            raise ValueError(f"corpus automaton {path!r}: cannot be read: {e}") from None
        try:
            header = _read_header(buf, size)
            arrays = {name: np.frombuffer(buf, dtype=dtype, count=header["arrays"][name][1],
                                          offset=header["arrays"][name][0])
                      for name, dtype in ARRAY_DTYPES.items()}
            if check_values:
                bad = _first_bad_value(header["num_tokens"], arrays["corpus"],
                                       header["eos_id"], arrays["state_len"],
                                       arrays["suffix_link"], arrays["first_end"],
                                       arrays["edge_offsets"], arrays["edge_tokens"],
                                       arrays["edge_targets"])
                if bad:
                    raise ValueError(f"corrupt: {_VALUE_CHECKS[bad]}")
        except ValueError as e:
            raise ValueError(f"corpus automaton {path!r}: {e}; rebuild it with "
                             f"`specplug build-sam`") from None
        return cls(path, header, **arrays)

    # ----------------------------------------------------------- matching
    def advance(self, state: int, length: int, token: int) -> tuple[int, int]:
        """The match (state, length) extended by ``token``: the longest suffix of
        (matched text + token) that occurs in some document."""
        s, n = _advance(self.edge_offsets, self.edge_tokens, self.edge_targets,
                        self.suffix_link, self.state_len, int(state), int(length), int(token))
        return int(s), int(n)

    def advance_many(self, state: int, length: int, tokens: Sequence[int]) -> tuple[int, int]:
        """``advance`` over several tokens in order."""
        arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if arr.size == 0:
            return int(state), int(length)
        s, n = _advance_many(self.edge_offsets, self.edge_tokens, self.edge_targets,
                             self.suffix_link, self.state_len, int(state), int(length), arr)
        return int(s), int(n)

    def continuation(self, state: int, length: int, k: int) -> np.ndarray:
        """Up to k corpus tokens after the match's first occurrence, stopping
        before the EOS that ends its document (int32; empty for no match)."""
        if length <= 0 or k <= 0:
            return np.zeros(0, dtype=np.int32)
        start = int(self.first_end[state]) + 1
        seg = self.corpus[start:start + k]
        stop = np.flatnonzero(seg == self.eos_id)
        return np.array(seg[: stop[0]] if stop.size else seg, dtype=np.int32)

    def same_tokenizer(self, identity: dict) -> bool:
        return self.header["tokenizer"]["vocab_sha256"] == identity.get("vocab_sha256")


def _read_header(buf, size: int) -> dict:
    if buf[:8] != MAGIC:
        raise ValueError(f"not a corpus automaton file (magic {bytes(buf[:8])!r}, expected "
                         f"{MAGIC!r})")
    hlen = int(np.frombuffer(buf, dtype="<u8", count=1, offset=8)[0])
    if hlen > MAX_HEADER_BYTES or 16 + hlen > size:
        raise ValueError(f"truncated or corrupt header (length {hlen}, file {size} bytes)")
    try:
        header = json.loads(bytes(buf[16:16 + hlen]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"corrupt header: {e}") from None
    if not isinstance(header, dict):
        raise ValueError("corrupt header: not a JSON object")
    version = header.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"format version {version!r}; this vllm_specplug reads version "
                         f"{FORMAT_VERSION}")
    ints = ("eos_id", "num_documents", "num_tokens", "num_states", "num_edges")
    if any(not isinstance(header.get(k), int) or header[k] < 0 for k in ints):
        raise ValueError(f"corrupt header: {', '.join(ints)} must be non-negative integers")
    tok = header.get("tokenizer")
    if not (isinstance(tok, dict) and isinstance(tok.get("name"), str)
            and isinstance(tok.get("vocab_sha256"), str)):
        raise ValueError("corrupt header: no tokenizer identity")
    if header["num_states"] < 1:
        raise ValueError("corrupt header: no root state")
    counts = {"corpus": header["num_tokens"], "state_len": header["num_states"],
              "suffix_link": header["num_states"], "first_end": header["num_states"],
              "edge_offsets": header["num_states"] + 1, "edge_tokens": header["num_edges"],
              "edge_targets": header["num_edges"]}
    layout = header.get("arrays")
    if not isinstance(layout, dict):
        raise ValueError("corrupt header: no array table")
    file_end = 0
    for name, dtype in ARRAY_DTYPES.items():
        entry = layout.get(name)
        if (not isinstance(entry, list) or len(entry) != 2
                or not all(isinstance(v, int) for v in entry)):
            raise ValueError(f"corrupt header: no valid entry for array {name!r}")
        offset, count = entry
        if count != counts[name]:
            raise ValueError(f"corrupt header: array {name!r} has {count} entries, "
                             f"expected {counts[name]}")
        if offset < 16 + hlen or offset % dtype.itemsize:
            raise ValueError(f"corrupt header: array {name!r} at bad offset {offset}")
        end = offset + count * dtype.itemsize
        if end > size:
            raise ValueError(f"truncated: array {name!r} ends at byte {end} but the file has "
                             f"{size} bytes")
        file_end = max(file_end, _align(end))
    if size != file_end:
        raise ValueError(f"{'truncated' if size < file_end else 'corrupt'}: the file has "
                         f"{size} bytes, its header describes {file_end}")
    return header


@lru_cache(maxsize=16)
def _load_shared(path: str, mtime_ns: int, size: int) -> CorpusAutomaton:
    return CorpusAutomaton.load(path)


def open_corpus_automaton(path: str | os.PathLike) -> CorpusAutomaton:
    """``CorpusAutomaton.load``, mapped once per process and file version."""
    real = os.path.realpath(str(path))
    try:
        st = os.stat(real)
    except OSError:
        raise ValueError(f"corpus automaton {str(path)!r}: no such file (make one with "
                         f"`specplug build-sam --model MODEL CORPUS... -o FILE`)") from None
    return _load_shared(real, st.st_mtime_ns, st.st_size)
