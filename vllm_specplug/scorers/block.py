"""Block verification for chains (Sun, Mendlovic, Leviathan, Aharoni, Beirami,
Ro, Suresh: "Block Verification Accelerates Speculative Decoding", 2024,
arXiv:2403.10444, Algorithm 2).

Lossless like token-wise rejection sampling, and it accepts at least as many
tokens in expectation (it is optimal among verifiers that see only the
drafted path's probabilities). Instead of deciding token by token, it keeps
a weight per prefix and decides the accepted length from the whole block.

With a draft X_1..X_g, target distributions P_i = P(. | X_<i) (rows 0..g of
``target_probs``) and draft distributions Q_i (rows 0..g-1 of
``draft_probs``; one-hot at X_i when it is None)::

    p_0 = 1
    p_i = min(1, p_{i-1} * P_i(X_i) / Q_i(X_i))                  i = 1..g
    r_i(x) = max(p_i * P_{i+1}(x) - Q_{i+1}(x), 0)               i = 0..g-1
    h_i = sum(r_i) / (sum(r_i) + 1 - p_i)    (0 when sum(r_i) = 0) i = 1..g-1
    h_g = p_g
    tau = the largest i with eta_i <= h_i (eta_i ~ U(0, 1)), else 0

X_1..X_tau are accepted; the next token is drawn from r_tau normalised, or
from P_{g+1} (the last target row) when tau = g.

Trees that are not chains fall back to ``RejectionScorer`` (multi-branch
recursive rejection): block verification is defined for a single path.
A drafted token whose draft probability is 0 (an inconsistent draft) ends
the block before it, as if the chain had been drafted that long.
"""
from __future__ import annotations

import numpy as np

from ..proposers.base import Draft
from .base import Acceptance, Scorer
from .rejection import RejectionScorer, _sample


def block_weights(tokens: np.ndarray, target_probs: np.ndarray,
                  draft_probs: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, list]:
    """``(p, h, residuals)`` of Algorithm 2 for a chain of ``len(tokens)`` nodes.

    ``p[i]`` and ``h[i]`` for i = 0..g (``h[0]`` unused, 0); ``residuals[i]``
    (i < g) is r_i, unnormalised. Rows are normalised here."""
    g = len(tokens)
    P = np.asarray(target_probs[: g + 1], dtype=np.float64)
    P = P / P.sum(axis=-1, keepdims=True)
    if draft_probs is None:
        Q = np.zeros((g, P.shape[1]))
        Q[np.arange(g), tokens] = 1.0
    else:
        Q = np.asarray(draft_probs[:g], dtype=np.float64)
        Q = Q / Q.sum(axis=-1, keepdims=True)
    p = np.ones(g + 1)
    for i in range(1, g + 1):
        x = int(tokens[i - 1])
        p[i] = min(1.0, p[i - 1] * P[i - 1, x] / Q[i - 1, x])
    residuals = [np.maximum(p[i] * P[i] - Q[i], 0.0) for i in range(g)]
    h = np.zeros(g + 1)
    for i in range(1, g):
        s = float(residuals[i].sum())
        h[i] = s / (s + 1.0 - p[i]) if s > 0 else 0.0
    if g:
        h[g] = p[g]
    return p, h, residuals


class BlockScorer(Scorer):
    """Block verification (arXiv:2403.10444) of chains, lossless; trees that are
    not chains: recursive rejection sampling."""

    name = "block"
    lossless = True

    def __init__(self) -> None:
        self._fallback = RejectionScorer()

    def accept(self, draft: Draft, target_probs: np.ndarray,
               draft_probs: np.ndarray | None, rng: np.random.Generator) -> Acceptance:
        if not draft.is_chain:
            return self._fallback.accept(draft, target_probs, draft_probs, rng)
        tokens = draft.tokens
        if draft_probs is not None and tokens.size:  # cut an inconsistent draft at q(x) = 0
            q_x = np.asarray(draft_probs, dtype=np.float64)[np.arange(tokens.size), tokens]
            bad = np.flatnonzero(q_x <= 0)
            if bad.size:
                tokens = tokens[: bad[0]]
        g = tokens.size
        p, h, residuals = block_weights(tokens, target_probs, draft_probs)
        tau = 0
        for i in range(g, 0, -1):  # the largest i with eta_i <= h_i
            if rng.random() < h[i]:
                tau = i
                break
        path = list(range(tau))
        if tau == g:
            return Acceptance(path, _sample(np.asarray(target_probs[g], dtype=np.float64), rng))
        if residuals[tau].sum() <= 0:  # only by rounding: h_tau is 0 when r_tau is
            return Acceptance(path, _sample(np.asarray(target_probs[tau], dtype=np.float64), rng))
        return Acceptance(path, _sample(residuals[tau], rng))
