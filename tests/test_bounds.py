"""Every structure that grows with traffic stays within its bound
(docs/architecture.md, "Bounds"): a lot of traffic through the pure
structures, then the bound is asserted. No vLLM, no engine."""
from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_specplug.proposers.sam import MAX_BUCKET, AcceptanceByMatchLength


# ------------------------------------------------------ acceptance tables
def test_best_length_cache_bounded_under_changing_costs():
    """The verify cost is refitted every step; a table that is not updated
    (a source that stops winning) must not gain a cache entry per cost."""
    table = AcceptanceByMatchLength(32)
    rng = random.Random(0)
    for step in range(5000):
        cost = 0.05 + 0.05 * rng.random()  # a new float every step
        for match_len in (1, 3, 7, 40):
            table.best_length(match_len, 32, cost)
    assert len(table._best) <= MAX_BUCKET + 1, len(table._best)
    assert len(table._rows) <= MAX_BUCKET + 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 8), st.integers(0, 8),
                          st.sampled_from([0.0, 0.01, 0.08, 0.08, 0.3, 1.0]),
                          st.integers(0, 8)), max_size=60))
def test_best_length_cache_gives_the_uncached_lengths(ops):
    """Whatever the order of updates and costs, the cached best length is
    the one computed from the table's current estimates (the drafts do not
    change with the cache's shape)."""
    table = AcceptanceByMatchLength(8)
    for match_len, drafted, accepted, cost, n in ops:
        if drafted:
            table.update(match_len, drafted, min(accepted, drafted))
        got = table.best_length(match_len, n, cost)
        fresh = AcceptanceByMatchLength._best_lengths(table.prob(match_len).tolist(), cost)
        assert got == (fresh[min(n, len(fresh) - 1)] if n > 0 else 0)
