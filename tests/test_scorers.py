"""Acceptance rules against plain sampling (statistical) and hand examples."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import (ALPHA, N, V, chi2_pvalue, ranked_draft, sample_three, sampled_chain,
                     target)

from vllm_specplug.proposers.base import Draft
from vllm_specplug.scorers import GreedyScorer, RejectionScorer
from vllm_specplug.scorers.base import Acceptance

# A tree: two root children (siblings, the second duplicates nothing), a chain
# under the first, a sibling pair under it.
TREE_PARENTS = np.array([-1, -1, 0, 0, 2])


# A deterministic proposer's tree: each node's children carry the draft model's
# most likely tokens after the node's prefix (correlated with the target; with
# tokens drawn uniformly instead, a missing residual averages out exactly).
deterministic_tree = ranked_draft(TREE_PARENTS)
deterministic_tree.__name__ = "deterministic_tree"


def sampled_tree(rng):
    """Tokens drawn from draft distributions q (children of one parent drawn
    independently, as multi-draft speculative sampling assumes)."""
    q = rng.dirichlet(np.ones(V), size=TREE_PARENTS.size)
    toks = np.array([rng.choice(V, p=q[i]) for i in range(TREE_PARENTS.size)])
    return Draft(toks, TREE_PARENTS), q


def test_plain_sampling_passes_the_same_test():
    rng = np.random.default_rng(7)
    counts = np.zeros(V ** 3, dtype=np.int64)
    for _ in range(N):
        a = int(rng.choice(V, p=target(())))
        b = int(rng.choice(V, p=target((a,))))
        c = int(rng.choice(V, p=target((a, b))))
        counts[a * V * V + b * V + c] += 1
    assert chi2_pvalue(counts) > ALPHA


@pytest.mark.parametrize("draft_fn", [deterministic_tree, sampled_tree, sampled_chain])
def test_rejection_sampling_is_lossless(draft_fn):
    counts = sample_three(RejectionScorer(), draft_fn, N, seed=1)
    assert chi2_pvalue(counts) > ALPHA


class AlwaysAcceptFirstChild(RejectionScorer):
    """A broken rule: accepts the first child whatever the target says."""

    def accept(self, draft, target_probs, draft_probs, rng):
        path = [0] if len(draft) else []
        return Acceptance(path, int(rng.choice(V, p=target_probs[1 if path else 0])))


def test_the_distribution_test_catches_a_biased_rule():
    counts = sample_three(AlwaysAcceptFirstChild(), deterministic_tree, N, seed=2)
    assert chi2_pvalue(counts) < ALPHA


def test_greedy_walks_the_argmax_path():
    d = Draft(np.array([1, 2, 3, 4, 0]), np.array([-1, -1, 1, 1, 3]))
    p = np.full((6, V), 0.1)
    p[0, 2] = 1.0   # root -> node 1 (token 2)
    p[2, 4] = 1.0   # node 1 -> node 3 (token 4), not node 2 (token 3)
    p[4, 0] = 1.0   # node 3 -> node 4 (token 0)
    p[5, 3] = 1.0   # bonus after node 4
    acc = GreedyScorer().accept(d, p)
    assert acc.path == [1, 3, 4] and acc.bonus == 3
    assert acc.tokens(d) == [2, 4, 0, 3]


def test_greedy_rejects_at_root():
    d = Draft.chain([1, 2])
    p = np.full((3, V), 0.1)
    p[0, 4] = 1.0
    acc = GreedyScorer().accept(d, p)
    assert acc.path == [] and acc.bonus == 4


def test_rejection_accepts_certain_drafts():
    d = Draft.chain([1, 2])
    p = np.zeros((3, V))
    p[0, 1] = p[1, 2] = p[2, 3] = 1.0
    acc = RejectionScorer().accept(d, p, None, np.random.default_rng(0))
    assert acc.tokens(d) == [1, 2, 3]


def test_rejection_never_emits_a_rejected_deterministic_token():
    # Root wants token 0 or 1; both drafted siblings (2, 3) have p = 0.
    d = Draft(np.array([2, 3]), np.array([-1, -1]))
    p = np.zeros((3, V))
    p[0, :2] = 0.5
    p[1:] = 1.0 / V
    rng = np.random.default_rng(0)
    for _ in range(200):
        acc = RejectionScorer().accept(d, p, None, rng)
        assert acc.path == [] and acc.bonus in (0, 1)
