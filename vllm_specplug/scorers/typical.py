"""Typical acceptance (Medusa, Cai et al. 2024): fast, but NOT lossless.

A node's token x is accepted when the target's distribution p at its parent
gives it more than a threshold that shrinks as p gets flatter:

    p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p)))

with H the entropy of p (natural log, 0 log 0 = 0; Medusa adds 1e-5 inside
the log, which changes nothing that matters here). Of the nodes whose whole
root-to-node path is accepted, the deepest is taken (ties: the first in node
order; Medusa breaks ties by the path's likelihood), and the bonus token is
sampled from the target's distribution after it.

Not lossless: at temperature > 0 the emitted tokens are *not* distributed as
plain sampling would give them (plausible but unlikely tokens are accepted
more often than sampling would pick them, and rare ones are always
rejected). At temperature 0 (a one-hot ``target_probs`` row) a token is
accepted exactly when it is the argmax, so this reduces to greedy decoding:
for a tree whose siblings carry distinct tokens, the result equals
``GreedyScorer``'s. (With duplicate siblings it may take a longer path than
greedy's first-match walk; its tokens then extend greedy's.)
"""
from __future__ import annotations

import numpy as np

from ..options import Option
from ..proposers.base import Draft
from ..tree import path_to
from .base import Acceptance, Scorer
from .rejection import _sample


def typical_thresholds(target_probs: np.ndarray, threshold: float, alpha: float) -> np.ndarray:
    """Per row: the probability a token must exceed to be accepted."""
    p = np.asarray(target_probs, dtype=np.float64)
    p = p / p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log(p), 0.0)
    entropy = -plogp.sum(axis=-1)
    return np.minimum(threshold, alpha * np.exp(-entropy))


class TypicalScorer(Scorer):
    """Medusa's typical acceptance: the longest path of tokens above an
    entropy-adapted probability threshold. Not lossless at temperature > 0."""

    name = "typical"
    lossless = False
    options = (
        Option("posterior_threshold", float, 0.09,
               "accept a token whose target probability exceeds this (or less, for flat "
               "distributions: see posterior_alpha)", minimum=0.0, maximum=1.0),
        Option("posterior_alpha", float, 0.3,
               "entropy-adapted threshold: alpha * exp(-entropy); usually sqrt of "
               "posterior_threshold", minimum=0.0, maximum=1.0),
    )

    def __init__(self, posterior_threshold: float = 0.09, posterior_alpha: float = 0.3) -> None:
        self.posterior_threshold = float(posterior_threshold)
        self.posterior_alpha = float(posterior_alpha)

    def accept(self, draft: Draft, target_probs: np.ndarray,
               draft_probs: np.ndarray | None = None,
               rng: np.random.Generator | None = None) -> Acceptance:
        parents = draft.parent_array()
        probs = np.asarray(target_probs, dtype=np.float64)
        probs = probs / probs.sum(axis=-1, keepdims=True)
        limit = typical_thresholds(probs, self.posterior_threshold, self.posterior_alpha)
        best, best_depth = -1, 0
        depth = np.zeros(parents.size, dtype=np.int64)   # 0: path not accepted
        for i, par in enumerate(parents):
            row = par + 1                                  # the parent's row
            if par >= 0 and depth[par] == 0:
                continue
            if probs[row, int(draft.tokens[i])] > limit[row]:
                depth[i] = 1 if par < 0 else depth[par] + 1
                if depth[i] > best_depth:
                    best, best_depth = i, int(depth[i])
        path = path_to(parents, best)
        last = probs[best + 1]
        if rng is None:  # deterministic callers (e.g. temperature 0): the argmax
            return Acceptance(path, int(np.argmax(last)))
        return Acceptance(path, _sample(last, rng))
