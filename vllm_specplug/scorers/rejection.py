"""Lossless speculative sampling for chains and trees.

At each node, the children are tried in order (SpecInfer's multi-branch
recursive rejection; a chain is the one-child case): child c with token x is
accepted with probability min(1, p(x) / q_c(x)); on rejection the target
distribution becomes the normalised residual max(p - q_c, 0) and the next
sibling is tried. Deterministic drafts have q_c = one-hot(x), so a rejection
just removes x from p. When no child is accepted the bonus token is sampled
from the residual; after a leaf, from the leaf's distribution. The emitted
tokens are then distributed exactly as plain sampling from the target.
"""
from __future__ import annotations

import numpy as np

from ..proposers.base import Draft
from ..tree import children_lists
from .base import Acceptance, Scorer


def _sample(p: np.ndarray, rng: np.random.Generator) -> int:
    total = p.sum()
    if total <= 0:
        raise ValueError("cannot sample from an all-zero distribution")
    return int(rng.choice(p.size, p=p / total))


class RejectionScorer(Scorer):
    name = "rejection"

    def accept(self, draft: Draft, target_probs: np.ndarray,
               draft_probs: np.ndarray | None, rng: np.random.Generator) -> Acceptance:
        children = children_lists(draft.parent_array())
        path: list[int] = []
        row = 0
        while True:
            p = np.array(target_probs[row], dtype=np.float64)
            moved = False
            for c in children[row]:
                x = int(draft.tokens[c])
                if draft_probs is None:
                    q_x = 1.0
                else:
                    q = np.asarray(draft_probs[c], dtype=np.float64)
                    q_x = float(q[x])
                total = p.sum()
                p_x = p[x] / total if total > 0 else 0.0
                if q_x > 0 and rng.random() < min(1.0, p_x / q_x):
                    path.append(c)
                    row = c + 1
                    moved = True
                    break
                # Residual: max(p - q, 0), normalised (p is kept unnormalised).
                p = p / total if total > 0 else p
                if draft_probs is None:
                    p[x] = 0.0
                else:
                    p = np.maximum(p - q, 0.0)
            if not moved:
                return Acceptance(path, _sample(p, rng))
