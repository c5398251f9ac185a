"""EXAMPLE acceptance rule: recursive rejection sampling on the draft cut to
``max_accept`` levels, so at most ``max_accept`` drafted tokens are accepted
per step (plus the bonus token).

Lossless: cutting the draft depends only on the draft's shape, and rejection
sampling is lossless for any draft. It shows a scorer with an option; it is
not useful for speed (it throws away drafted work).
"""
from __future__ import annotations

import numpy as np

from vllm_specplug.options import Option
from vllm_specplug.proposers.base import Draft
from vllm_specplug.scorers import Acceptance, RejectionScorer, Scorer


class CappedRejectionScorer(Scorer):
    """Example: rejection sampling that accepts at most ``max_accept`` tokens."""

    name = "example_capped"
    lossless = True
    options = (Option("max_accept", int, 2, "most drafted tokens accepted per step",
                      minimum=0, maximum=128),)

    def __init__(self, max_accept: int = 2) -> None:
        self.max_accept = int(max_accept)
        self._rejection = RejectionScorer()

    def accept(self, draft: Draft, target_probs: np.ndarray,
               draft_probs: np.ndarray | None, rng: np.random.Generator) -> Acceptance:
        keep = np.flatnonzero(draft.depths() <= self.max_accept)  # parents come first
        new_index = np.full(len(draft), -1, dtype=np.int64)
        new_index[keep] = np.arange(keep.size)
        parents = draft.parent_array()[keep]
        cut = Draft(draft.tokens[keep], np.where(parents < 0, -1, new_index[parents]))
        rows = np.asarray(target_probs)[np.concatenate([[0], keep + 1])]
        q = None if draft_probs is None else np.asarray(draft_probs)[keep]
        acc = self._rejection.accept(cut, rows, q, rng)
        return Acceptance([int(keep[i]) for i in acc.path], acc.bonus)
