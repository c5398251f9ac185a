"""An online suffix automaton over a token sequence, with a running match.

This is the data structure behind SAM-Decoding (arXiv 2411.10666). The
automaton is extended one token at a time (amortised O(1) per token). Before a
token is added, the running *match* is advanced with it: the match is the
longest suffix of the text so far that also occurred ending at an *earlier*
position. The continuation after that earlier occurrence is the draft.

Each state stores:
  length  -- the longest string the state represents,
  link    -- its suffix link,
  endpos  -- the end position of the state's *first* occurrence,
  next    -- its transitions (a dict token -> state, or None while empty).

No vLLM import: a plain algorithm, property-tested against brute force.
"""
from __future__ import annotations

from array import array
from typing import Iterable, Sequence


class SuffixAutomaton:
    """Dynamic suffix automaton with a longest-earlier-suffix match."""

    __slots__ = (
        "tokens",
        "_len",
        "_link",
        "_endpos",
        "_next",
        "_last",
        "match_state",
        "match_len",
        "link_steps",
        "_cnt",
        "count_depth",
    )

    def __init__(self, tokens: Iterable[int] = (), count_depth: int = 0) -> None:
        """``count_depth > 0`` also keeps occurrence counts (|endpos|) for
        ``frequent_continuation``: each new token increments the states on its
        suffix-link path, at most ``count_depth`` of them (longest strings
        first), which bounds the cost per token; shorter strings past that
        depth are undercounted."""
        self.tokens = array("i")
        self._len = array("i", [0])
        self._link = array("i", [-1])
        self._endpos = array("i", [-1])
        self._next: list[dict[int, int] | None] = [None]
        self._last = 0
        self.match_state = 0
        self.match_len = 0
        # Suffix-link steps taken by matching and construction; the amortised
        # bound (a small constant times the number of tokens) is tested.
        self.link_steps = 0
        self.count_depth = int(count_depth)
        self._cnt = array("i", [0]) if count_depth > 0 else None
        self.extend(tokens)

    # ------------------------------------------------------------------ size
    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_states(self) -> int:
        return len(self._len)

    def nbytes(self) -> int:
        """Approximate memory held (bytes): arrays plus transition dicts."""
        arrays = (len(self.tokens) + (4 if self._cnt is not None else 3) * len(self._len)) * 4
        dicts = sum(64 + 24 * len(d) for d in self._next if d is not None)
        return arrays + dicts + 8 * len(self._next)

    # ------------------------------------------------------------- building
    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(int(t))

    def append(self, t: int) -> None:
        nxt = self._next
        lens = self._len
        link = self._link
        # 1. Advance the match over the text *before* t (earlier occurrences).
        self.match_state, self.match_len = self.advance(self.match_state, self.match_len, t)

        # 2. Standard online construction.
        pos = len(self.tokens)
        self.tokens.append(t)
        cur = len(lens)
        lens.append(lens[self._last] + 1)
        link.append(0)
        self._endpos.append(pos)
        nxt.append(None)
        if self._cnt is not None:
            self._cnt.append(1)
        p = self._last
        while p != -1:
            d = nxt[p]
            if d is None:
                nxt[p] = {t: cur}
            elif t not in d:
                d[t] = cur
            else:
                break
            p = link[p]
            self.link_steps += 1
        if p != -1:
            q = nxt[p][t]
            if lens[p] + 1 == lens[q]:
                link[cur] = q
            else:
                clone = len(lens)
                lens.append(lens[p] + 1)
                link.append(link[q])
                self._endpos.append(self._endpos[q])
                dq = nxt[q]
                nxt.append(dict(dq) if dq is not None else None)
                if self._cnt is not None:
                    self._cnt.append(self._cnt[q])
                while p != -1:
                    d = nxt[p]
                    if d is None or d.get(t) != q:
                        break
                    d[t] = clone
                    p = link[p]
                    self.link_steps += 1
                link[q] = clone
                link[cur] = clone
        self._last = cur
        cnt = self._cnt
        if cnt is not None:
            v = link[cur]
            for _ in range(self.count_depth):
                if v <= 0:
                    break
                cnt[v] += 1
                v = link[v]

    # -------------------------------------------------------------- matching
    def advance(self, state: int, length: int, t: int) -> tuple[int, int]:
        """Extend a match (state, length) in this automaton's text by token t:
        the longest suffix of (matched text + t) that occurs in the text."""
        nxt, lens, link = self._next, self._len, self._link
        s, l = state, length
        while True:
            d = nxt[s]
            if d is not None and t in d:
                return d[t], l + 1
            if s == 0:
                return 0, 0
            s = link[s]
            l = lens[s]
            self.link_steps += 1

    def support(self, draft: Sequence[int]) -> list[int]:
        """Per token of ``draft`` (a continuation of this text): the length of
        the longest suffix of (text + draft up to that token) that occurs in
        the text. 0: the token never occurs in it; 1: it occurs, but not
        after the token before it; n: the last n tokens occur together.
        How much of a draft copied from elsewhere (another request's
        output) this request's own text supports."""
        steps = self.link_steps           # a query: the construction counter stays
        s, l = self._last, len(self.tokens)
        out = []
        for t in draft:
            s, l = self.advance(s, l, t)
            out.append(l)
        self.link_steps = steps
        return out

    # -------------------------------------------------------------- queries
    def match_end(self) -> int:
        """End position of the first earlier occurrence of the match (-1: none)."""
        return self._endpos[self.match_state] if self.match_len > 0 else -1

    def continuation(self, max_tokens: int, min_match: int = 1,
                     match: tuple[int, int] | None = None) -> tuple[int, list[int]]:
        """(match length used, tokens following an earlier occurrence of the match).

        If the first occurrence of the longest match has fewer than
        ``max_tokens`` tokens after it, walk to shorter matches (suffix-link
        ancestors, whose first occurrence is no later) while they stay at least
        ``min_match`` long, as SAM-Decoding's ``to_anc`` does. ``match`` is
        another (state, length) to continue instead of the running match.
        """
        s, l = (self.match_state, self.match_len) if match is None else match
        if l < min_match or max_tokens <= 0:
            return l, []
        n = len(self.tokens)
        start = self._endpos[s] + 1
        while n - start < max_tokens:
            p = self._link[s]
            if p <= 0 or self._len[p] < min_match:
                break
            s = p
            l = self._len[p]
            start = self._endpos[s] + 1
        return l, self.tokens[start : start + max_tokens].tolist()

    def frequent_continuation(self, max_tokens: int, min_prob: float, min_match: int = 1,
                              match: tuple[int, int] | None = None
                              ) -> tuple[list[int], list[float]]:
        """Walk from the match, each step taking the most frequent next token
        among earlier occurrences while its share is at least ``min_prob``.

        Returns the tokens and, for each, the product of the shares so far
        (an estimate of the chance that the draft is right up to there).
        Needs ``count_depth > 0``.
        """
        if self._cnt is None:
            raise ValueError("frequent_continuation needs count_depth > 0")
        s, l = (self.match_state, self.match_len) if match is None else match
        if l < min_match or max_tokens <= 0:
            return [], []
        cnt, nxt = self._cnt, self._next
        tokens: list[int] = []
        probs: list[float] = []
        p = 1.0
        while len(tokens) < max_tokens:
            d = nxt[s]
            while not d:
                # No earlier continuation of the whole matched text (e.g. one
                # period of a repetition): continue a shorter suffix of it.
                s = self._link[s]
                if s <= 0 or self._len[s] < min_match:
                    return tokens, probs
                d = nxt[s]
            best_t, best_s, best_c, total = -1, -1, -1, 0
            for t, v in d.items():
                c = cnt[v]
                total += c
                if c > best_c:
                    best_t, best_s, best_c = t, v, c
            share = best_c / total if total > 0 else 0.0
            if share < min_prob:
                break
            p *= share
            tokens.append(best_t)
            probs.append(p)
            s = best_s
        return tokens, probs
