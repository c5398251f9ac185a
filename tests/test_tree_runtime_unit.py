"""tree_runtime's host-side pieces without an engine: the sparse (CUDA) tree
request gives the dense one's KV slots, greedy acceptance from argmaxes alone
equals acceptance from full rows, and the bytes a step copies to the host."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_specplug.proposers.base import Draft
from vllm_specplug.scorers import GreedyScorer
from vllm_specplug.vllm_adapter.v1 import tree_runtime
from vllm_specplug.vllm_adapter.v1.step_state import StepTrees


def _parents(data, n):
    return np.array([data.draw(st.integers(-1, i - 1)) for i in range(n)], dtype=np.int64)


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_sparse_request_slots_equal_dense_slots(data):
    n = data.draw(st.integers(1, 10))
    base = data.draw(st.integers(0, 60))
    block = data.draw(st.sampled_from([4, 16]))
    table = np.random.default_rng(data.draw(st.integers(0, 99))).permutation(64)
    parents = _parents(data, n)
    dense = tree_runtime.tree_request("a", 0, 0, base, parents, np.zeros(n), table, block)
    sparse = tree_runtime.tree_request("a", 0, 0, base, parents, np.zeros(n), table, block,
                                       dense=False)
    assert sparse.slots is None and sparse.mask is None
    positions = list(range(base + 1 + n))
    assert sparse.slots_of(positions) == dense.slots.tolist()


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_greedy_from_argmax_equals_greedy_from_rows(data):
    n = data.draw(st.integers(1, 10))
    v = 5
    parents = _parents(data, n)
    tokens = np.array([data.draw(st.integers(0, v - 1)) for _ in range(n)])
    rows = np.array([[data.draw(st.integers(-3, 3)) for _ in range(v)] for _ in range(n + 1)],
                    dtype=np.float32)
    draft = Draft(tokens, parents)
    a = GreedyScorer().accept(draft, rows)
    b = GreedyScorer().accept_argmax(draft, np.argmax(rows, axis=-1))
    assert a.path == b.path and a.tokens(draft) == b.tokens(draft)


class _Meta:
    def __init__(self, cu):
        self.cu_num_sampled_tokens = torch.tensor(cu)


def test_greedy_requests_copy_only_argmaxes():
    """A greedy tree request of n nodes hands (n + 1) int64 to acceptance, a
    sampled one (n + 1) x vocab float32; min_tokens masks before the argmax."""
    vocab, n = 1000, 7
    logits = torch.randn(2 * (n + 1), vocab)
    logits[0, 5] = 100.0  # the root row's argmax is a stop token
    parents = np.arange(-1, n - 1)
    greedy = tree_runtime.tree_request("g", 0, 0, 10, parents, np.zeros(n), np.arange(8), 16)
    greedy.stop_levels, greedy.stop_ids = 1, [5]
    sampled = tree_runtime.tree_request("s", 1, n + 1, 10, parents, np.zeros(n), np.arange(8),
                                        16)
    sampled.greedy = False
    step = StepTrees(requests=[greedy, sampled])
    got = tree_runtime.tree_logits(logits, _Meta([n + 1, 2 * (n + 1)]), step)
    assert got[0].dtype == torch.int64 and got[0].shape == (n + 1,)
    assert int(got[0][0]) != 5
    assert torch.equal(got[0][1:], logits[1: n + 1].argmax(-1))
    assert got[1].shape == (n + 1, vocab) and torch.equal(got[1], logits[n + 1:])
    assert step.stats["host_bytes"] == (n + 1) * 8 + (n + 1) * vocab * 4
