"""EXAMPLE proposer: drafts the request's last ``repeat_n`` tokens again (a
chain, repeated cyclically up to the budget). It catches loops such as
"a, b, a, b, ..." and little else; it shows the proposer life cycle.
"""
from __future__ import annotations

from typing import ClassVar, Sequence

from vllm_specplug.options import Option
from vllm_specplug.proposers.base import Draft, Proposer, TargetTopK


class RepeatNgramProposer(Proposer):
    """Example: repeat the last n-gram as the draft."""

    name: ClassVar[str] = "example_repeat_ngram"
    options = (Option("repeat_n", int, 2, "length of the n-gram repeated",
                      minimum=1, maximum=16),)
    default_num_speculative_tokens = 4

    def __init__(self, num_speculative_tokens: int, repeat_n: int = 2) -> None:
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.repeat_n = int(repeat_n)
        self._tail: dict[str, list[int]] = {}   # each request's last repeat_n tokens

    def start(self, req_id: str, token_ids: Sequence[int]) -> None:
        self._tail[req_id] = [int(t) for t in token_ids[-self.repeat_n:]]

    def observe(self, req_id: str, committed_ids: Sequence[int],
                target_topk: TargetTopK | None = None) -> None:
        tail = self._tail[req_id] + [int(t) for t in committed_ids]
        self._tail[req_id] = tail[-self.repeat_n:]

    def propose(self, req_id: str, budget: int) -> Draft:
        tail = self._tail.get(req_id, [])
        n = min(budget, self.num_speculative_tokens)
        if len(tail) < self.repeat_n or n <= 0:
            return Draft.empty()
        return Draft.chain([tail[i % len(tail)] for i in range(n)])

    def finish(self, req_id: str) -> None:
        self._tail.pop(req_id, None)

    def active_requests(self) -> int:
        return len(self._tail)
