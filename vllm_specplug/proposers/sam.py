"""SAM: suffix-automaton drafting over prompt + committed output (SAM-Decoding).

Each request owns a dynamic suffix automaton, extended only with committed
tokens. The running match is the longest suffix of the context that occurred
earlier; the draft is what followed that earlier occurrence. Draft length
follows match length: none below ``sam_min_match_len``, at most
``ceil(sam_spec_factor * match_len)`` and ``num_speculative_tokens``.
"""
from __future__ import annotations

import math
from typing import ClassVar, Sequence

from ..options import Option
from .base import Draft, Proposer, TargetTopK
from .suffix_automaton import SuffixAutomaton


class SamProposer(Proposer):
    name: ClassVar[str] = "sam"
    options: ClassVar[tuple[Option, ...]] = (
        Option("sam_min_match_len", int, 2,
               "no draft when the longest earlier match is shorter than this",
               minimum=1, maximum=1024),
        Option("sam_spec_factor", float, 4.0,
               "draft at most ceil(factor * match length) tokens",
               minimum=0.01, maximum=1024.0),
    )

    def __init__(self, num_speculative_tokens: int, sam_min_match_len: int = 2,
                 sam_spec_factor: float = 4.0) -> None:
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.min_match_len = int(sam_min_match_len)
        self.spec_factor = float(sam_spec_factor)
        self._automata: dict[str, SuffixAutomaton] = {}

    def start(self, req_id: str, token_ids: Sequence[int]) -> None:
        self._automata[req_id] = SuffixAutomaton(token_ids)

    def observe(self, req_id: str, committed_ids: Sequence[int],
                target_topk: TargetTopK | None = None) -> None:
        self._automata[req_id].extend(committed_ids)

    def propose(self, req_id: str, budget: int) -> Draft:
        sa = self._automata[req_id]
        length = sa.match_len
        if length < self.min_match_len or budget <= 0:
            return Draft.empty()
        n = min(budget, self.num_speculative_tokens,
                max(1, math.ceil(self.spec_factor * length)))
        _, tokens = sa.continuation(n, self.min_match_len)
        return Draft.chain(tokens)

    def finish(self, req_id: str) -> None:
        self._automata.pop(req_id, None)

    def active_requests(self) -> int:
        return len(self._automata)

    def state_nbytes(self) -> int:
        return sum(sa.nbytes() for sa in self._automata.values())
