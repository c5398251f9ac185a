"""Plain functions over a draft tree given as a parent array.

Nodes are in topological order; ``parents[i]`` is -1 for a child of the last
committed token (the root, which is not a node) or an earlier index.
"""
from __future__ import annotations

import numpy as np

from ..draft import Draft


def validate_parents(parents: np.ndarray) -> np.ndarray:
    parents = np.asarray(parents, dtype=np.int32).reshape(-1)
    idx = np.arange(parents.size)
    if np.any(parents < -1) or np.any(parents >= idx):
        raise ValueError("tree parents must be -1 or point to an earlier node")
    return parents


def depths(parents: np.ndarray) -> np.ndarray:
    """Depth of each node: 1 for children of the root."""
    parents = validate_parents(parents)
    d = np.zeros(parents.size, dtype=np.int32)
    for i, p in enumerate(parents):
        d[i] = 1 if p < 0 else d[p] + 1
    return d


def node_positions(parents: np.ndarray, base: int) -> np.ndarray:
    """Position ids of the nodes when the root (last committed token) is at
    ``base``: base + depth, as plain decoding would give them on their path."""
    return base + depths(parents)


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """``mask[i, j]`` is True when node j is node i or one of its ancestors:
    which tree nodes node i may attend to (besides the committed prefix)."""
    parents = validate_parents(parents)
    n = parents.size
    mask = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def children_lists(parents: np.ndarray) -> list[list[int]]:
    """Children of the root (index 0) and of each node (index i + 1), in order."""
    parents = validate_parents(parents)
    out: list[list[int]] = [[] for _ in range(parents.size + 1)]
    for i, p in enumerate(parents):
        out[p + 1].append(i)
    return out


def path_to(parents: np.ndarray, node: int) -> list[int]:
    """Node indices from the root's child down to ``node`` (empty for -1)."""
    parents = validate_parents(parents)
    path = []
    while node >= 0:
        path.append(int(node))
        node = int(parents[node])
    return path[::-1]


def compaction_moves(path: list[int]) -> list[tuple[int, int]]:
    """KV moves that make an accepted path contiguous.

    The verify step wrote node i's KV at offset i (after the root); plain
    decoding would have put the path's k-th node at offset k. Returns
    ``(from_offset, to_offset)`` pairs, in an order that is safe to apply
    in place (offsets only move down, and path indices increase)."""
    return [(int(node), k) for k, node in enumerate(path) if node != k]


def merge_drafts(first, second):
    """The union of two drafts as one tree (a trie: nodes with the same
    parent and token are one node, whose score is the larger of the two).

    Returns ``(merged, index_of_second)``: ``index_of_second[i]`` is the merged
    index of ``second``'s node i. Both drafts must have scores (or neither)."""
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    where: dict[tuple[int, int], int] = {}
    with_scores = first.scores is not None and second.scores is not None

    def add(draft) -> list[int]:
        index = []
        for i, (tok, p) in enumerate(zip(draft.tokens.tolist(), draft.parent_array().tolist())):
            parent = -1 if p < 0 else index[p]
            s = float(draft.scores[i]) if with_scores else 0.0
            key = (parent, tok)
            if key in where:
                j = where[key]
                scores[j] = max(scores[j], s)
            else:
                j = where[key] = len(tokens)
                tokens.append(tok)
                parents.append(parent)
                scores.append(s)
            index.append(j)
        return index

    add(first)
    index_of_second = add(second)
    merged = Draft(np.asarray(tokens, dtype=np.int32), np.asarray(parents, dtype=np.int32),
                   np.asarray(scores, dtype=np.float32) if with_scores else None)
    return merged, index_of_second
