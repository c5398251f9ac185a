"""The CUDA tree path's pieces that need no GPU, on CPU tensors:

* ``cuda_kv`` reads and moves slots of vLLM 0.32's FlashAttention cache
  (logical ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, any
  physical order) exactly like a per-slot loop;
* ``tree_runtime.kv_module`` sends CPU caches to ``cpu_kv`` and CUDA caches to
  ``cuda_kv``;
* the glue that turns the step's tree requests into Triton kernel arguments
  (``build_flash_args``, block-table rows, ``split_kv``) gives arguments for
  which the kernel's torch reference equals the CPU path's SDPA;
* the CUDA configuration check.

The Triton kernel itself is tested in ``test_tree_attention_triton.py``.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_specplug.kernels.tree_attention_triton import tree_attention_reference
from vllm_specplug.tree import compaction_moves
from vllm_specplug.vllm_adapter.v1 import cpu_kv, cuda_kv, tree_runtime
from vllm_specplug.vllm_adapter.v1.step_state import StepTrees

BLOCK = 16


def flash_cache(num_blocks, heads, head_size, order, fill=None, seed=0):
    """A ``[B, H, N, 2D]`` cache view with physical axis order ``order``
    (``"BHNC"``: contiguous, head-major; ``"BNHC"``: token-major, like the
    LBNHC layout; ``"LBNHC"``: token-major with another layer's pages
    interleaved between blocks)."""
    gen = torch.Generator().manual_seed(seed)
    shape = {"B": num_blocks, "H": heads, "N": BLOCK, "C": 2 * head_size}
    if order == "LBNHC":  # two layers per block, take layer 1
        raw = torch.randn(num_blocks, 2, BLOCK, heads, 2 * head_size, generator=gen)
        view = raw[:, 1].permute(0, 2, 1, 3)
    else:
        raw = torch.randn(*(shape[a] for a in order), generator=gen)
        view = raw.permute(*(order.index(a) for a in "BHNC"))
    if fill is not None:
        view.fill_(fill)
    assert view.shape == (num_blocks, heads, BLOCK, 2 * head_size)
    return view


def brute_gather(kv, slots):
    d = kv.shape[-1] // 2
    ks = [kv[int(s) // BLOCK, :, int(s) % BLOCK, :d] for s in slots]
    vs = [kv[int(s) // BLOCK, :, int(s) % BLOCK, d:] for s in slots]
    return torch.stack(ks), torch.stack(vs)


def brute_move(kv, src, dst):
    for s, t in zip(src, dst):
        kv[t // BLOCK, :, t % BLOCK] = kv[s // BLOCK, :, s % BLOCK].clone()


ORDERS = ["BHNC", "BNHC", "LBNHC"]


@pytest.mark.parametrize("order", ORDERS)
def test_gather_matches_per_slot_loop(order):
    kv = flash_cache(7, 3, 8, order)
    slots = torch.randperm(7 * BLOCK, generator=torch.Generator().manual_seed(1))[:40]
    k, v = cuda_kv.gather(kv, slots)
    bk, bv = brute_gather(kv, slots)
    assert k.shape == (40, 3, 8) and torch.equal(k, bk) and torch.equal(v, bv)
    sk, sv = cuda_kv.split_kv(kv)  # FlashAttention's [B, N, H, D] views
    assert sk.shape == (7, BLOCK, 3, 8)
    assert torch.equal(sk[slots // BLOCK, slots % BLOCK], bk)
    assert torch.equal(sv[slots // BLOCK, slots % BLOCK], bv)


def _random_moves(rng, kind):
    if kind == "compaction":  # several requests' accepted paths, as accept_trees batches them
        src, dst = [], []
        for base in (5, 40, 77):
            n = int(rng.integers(2, 12))
            path = sorted(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False))
            for s, t in compaction_moves([int(p) for p in path]):
                src.append(base + 1 + s)
                dst.append(base + 1 + t)
        return src, dst
    # arbitrary: later moves read slots earlier ones wrote, targets repeat
    src = [int(x) for x in rng.integers(0, 6 * BLOCK, 12)]
    dst = [int(x) for x in rng.integers(0, 6 * BLOCK, 12)]
    dst[5] = src[7]
    dst[9] = dst[2]
    return src, dst


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kind", ["compaction", "arbitrary"])
def test_move_matches_sequential_copies(order, kind):
    rng = np.random.default_rng(ORDERS.index(order))
    for _ in range(5):
        kv = flash_cache(6, 2, 8, order, seed=int(rng.integers(1 << 30)))
        want = kv.clone()
        src, dst = _random_moves(rng, kind)
        assert cuda_kv._order_free(src, dst) == (kind == "compaction")
        brute_move(want, src, dst)
        cuda_kv.move(kv, src, dst)
        assert torch.equal(kv, want)


def test_move_compacts_an_accepted_path_across_a_block_boundary():
    kv = flash_cache(4, 3, 8, "BNHC")
    base, nodes = 12, 10  # nodes at slots 13..22, across the block boundary at 16
    slots = torch.arange(base, base + 1 + nodes)
    key, val = cuda_kv.gather(kv, slots)
    path = [1, 4, 9]
    moves = compaction_moves(path)
    cuda_kv.move(kv, [base + 1 + s for s, _ in moves], [base + 1 + t for _, t in moves])
    k, v = cuda_kv.gather(kv, torch.arange(base + 1, base + 1 + len(path)))
    want = torch.tensor([1 + i for i in path])
    assert torch.equal(k, key[want]) and torch.equal(v, val[want])
    k0, _ = cuda_kv.gather(kv, torch.tensor([base]))
    assert torch.equal(k0[0], key[0])  # the root is untouched


class _FakeCudaCache:
    """Stands in for a CUDA tensor: the dispatch looks at device and rank only."""
    device = torch.device("cuda")
    shape = (4, 2, BLOCK, 16)

    def dim(self):
        return 4


def test_dispatch_by_device():
    assert tree_runtime.kv_module(torch.zeros(4, 2, BLOCK, 16)) is cpu_kv
    assert cuda_kv.layout_of(torch.zeros(4, 2, BLOCK, 16)) == cuda_kv.CPU_VEC
    assert tree_runtime.kv_module(_FakeCudaCache()) is cuda_kv
    with pytest.raises(cpu_kv.UnsupportedKVLayout, match="device 'meta'"):
        tree_runtime.kv_module(torch.empty(4, 2, BLOCK, 16, device="meta"))
    with pytest.raises(cpu_kv.UnsupportedKVLayout, match="shape"):
        tree_runtime.kv_module(torch.zeros(4, 2, 16))


def test_layers_sharing_a_cache_are_moved_once():
    a, b = torch.zeros(2, 1, BLOCK, 4), torch.zeros(2, 1, BLOCK, 4)
    assert [id(x) for x in tree_runtime._distinct([a, b, a, a[:]])] == [id(a), id(b)]


# ------------------------------------------------------------ kernel glue

def _random_parents(rng, n, kind):
    if kind == "chain":
        return np.arange(-1, n - 1, dtype=np.int32)
    if kind == "star":
        return np.full(n, -1, dtype=np.int32)
    return np.array([-1 if i == 0 else int(rng.integers(-1, i)) for i in range(n)],
                    dtype=np.int32)


def _bits_to_masks(bits, counts):
    masks = []
    for r, n in enumerate(counts):
        b = bits[r].tolist()
        masks.append(torch.tensor([[(b[i] >> j) & 1 == 1 for j in range(n)] for i in range(n)],
                                  dtype=torch.bool))
    return masks


@pytest.mark.parametrize("order", ["BNHC", "LBNHC"])
def test_kernel_arguments_reproduce_the_cpu_path(order):
    """Batch rows: tree requests, a chain request (not a tree: rows in between)
    and a prefill; the tree requests' kernel arguments, fed to the kernel's torch
    reference, give the CPU path's SDPA result on the same flash-layout cache."""
    rng = np.random.default_rng(3)
    heads, kv_heads, d = 4, 2, 16
    # per batch row: (kind, prefix positions before the root, tree kind, nodes)
    batch = [("tree", 37, "random", 7), ("chain", 20, None, 3), ("tree", 15, "chain", 5),
             ("tree", 0, "random", 1), ("prefill", 0, None, 9), ("tree", 50, "star", 9),
             ("tree", 70, "random", 64)]
    need = [math.ceil((base + 1 + n) / BLOCK) for _, base, _, n in batch]
    num_blocks = sum(need) + 3
    perm = rng.permutation(num_blocks)
    table = np.zeros((len(batch) + 2, max(need) + 2), dtype=np.int32)  # padded, like vLLM's
    kv = flash_cache(num_blocks, kv_heads, d, order, fill=float("nan"))
    gen = torch.Generator().manual_seed(4)
    used, qrows, requests, node_rows = 0, 0, [], []
    for row, (kind, base, tree_kind, n) in enumerate(batch):
        table[row, : need[row]] = perm[used: used + need[row]]
        used += need[row]
        pos = np.arange(base + 1 + n)
        slots = torch.from_numpy(table[row, pos // BLOCK].astype(np.int64) * BLOCK
                                 + pos % BLOCK)
        for s in slots.tolist():  # the KV every owned position holds
            kv[s // BLOCK, :, s % BLOCK] = torch.randn(kv_heads, 2 * d, generator=gen)
        root_row = qrows
        qrows += 1 + n
        if kind == "tree":
            parents = _random_parents(rng, n, tree_kind)
            requests.append(tree_runtime.tree_request(f"r{row}", row, root_row, base, parents,
                                                      rng.integers(0, 100, n), table[row],
                                                      BLOCK))
            node_rows += range(root_row + 1, root_row + 1 + n)
    query = torch.randn(qrows + 3, heads, d, generator=gen)  # + cudagraph-style padding
    impl = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_size=d,
                           scale=d ** -0.5)

    # CPU path: batched SDPA over gathered keys (with the flash-layout reader)
    output = torch.full_like(query, 7.0)
    step = StepTrees(requests=requests, groups=tree_runtime.build_groups(requests))
    tree_runtime.tree_attention(impl, query, kv, output, step, gather=cuda_kv.gather)
    others = torch.ones(len(query), dtype=torch.bool)
    others[node_rows] = False
    assert (output[others] == 7.0).all() and not output.isnan().any()

    # CUDA glue -> kernel arguments -> the kernel's reference semantics
    args = tree_runtime.build_flash_args(requests, "cpu")
    counts = [tr.parents.size for tr in requests]
    assert args.rows.tolist() == [tr.row for tr in requests]
    assert args.prefix_lens.tolist() == [tr.base + 1 for tr in requests]
    assert args.node_counts.tolist() == counts
    assert args.query_start.tolist() == [tr.root_row + 1 for tr in requests]
    assert args.ancestor_bits.shape == (len(requests), 64)
    for t in (args.rows, args.prefix_lens, args.node_counts, args.query_start,
              args.ancestor_bits):
        assert t.is_contiguous() and t.dtype == torch.int64  # the kernel's 1-D loads
    masks = _bits_to_masks(args.ancestor_bits, counts)
    for tr, m in zip(requests, masks):  # the bitmask is the CPU path's mask
        assert torch.equal(m, tr.mask[:, tr.base + 1:])
    block_table = torch.from_numpy(table)
    rows_table = args.block_table(block_table)
    assert args.block_table(block_table) is rows_table  # gathered once per step
    k_cache, v_cache = cuda_kv.split_kv(kv)
    q_nodes = torch.cat([query[s: s + n] for s, n in zip(args.query_start.tolist(), counts)])
    ref = tree_attention_reference(q_nodes, k_cache, v_cache, rows_table, args.prefix_lens,
                                   args.node_counts, masks, impl.scale)
    torch.testing.assert_close(ref, output[node_rows], atol=2e-5, rtol=1e-5)


def test_more_than_64_nodes_are_refused():
    tr = tree_runtime.tree_request("a", 0, 0, 3, np.arange(-1, 64, dtype=np.int32),
                                   np.zeros(65), np.arange(8), BLOCK)
    with pytest.raises(NotImplementedError, match="at most 64"):
        tree_runtime.build_flash_args([tr], "cpu")


# ------------------------------------------------------- CUDA config check

def _config(backend=None, per_kind=None, cache_dtype="auto", k=8, dcp=1):
    return SimpleNamespace(
        model_config=None,
        attention_config=SimpleNamespace(backend=backend, backend_per_kind=per_kind or {}),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        parallel_config=SimpleNamespace(decode_context_parallel_size=dcp,
                                        prefill_context_parallel_size=1, use_ubatching=False))


def test_cuda_config_check():
    registry = pytest.importorskip("vllm.v1.attention.backends.registry")
    from vllm_specplug.vllm_adapter.v1 import _check_cuda_tree_config

    flash = registry.AttentionBackendEnum.FLASH_ATTN
    cfg = _config()
    _check_cuda_tree_config(cfg)
    assert cfg.attention_config.backend == flash  # auto-selection pinned to FLASH_ATTN
    _check_cuda_tree_config(_config(backend=flash, k=64))
    for bad in (_config(backend=registry.AttentionBackendEnum.FLASHINFER),
                _config(per_kind={"full_attention": registry.AttentionBackendEnum.TRITON_ATTN})):
        with pytest.raises(ValueError, match="FLASH_ATTN"):
            _check_cuda_tree_config(bad)
    for bad, what in ((_config(cache_dtype="fp8"), "quantized KV cache"),
                      (_config(k=65), "more than 64"), (_config(dcp=2), "context parallel")):
        with pytest.raises(NotImplementedError, match=what):
            _check_cuda_tree_config(bad)
