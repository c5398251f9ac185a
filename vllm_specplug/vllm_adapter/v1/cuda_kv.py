"""Reading and moving tokens in vLLM's FlashAttention paged KV cache (CUDA).

vLLM 0.32 gives every attention layer a logical ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]`` view of its cache (``allocate_kv_cache`` /
``create_kv_cache_views``, RFC #42082); the physical order of those axes is
the engine's ``KVCacheLayout`` (e.g. ``LBNHC``: token-major inside a block), so
the view may have any strides. FlashAttention reads it as
``kv_cache.transpose(1, 2).split(head_size, dim=-1)``: the first ``head_size``
channels of a (block, kv head, token) entry are the key, the next
``head_size`` the value. Slot ``s`` is entry ``(s // block_size, :, s %
block_size)``. Everything here indexes that logical view, so it holds for
every layout.

The CPU backend's cache has the same logical shape but reinterprets each
block's memory (``cpu_kv``); the two cannot be told apart by shape, so
:func:`layout_of` dispatches on the device. Pure torch: no CUDA needed (the
tests run it on CPU tensors).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .cpu_kv import UnsupportedKVLayout

FLASH = "flash"
CPU_VEC = "cpu_vec"


def layout_of(kv_cache: torch.Tensor) -> str:
    """Which reader a layer cache needs: ``"cpu_vec"`` (vLLM's CPU_ATTN cache,
    :mod:`cpu_kv`) or ``"flash"`` (vLLM's FlashAttention cache on CUDA, this
    module)."""
    if kv_cache.dim() != 4:
        raise UnsupportedKVLayout(
            f"tree verification expects a [num_blocks, num_kv_heads, block_size, "
            f"2 * head_size] attention KV cache per layer, got shape "
            f"{tuple(kv_cache.shape)} (state-space or MLA layers are not supported)")
    kind = kv_cache.device.type
    if kind == "cpu":
        return CPU_VEC
    if kind == "cuda":
        return FLASH
    raise UnsupportedKVLayout(f"tree verification has no KV cache reader for device {kind!r}")


def split_kv(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value caches as FlashAttention (and the Triton tree kernel) read
    them: each ``[num_blocks, block_size, num_kv_heads, head_size]``, views."""
    d = kv_cache.shape[-1] // 2
    k, v = kv_cache.transpose(1, 2).split(d, dim=-1)
    return k, v


def gather(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at ``slots`` (block * block_size + offset), each
    ``[len(slots), num_kv_heads, head_size]``; reads only those entries."""
    bs = kv_cache.shape[2]
    d = kv_cache.shape[3] // 2
    slots = torch.as_tensor(slots, dtype=torch.long).to(kv_cache.device)
    x = kv_cache[slots // bs, :, slots % bs]           # [len, Hkv, 2 * D]
    return x[..., :d], x[..., d:]


def _order_free(src: Sequence[int], dst: Sequence[int]) -> bool:
    """Whether copying all of ``src`` at once equals copying one by one, in
    order: targets are distinct and no move reads a slot an earlier move wrote.
    Holds for tree compaction (slots only move down, sources are distinct and
    increasing, targets distinct)."""
    written: set[int] = set()
    for s, t in zip(src, dst):
        if s in written or t in written:
            return False
        written.add(t)
    return True


# One-entry memo of the device index tensors: accept_trees moves the same
# slots in every layer of a step.
_MEMO: list = [None, None]


def _indices(src: list[int], dst: list[int], block_size: int, device: torch.device):
    key = (tuple(src), tuple(dst), block_size, str(device))
    if _MEMO[0] != key:
        idx = torch.tensor([src, dst], dtype=torch.long).to(device)
        _MEMO[0], _MEMO[1] = key, (idx[0] // block_size, idx[0] % block_size,
                                   idx[1] // block_size, idx[1] % block_size)
    return _MEMO[1]


def move(kv_cache: torch.Tensor, src: Sequence[int], dst: Sequence[int]) -> None:
    """Copy the KV of slot ``src[i]`` to slot ``dst[i]``, in order (the result
    of one copy at a time). One gather and one scatter when the order cannot
    matter (always the case for tree compaction), otherwise slot by slot."""
    src = [int(s) for s in src]
    dst = [int(t) for t in dst]
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} sources but {len(dst)} targets")
    if not src:
        return
    bs = kv_cache.shape[2]
    if _order_free(src, dst):
        sb, so, tb, to = _indices(src, dst, bs, kv_cache.device)
        kv_cache[tb, :, to] = kv_cache[sb, :, so]
        return
    for s, t in zip(src, dst):
        if s != t:
            kv_cache[t // bs, :, t % bs].copy_(kv_cache[s // bs, :, s % bs])
