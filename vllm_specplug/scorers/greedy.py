"""Temperature 0: the longest root-to-node path whose tokens all equal the
target's argmax, then the argmax after its last node."""
from __future__ import annotations

import numpy as np

from ..proposers.base import Draft
from ..tree import children_lists
from .base import Acceptance, Scorer


class GreedyScorer(Scorer):
    name = "greedy"

    def accept(self, draft: Draft, target_probs: np.ndarray,
               draft_probs: np.ndarray | None = None,
               rng: np.random.Generator | None = None) -> Acceptance:
        return self.accept_argmax(draft, np.argmax(target_probs, axis=-1))

    def accept_argmax(self, draft: Draft, argmax: np.ndarray) -> Acceptance:
        """The same from the argmax of each row alone (root row first)."""
        children = children_lists(draft.parent_array())
        path: list[int] = []
        row = 0  # target_probs row of the current node (0: root)
        while True:
            want = int(argmax[row])
            nxt = next((c for c in children[row] if int(draft.tokens[c]) == want), None)
            if nxt is None:
                return Acceptance(path, want)
            path.append(nxt)
            row = nxt + 1
