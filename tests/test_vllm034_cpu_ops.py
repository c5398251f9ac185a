"""The vLLM 0.34 engine tier's stand-in ``vllm._C`` ops
(``tests/vllm034_cpu_ops.py``) against dense torch references.

Plain functions, so they run in the main environment's fast tier too (where
vLLM 0.32's compiled ``_C`` is loaded and the stand-ins are not registered);
in the side environment the last test registers them and checks that
``torch.ops._C`` reaches them.
"""
from __future__ import annotations

import pytest
import torch

import vllm034_cpu_ops as ops
from vllm034_env import HAVE_VLLM034


def _paged(k: torch.Tensor, v: torch.Tensor, block_size: int, num_blocks: int,
           gen: torch.Generator):
    """Contiguous per-request K/V ([len, kv_heads, dim] each) written into a
    paged cache through the stand-in reshape_and_cache, at shuffled blocks."""
    kv_heads, dim = k[0].shape[1], k[0].shape[2]
    cache = torch.zeros(num_blocks, kv_heads, block_size, 2 * dim)
    view = cache.view(num_blocks, kv_heads, 2 * block_size, dim)
    key_cache, value_cache = view.chunk(2, dim=2)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for kr, vr in zip(k, v):
        n = (len(kr) + block_size - 1) // block_size
        blocks = [free.pop() for _ in range(n)]
        tables.append(blocks)
        slots = torch.tensor([blocks[i // block_size] * block_size + i % block_size
                              for i in range(len(kr))])
        # padding rows (slot -1) must be skipped
        slots_padded = torch.cat([slots, torch.tensor([-1, -1])])
        kp = torch.cat([kr, torch.randn(2, kv_heads, dim, generator=gen)])
        vp = torch.cat([vr, torch.randn(2, kv_heads, dim, generator=gen)])
        ops.cpu_attn_reshape_and_cache(kp, vp, key_cache, value_cache, slots_padded, "vec",
                                       1.0, 1.0, "auto")
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return key_cache, value_cache, table


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4)])
def test_paged_attention_equals_dense_causal_attention(heads, kv_heads):
    """Requests of several lengths, each with 1-7 new queries (a decode row
    with drafts, a prefill chunk) at the end of its context, GQA."""
    gen = torch.Generator().manual_seed(0)
    dim, block_size = 16, 32
    lens, queries = [5, 70, 33, 1], [3, 7, 1, 1]
    k = [torch.randn(n, kv_heads, dim, generator=gen) for n in lens]
    v = [torch.randn(n, kv_heads, dim, generator=gen) for n in lens]
    key_cache, value_cache, table = _paged(k, v, block_size, 16, gen)
    q = torch.randn(sum(queries), heads, dim, generator=gen)
    qsl = torch.tensor([0] + torch.tensor(queries).cumsum(0).tolist(), dtype=torch.int32)
    out = torch.zeros_like(q)
    scale = dim ** -0.5
    ops.cpu_attention_with_kv_cache(q, key_cache, value_cache, out, qsl,
                                    torch.tensor(lens, dtype=torch.int32), scale, True, None,
                                    -1, table, 0.0, torch.empty(0), None, None, 1.0, 1.0, "auto")
    for i, (n, m) in enumerate(zip(lens, queries)):
        qi = q[qsl[i]:qsl[i + 1]].transpose(0, 1)                     # [heads, m, dim]
        ki = k[i].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        vi = v[i].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        mask = torch.ones(m, n, dtype=torch.bool).tril(diagonal=n - m)   # query j sees <= n-m+j
        ref = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask,
                                                               scale=scale)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], ref.transpose(0, 1),
                                   rtol=1e-5, atol=1e-5)


def test_refuses_what_it_does_not_implement():
    q = torch.zeros(1, 2, 16)
    cache = torch.zeros(1, 2, 32, 16)
    args = [q, cache, cache, q.clone(), torch.tensor([0, 1]), torch.tensor([1]), 1.0, True,
            None, -1, torch.zeros(1, 1, dtype=torch.int32), 0.0, torch.empty(0), None, None,
            1.0, 1.0, "auto"]
    for index, value, what in ((8, torch.ones(2), "ALiBi"), (9, 128, "sliding window"),
                               (13, torch.ones(2), "sinks"), (17, "fp8", "kv_cache_dtype")):
        bad = list(args)
        bad[index] = value
        with pytest.raises(NotImplementedError, match=what):
            ops.cpu_attention_with_kv_cache(*bad)


def _rope_reference(positions, x, head_size, cache, is_neox):
    """Rotary embedding written independently: complex rotation of pairs."""
    rot = cache.shape[-1]
    cos, sin = cache[positions].chunk(2, dim=-1)
    xs = x.view(len(positions), -1, head_size).clone()
    r = xs[..., :rot]
    if is_neox:
        pairs = torch.complex(r[..., :rot // 2], r[..., rot // 2:])
    else:
        pairs = torch.complex(r[..., 0::2], r[..., 1::2])
    turned = pairs * torch.complex(cos, sin)[:, None, :]
    if is_neox:
        xs[..., :rot] = torch.cat([turned.real, turned.imag], dim=-1)
    else:
        xs[..., :rot] = torch.stack([turned.real, turned.imag], dim=-1).flatten(-2)
    return xs.view_as(x)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [64, 32])
def test_rotary_embedding_equals_reference(is_neox, rot_dim):
    gen = torch.Generator().manual_seed(1)
    head_size, heads, kv_heads, tokens = 64, 3, 1, 5
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    freqs = torch.arange(100).float()[:, None] * inv[None, :]
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    positions = torch.tensor([0, 7, 8, 50, 99])
    q = torch.randn(tokens, heads * head_size, generator=gen)
    k = torch.randn(tokens, kv_heads * head_size, generator=gen)
    want_q = _rope_reference(positions, q, head_size, cache, is_neox)
    want_k = _rope_reference(positions, k, head_size, cache, is_neox)
    ops.rotary_embedding(positions, q, k, head_size, cache, is_neox)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)


@pytest.mark.vllm034
@pytest.mark.skipif(not HAVE_VLLM034, reason="registers under torch.ops._C: the vLLM 0.34 side "
                                    "environment only (vLLM 0.32's compiled _C is loaded here)")
def test_registered_ops_reach_the_stand_ins():
    ops.register()
    ops.register()   # once a process
    assert torch.ops._C.cpu_attn_has_isa("amx") is False
    assert torch.ops._C.get_scheduler_metadata(
        1, 2, 2, 16, torch.tensor([3]), torch.float32, torch.tensor([0, 3]), True, -1, "vec",
        False, None, "auto").numel() == 0
    q, cache, positions = torch.randn(2, 64), torch.randn(8, 64), torch.tensor([1, 2])
    want = _rope_reference(positions, q, 64, cache, True)
    torch.ops._C.rotary_embedding(positions, q, None, 64, cache, True)
    torch.testing.assert_close(q, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="inverse"):
        torch.ops._C.rotary_embedding(torch.tensor([1, 2]), q, None, 64, torch.randn(8, 64),
                                      True, 0, True)
