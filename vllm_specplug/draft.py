"""``Draft``: the tokens a proposer drafts for one request and one step
(a chain or a tree given as a parent array).

A bottom layer of the package: it imports only numpy, so the budget
(``vllm_specplug.budget``) and the tree functions (``vllm_specplug.tree``)
use drafts without importing the proposers. ``vllm_specplug.proposers.base``
re-exports it: proposers (third-party ones included) import it from there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Draft:
    """Draft tokens for one request and one step.

    ``tokens`` are in topological order (parents before children).
    ``parents[i]`` is the index of node i's parent, or -1 if node i follows the
    last committed token directly. ``parents is None`` means a chain (node i's
    parent is i - 1). ``scores`` is an optional confidence per node (e.g. an
    estimated acceptance probability) for budget allocation.
    """

    tokens: np.ndarray
    parents: np.ndarray | None = None
    scores: np.ndarray | None = None

    def __post_init__(self) -> None:
        tokens = np.asarray(self.tokens, dtype=np.int32).reshape(-1)
        object.__setattr__(self, "tokens", tokens)
        if self.parents is not None:
            parents = np.asarray(self.parents, dtype=np.int32).reshape(-1)
            if parents.shape != tokens.shape:
                raise ValueError(
                    f"Draft.parents has {parents.size} entries for {tokens.size} tokens")
            if np.any(parents >= np.arange(parents.size)) or np.any(parents < -1):
                raise ValueError("Draft.parents must point to earlier nodes (or -1)")
            object.__setattr__(self, "parents", parents)
        if self.scores is not None:
            scores = np.asarray(self.scores, dtype=np.float32).reshape(-1)
            if scores.shape != tokens.shape:
                raise ValueError("Draft.scores must have one entry per token")
            object.__setattr__(self, "scores", scores)

    @classmethod
    def chain(cls, tokens: Sequence[int], scores: Sequence[float] | None = None) -> "Draft":
        return cls(np.asarray(tokens, dtype=np.int32), None, scores)

    @classmethod
    def empty(cls) -> "Draft":
        return cls(np.zeros(0, dtype=np.int32))

    def __len__(self) -> int:
        return int(self.tokens.size)

    @property
    def is_chain(self) -> bool:
        if self.parents is None:
            return True
        return bool(np.array_equal(self.parents, np.arange(-1, self.tokens.size - 1)))

    def parent_array(self) -> np.ndarray:
        """Parents per node, chains included (-1 for a root)."""
        if self.parents is not None:
            return self.parents
        return np.arange(-1, self.tokens.size - 1, dtype=np.int32)

    def depths(self) -> np.ndarray:
        """Depth of each node: 1 for children of the last committed token."""
        parents = self.parent_array()
        depth = np.zeros(parents.size, dtype=np.int32)
        for i, p in enumerate(parents):
            depth[i] = 1 if p < 0 else depth[p] + 1
        return depth
