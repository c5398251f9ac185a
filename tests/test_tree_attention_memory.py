"""CPU tree attention's working memory does not grow with the context (issue
45, finding 9), fast tier, no engine.

``tree_runtime.tree_attention`` attends a group of tree requests in one SDPA
call when the group's (request, key) pairs fit ``BLOCK_BYTES``, else in
blocks of keys with an online softmax, so one long context grouped with
short ones no longer makes every request of the group gather (and pad to)
the long one's keys. Checked here: the result equals plain dense attention
per request under its ancestor mask (both paths, grouped-query heads or not,
float32 and bfloat16), and no tensor the call allocates, nor any K/V gather,
exceeds ``BLOCK_BYTES`` while the context is many times larger."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vllm_specplug.vllm_adapter.v1 import cpu_kv, tree_runtime
from vllm_specplug.vllm_adapter.v1.step_state import StepTrees

BLOCK = 16          # KV cache block size (tokens)
D = 16              # head size


def _parents(rng, n):
    return np.array([rng.integers(-1, i) for i in range(n)], dtype=np.int64)


def make_batch(seed: int, bases: list[int], heads: int, kv_heads: int, dtype=torch.float32):
    """Tree requests whose roots are at ``bases`` (contexts of base + 1 + n
    keys), a CPU KV cache ("vec" layout) holding random keys and values at
    every slot they own, the step's query rows and an attention impl."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    nodes = [int(rng.integers(1, 7)) for _ in bases]
    need = [(b + 1 + n + BLOCK - 1) // BLOCK for b, n in zip(bases, nodes)]
    num_blocks = sum(need) + 2
    perm = rng.permutation(num_blocks)
    kv = torch.randn(num_blocks, kv_heads, BLOCK, 2 * D, generator=gen).to(dtype)
    requests, used, qrows = [], 0, 0
    for row, (base, n) in enumerate(zip(bases, nodes)):
        table = perm[used: used + need[row]]
        used += need[row]
        requests.append(tree_runtime.tree_request(f"r{row}", row, qrows, base,
                                                  _parents(rng, n), rng.integers(0, 50, n),
                                                  table, BLOCK))
        qrows += 1 + n
    query = torch.randn(qrows, heads, D, generator=gen).to(dtype)
    impl = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_size=D,
                           scale=D ** -0.5)
    return requests, kv, query, impl


def dense_reference(requests, kv, query, impl) -> dict[int, torch.Tensor]:
    """Node rows -> [heads, D]: each request's nodes attending, in float64,
    to all its keys under its mask (the committed prefix and their ancestors)."""
    rep = impl.num_heads // impl.num_kv_heads
    out = {}
    for tr in requests:
        k, v = cpu_kv.gather(kv, tr.slots)
        k, v = k.double(), v.double()
        n = tr.parents.size
        q = query[tr.root_row + 1: tr.root_row + 1 + n].double()
        for h in range(impl.num_heads):
            s = q[:, h] @ k[:, h // rep].T * impl.scale
            s = s.masked_fill(~tr.mask, float("-inf"))
            o = torch.softmax(s, dim=-1) @ v[:, h // rep]
            for i in range(n):
                out.setdefault(tr.root_row + 1 + i, torch.zeros(impl.num_heads, D,
                                                                dtype=torch.float64))[h] = o[i]
    return out


def run(requests, kv, query, impl, gather=cpu_kv.gather) -> torch.Tensor:
    output = torch.full_like(query, 7.0)
    step = StepTrees(requests=requests, groups=tree_runtime.build_groups(requests))
    tree_runtime.tree_attention(impl, query, kv, output, step, gather=gather)
    return output


# one long context grouped with short ones, and short ones only
BATCHES = {"long_with_short": [2500, 3, 40, 17, 0, 90], "short": [3, 40, 17, 0, 90],
           "one_long": [1200]}


CASES = [(batch, heads, kv_heads, budget) for batch in BATCHES
         for heads, kv_heads in [(4, 2), (2, 2), (6, 1)] for budget in (None, 24 << 10)]
# a few keys a block: requests leave the blocks past their last key one by one
CASES += [("short", 4, 2, 3 << 10), ("short", 6, 1, 3 << 10)]


@pytest.mark.parametrize("batch,heads,kv_heads,budget", CASES)
def test_tree_attention_equals_dense_attention(batch, heads, kv_heads, budget, monkeypatch):
    """``budget`` None: the default (one SDPA call per group here); small
    ones: blocks of keys."""
    if budget is not None:
        monkeypatch.setattr(tree_runtime, "BLOCK_BYTES", budget, raising=False)
    requests, kv, query, impl = make_batch(len(BATCHES[batch]) + heads, BATCHES[batch],
                                           heads, kv_heads)
    output = run(requests, kv, query, impl)
    ref = dense_reference(requests, kv, query, impl)
    got = torch.stack([output[r] for r in sorted(ref)]).double()
    want = torch.stack([ref[r] for r in sorted(ref)])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    others = torch.ones(len(query), dtype=torch.bool)
    others[sorted(ref)] = False
    assert (output[others] == 7.0).all()     # root rows untouched


def test_blocks_in_bfloat16(monkeypatch):
    monkeypatch.setattr(tree_runtime, "BLOCK_BYTES", 24 << 10, raising=False)
    requests, kv, query, impl = make_batch(3, BATCHES["long_with_short"], 4, 2,
                                           dtype=torch.bfloat16)
    output = run(requests, kv, query, impl)
    assert output.dtype == torch.bfloat16
    ref = dense_reference(requests, kv, query, impl)
    for r, want in ref.items():
        torch.testing.assert_close(output[r].double(), want, atol=2e-2, rtol=2e-2)


class Allocations(TorchDispatchMode):
    """Storages the aten ops allocate (outputs that are no view of an
    input's storage), in bytes: the largest one, and the largest sum
    allocated between two ``mark`` calls."""

    def __init__(self):
        super().__init__()
        self.peak, self.op, self.since, self.most = 0, None, 0, 0

    def mark(self) -> None:
        self.since = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                size = t.untyped_storage().nbytes()
                if size > self.peak:
                    self.peak, self.op = size, func
                self.since += size
                self.most = max(self.most, self.since)
        return out


def test_peak_memory_does_not_grow_with_the_context(monkeypatch):
    """A 2 500-key context grouped with five short ones, 48 KiB allowed a
    call: no K/V gather reads more (request, key) pairs than fit, no tensor
    the call allocates is larger than the budget, and what a key block
    allocates in all stays within it plus a few copies of the per-row
    accumulators (no context in them), while the long request's keys and
    values alone are 8 times the budget (the former single gather of the
    group padded to the longest: 50 times)."""
    budget = 48 << 10
    monkeypatch.setattr(tree_runtime, "BLOCK_BYTES", budget, raising=False)
    heads, kv_heads = 4, 2
    requests, kv, query, impl = make_batch(1, BATCHES["long_with_short"], heads, kv_heads)
    key_bytes = kv_heads * D * 4                       # one key, float32
    longest = max(tr.slots.numel() for tr in requests)
    assert longest * key_bytes * 2 > 8 * budget        # K and V of the long one alone
    step = StepTrees(requests=requests, groups=tree_runtime.build_groups(requests))
    (group,) = step.groups
    r, n, _ = group.shape
    accumulator = r * heads * n * D * 4                # per query row: D values, float32
    gathered = []
    seen = Allocations()

    def gather(kv_cache, slots):
        gathered.append(slots.numel())
        seen.mark()                                    # a key block starts
        return cpu_kv.gather(kv_cache, slots)

    output = torch.full_like(query, 7.0)
    with seen:
        tree_runtime.tree_attention(impl, query, kv, output, step, gather=gather)
    assert max(gathered) * 2 * key_bytes <= budget, (max(gathered), budget)
    assert seen.peak <= budget, (seen.peak, seen.op, budget)
    assert seen.most <= budget + 4 * accumulator, (seen.most, budget, accumulator)
    assert len(gathered) > 8                           # the long context took many blocks
    # and the result is still the dense one
    ref = dense_reference(requests, kv, query, impl)
    for row, want in ref.items():
        torch.testing.assert_close(output[row].double(), want, atol=2e-5, rtol=1e-5)


def test_requests_leave_the_blocks_after_their_last_key(monkeypatch):
    """Padding is not attended: the keys gathered in all add up to about the
    requests' own keys (each padded at most to its last block), not the
    group's count times the longest context."""
    monkeypatch.setattr(tree_runtime, "BLOCK_BYTES", 12 << 10, raising=False)
    requests, kv, query, impl = make_batch(2, BATCHES["long_with_short"], 4, 2)
    gathered = []

    def gather(kv_cache, slots):
        gathered.append(slots.numel())
        return cpu_kv.gather(kv_cache, slots)

    run(requests, kv, query, impl, gather=gather)
    own = sum(tr.slots.numel() for tr in requests)
    longest = max(tr.slots.numel() for tr in requests)
    assert sum(gathered) < own + len(requests) * 64
    assert sum(gathered) < len(requests) * longest / 4


def test_the_default_budget_keeps_short_groups_in_one_call():
    """Under the default budget a group of 16 requests of 1 000 keys (a
    small model's heads: 14 query, 2 KV, 64 wide, 16 nodes) still takes one
    SDPA call, and an 8B model's (32, 8, 128) context of 32 000 keys is
    attended in blocks of a few thousand keys."""
    sdpa = tree_runtime._pair_bytes(14, 2, 64, 16, False)
    assert 16 * 1000 * sdpa <= tree_runtime.BLOCK_BYTES
    blocks = tree_runtime._pair_bytes(32, 8, 128, 16, True)
    assert 32_000 * blocks > tree_runtime.BLOCK_BYTES
    assert 1000 <= tree_runtime.BLOCK_BYTES // blocks <= 8000
