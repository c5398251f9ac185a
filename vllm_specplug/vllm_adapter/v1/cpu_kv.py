"""Reading and moving tokens in vLLM's CPU paged KV cache.

One layer's cache is ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``.
Its layout inside a block depends on the attention ISA the CPU backend picked
(``_get_attn_isa``); only the ``"vec"`` layout (x86 without AMX, fp32/bf16,
block size a multiple of 32: what this plugin's CPU users get) is supported,
and it is checked against vLLM's own writer (``cpu_attn_reshape_and_cache``)
in the tests. Per (block, kv head), the block's ``block_size * 2 * head_size``
values hold the keys transposed, ``[head_size, block_size]``, then the values,
``[block_size, head_size]``.
"""
from __future__ import annotations

import torch

SUPPORTED_ISAS = ("vec",)


class UnsupportedKVLayout(RuntimeError):
    pass


def check_isa(isa: str) -> None:
    if isa not in SUPPORTED_ISAS:
        raise UnsupportedKVLayout(
            f"tree verification reads vLLM's CPU KV cache directly and supports the "
            f"{SUPPORTED_ISAS} layout; this engine uses {isa!r} (AMX bf16, or a block size "
            f"that is not a multiple of 32). Use float32, or --block-size 128.")


def _blocks(kv_cache: torch.Tensor) -> torch.Tensor:
    nb, h, bs, two_d = kv_cache.shape
    return kv_cache.view(nb, h, bs * two_d)


def gather(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at ``slots`` (block * block_size + offset), each
    ``[len(slots), num_kv_heads, head_size]``; reads only those entries."""
    nb, h, bs, two_d = kv_cache.shape
    d = two_d // 2
    flat = _blocks(kv_cache)
    blk = torch.div(slots, bs, rounding_mode="floor")
    off = slots - blk * bs
    keys = flat[:, :, : bs * d].view(nb, h, d, bs)
    vals = flat[:, :, bs * d:].view(nb, h, bs, d)
    return keys[blk, :, :, off], vals[blk, :, off, :]


def move(kv_cache: torch.Tensor, src: list[int], dst: list[int]) -> None:
    """Copy the KV of slot ``src[i]`` to slot ``dst[i]``, in order."""
    nb, h, bs, two_d = kv_cache.shape
    d = two_d // 2
    flat = _blocks(kv_cache)
    for s, t in zip(src, dst):
        sb, so = divmod(int(s), bs)
        tb, to = divmod(int(t), bs)
        keys_s = flat[sb, :, : bs * d].view(h, d, bs)
        keys_t = flat[tb, :, : bs * d].view(h, d, bs)
        keys_t[:, :, to] = keys_s[:, :, so]
        vals_s = flat[sb, :, bs * d:].view(h, bs, d)
        vals_t = flat[tb, :, bs * d:].view(h, bs, d)
        vals_t[:, to, :] = vals_s[:, so, :]
