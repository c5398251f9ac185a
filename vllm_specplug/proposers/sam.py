"""SAM: suffix-automaton drafting over prompt + committed output (SAM-Decoding).

Each request owns a dynamic suffix automaton, extended only with committed
tokens. The running match is the longest suffix of the context that occurred
earlier; the draft continues from there. Two ways to continue:

* ``"frequent"`` (default): walk the automaton taking, at each step, the token
  that most often followed (occurrence counts), while its share is at least
  ``sam_min_token_prob``;
* ``"first"`` (SAM-Decoding): copy what followed the match's first occurrence,
  at most ``ceil(sam_spec_factor * match_len)`` tokens.

Draft length follows match length: no draft below ``sam_min_match_len``, and
an online estimate of how often a draft from a match of this length was
accepted up to each position (shared by all requests) cuts the draft where
that chance falls below ``sam_min_accept_prob``, so weak matches draft little
and long matches draft up to ``num_speculative_tokens``.
"""
from __future__ import annotations

import math
from typing import ClassVar, Sequence

import numpy as np

from ..options import Option
from .base import Draft, Proposer, TargetTopK
from .suffix_automaton import SuffixAutomaton

# Occurrence counts are kept for the 32 longest suffixes of each new token.
COUNT_DEPTH = 32
# Match lengths 1..MAX_BUCKET-1 have their own acceptance statistics; longer
# matches share the last bucket.
MAX_BUCKET = 16
# Every EXPLORE_EVERY-th draft of a bucket goes one token past the cut, so
# an estimate that fell below the threshold can recover.
EXPLORE_EVERY = 16
# Acceptance counts are halved when a bucket has seen this many drafts, so the
# estimate follows the workload.
STATS_HORIZON = 4096


class AcceptanceByMatchLength:
    """How often a draft from a match of length l was accepted through
    position i, estimated online with a Beta(1, 1) prior."""

    def __init__(self, k: int) -> None:
        self.tried = np.zeros((MAX_BUCKET + 1, k), dtype=np.float64)
        self.accepted = np.zeros((MAX_BUCKET + 1, k), dtype=np.float64)
        self.proposals = np.zeros(MAX_BUCKET + 1, dtype=np.int64)

    @staticmethod
    def bucket(match_len: int) -> int:
        return min(match_len, MAX_BUCKET)

    def prob(self, match_len: int) -> np.ndarray:
        b = self.bucket(match_len)
        return (self.accepted[b] + 1.0) / (self.tried[b] + 2.0)

    def cut(self, match_len: int, n: int, min_prob: float) -> int:
        """Draft length: positions before the first whose estimate < min_prob
        (one more on every EXPLORE_EVERY-th proposal of the bucket)."""
        b = self.bucket(match_len)
        self.proposals[b] += 1
        below = np.flatnonzero(self.prob(match_len)[:n] < min_prob)
        keep = n if below.size == 0 else int(below[0])
        if keep < n and self.proposals[b] % EXPLORE_EVERY == 0:
            keep += 1
        return keep

    def update(self, match_len: int, drafted: int, accepted: int) -> None:
        b = self.bucket(match_len)
        self.tried[b, :drafted] += 1
        self.accepted[b, :accepted] += 1
        if self.tried[b, 0] >= STATS_HORIZON:
            self.tried[b] *= 0.5
            self.accepted[b] *= 0.5


class SamProposer(Proposer):
    name: ClassVar[str] = "sam"
    options: ClassVar[tuple[Option, ...]] = (
        Option("sam_continuation", str, "frequent",
               "how a match is continued: the most frequent next tokens, or the "
               "tokens after its first occurrence (SAM-Decoding)",
               choices=("frequent", "first")),
        Option("sam_min_match_len", int, 1,
               "no draft when the longest earlier match is shorter than this",
               minimum=1, maximum=1024),
        Option("sam_min_accept_prob", float, 0.1,
               "cut the draft where the learned chance that it is still accepted falls "
               "below this (0: never cut)", minimum=0.0, maximum=1.0),
        Option("sam_min_token_prob", float, 0.0,
               "'frequent': stop at a token that followed less often than this share",
               minimum=0.0, maximum=1.0),
        Option("sam_spec_factor", float, 4.0,
               "'first': draft at most ceil(factor * match length) tokens",
               minimum=0.01, maximum=1024.0),
    )

    def __init__(self, num_speculative_tokens: int, sam_continuation: str = "frequent",
                 sam_min_match_len: int = 1, sam_min_accept_prob: float = 0.1,
                 sam_min_token_prob: float = 0.0, sam_spec_factor: float = 4.0) -> None:
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.continuation = sam_continuation
        self.min_match_len = int(sam_min_match_len)
        self.min_accept_prob = float(sam_min_accept_prob)
        self.min_token_prob = float(sam_min_token_prob)
        self.spec_factor = float(sam_spec_factor)
        self._count_depth = COUNT_DEPTH if sam_continuation == "frequent" else 0
        self._automata: dict[str, SuffixAutomaton] = {}
        # req_id -> (match length, draft tokens) of the last draft proposed
        self._pending: dict[str, tuple[int, list[int]]] = {}
        self.acceptance = AcceptanceByMatchLength(self.num_speculative_tokens)

    def start(self, req_id: str, token_ids: Sequence[int]) -> None:
        self._pending.pop(req_id, None)
        self._automata[req_id] = SuffixAutomaton(token_ids, count_depth=self._count_depth)

    def observe(self, req_id: str, committed_ids: Sequence[int],
                target_topk: TargetTopK | None = None) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is not None:
            match_len, draft = pending
            a = 0
            while a < len(draft) and a < len(committed_ids) - 1 and draft[a] == committed_ids[a]:
                a += 1
            self.acceptance.update(match_len, len(draft), a)
        self._automata[req_id].extend(committed_ids)

    def propose(self, req_id: str, budget: int) -> Draft:
        sa = self._automata[req_id]
        length = sa.match_len
        budget = min(budget, self.num_speculative_tokens)
        if length < self.min_match_len or budget <= 0:
            return Draft.empty()
        if self.continuation == "frequent":
            tokens, _ = sa.frequent_continuation(budget, self.min_token_prob,
                                                 self.min_match_len)
        else:
            n = min(budget, max(1, math.ceil(self.spec_factor * length)))
            _, tokens = sa.continuation(n, self.min_match_len)
        if self.min_accept_prob > 0 and tokens:
            tokens = tokens[: self.acceptance.cut(length, len(tokens), self.min_accept_prob)]
        if tokens:
            self._pending[req_id] = (length, tokens)
            scores = self.acceptance.prob(length)[: len(tokens)]
            return Draft.chain(tokens, scores)
        return Draft.empty()

    def finish(self, req_id: str) -> None:
        self._automata.pop(req_id, None)
        self._pending.pop(req_id, None)

    def active_requests(self) -> int:
        return len(self._automata)

    def state_nbytes(self) -> int:
        return sum(sa.nbytes() for sa in self._automata.values())
