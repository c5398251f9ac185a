"""Pure-torch stand-ins for the few ``vllm._C`` ops that vLLM 0.34's CPU
engine reaches with a small dense float32 model (test support only).

vLLM 0.34 has no CPU wheel: the index's 0.34.0 wheel carries a CUDA
``vllm._C``, and the side environment (``scripts/setup-vllm034.sh``) holds
only its Python files. With these ops registered under ``torch.ops._C``
through ``torch.library`` and Triton's interpreter for Model Runner V2's
kernels, vLLM 0.34's own engine loop runs on this CPU
(``../shared/docs/vllm-0.34-engine-on-cpu.md``): scheduler, MRV2 runner,
rejection sampler, our speculator. The plugin never imports this module;
the engine tier (``tests/test_vllm034_engine.py``) does, and a server
process gets it through ``tests/vllm034_site/sitecustomize.py``.

Each op keeps the contract its C++ counterpart has for what the engine
passes (float32, no ALiBi, no sinks, no sliding window, ``auto`` KV dtype)
and refuses anything else by name; ``tests/test_vllm034_cpu_ops.py`` checks
each against a dense torch reference. Speed is not the point: timings of an
engine on these ops are never speed.

The KV cache layout is the CPU backend's own
(``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, which
``CPUAttentionBackendImpl`` views as ``[.., 2 * block_size, head_size]`` and
splits into ``key_cache`` and ``value_cache``, each
``[num_blocks, num_kv_heads, block_size, head_size]``): a token at slot
``s`` lives at block ``s // block_size``, row ``s % block_size``.
"""
from __future__ import annotations

import torch

#: Every ``torch.ops._C`` name this module registers.
OPS = ("init_cpu_memory_env", "cpu_attn_has_isa", "get_scheduler_metadata",
       "cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache", "rotary_embedding")

_LIB: torch.library.Library | None = None


def _refuse(what: str) -> None:
    raise NotImplementedError(f"vllm034_cpu_ops (test stand-in for vllm._C) does not "
                              f"implement {what}")


def init_cpu_memory_env(nodes: list[int]) -> None:
    """The C++ op binds the process's memory to NUMA ``nodes``; nothing to do here."""
    del nodes


def cpu_attn_has_isa(isa: str) -> bool:
    """No vectorised attention kernel is compiled in."""
    del isa
    return False


def get_scheduler_metadata(num_reqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                           seq_lens: torch.Tensor, dtype: torch.dtype,
                           query_start_loc: torch.Tensor, causal: bool,
                           sliding_window_size: int, isa: str, enable_kv_split: bool,
                           dynamic_causal: torch.Tensor | None,
                           kv_cache_dtype: str) -> torch.Tensor:
    """The C++ op plans work splits for its kernel; the stand-in attention
    plans nothing, so the metadata is an empty tensor."""
    if dtype != torch.float32:
        _refuse(f"attention in {dtype} (float32 only)")
    return torch.empty(0, dtype=torch.int32)


def _kv_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype != "auto":
        _refuse(f"kv_cache_dtype {kv_cache_dtype!r} ('auto' only)")


def cpu_attn_reshape_and_cache(key: torch.Tensor, value: torch.Tensor,
                               key_cache: torch.Tensor, value_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, isa: str, k_scale: float,
                               v_scale: float, kv_cache_dtype: str) -> None:
    """Write each token's key and value at its slot (``-1``: padding, skipped)."""
    _kv_dtype(kv_cache_dtype)
    block_size = key_cache.shape[2]
    slots = slot_mapping.long()
    n = slots.numel()
    keep = slots >= 0
    slots = slots[keep]
    blocks, rows = slots // block_size, slots % block_size
    key_cache[blocks, :, rows] = key[:n][keep].to(key_cache.dtype)
    value_cache[blocks, :, rows] = value[:n][keep].to(value_cache.dtype)


def cpu_attention_with_kv_cache(query: torch.Tensor, key_cache: torch.Tensor,
                                value_cache: torch.Tensor, output: torch.Tensor,
                                query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                                scale: float, causal: bool, alibi_slopes: torch.Tensor | None,
                                sliding_window: int, block_table: torch.Tensor, softcap: float,
                                scheduler_metadata: torch.Tensor, s_aux: torch.Tensor | None,
                                dynamic_causal: torch.Tensor | None, k_scale: float,
                                v_scale: float, kv_cache_dtype: str) -> None:
    """Paged attention, one request at a time: request ``i``'s queries are
    rows ``query_start_loc[i]:query_start_loc[i+1]``, the last of its
    ``seq_lens[i]`` positions; its keys and values are gathered from its
    blocks (``block_table[i]``). Causal: query ``j`` of ``n`` sees keys at
    positions up to ``seq_lens[i] - n + j``."""
    del scheduler_metadata, k_scale, v_scale
    _kv_dtype(kv_cache_dtype)
    if alibi_slopes is not None:
        _refuse("ALiBi slopes")
    if s_aux is not None:
        _refuse("attention sinks")
    if dynamic_causal is not None:
        _refuse("dynamic causal masks")
    if sliding_window not in (-1, 0):
        _refuse(f"a sliding window ({sliding_window})")
    num_tokens, num_heads, head_dim = query.shape[0], query.shape[-2], query.shape[-1]
    _, num_kv_heads, block_size, _ = key_cache.shape
    group = num_heads // num_kv_heads
    out = output.view(num_tokens, num_heads, head_dim)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, length in enumerate(lens):
        first, last = starts[i], starts[i + 1]
        n = last - first
        if n <= 0:
            continue
        nblocks = (length + block_size - 1) // block_size
        blocks = block_table[i, :nblocks].long()
        k = key_cache[blocks].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :length]
        v = value_cache[blocks].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :length]
        k = k.repeat_interleave(group, 0).float()
        v = v.repeat_interleave(group, 0).float()
        q = query[first:last].view(n, num_heads, head_dim).transpose(0, 1).float()
        scores = (q @ k.transpose(1, 2)) * scale                    # [heads, n, length]
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        if causal:
            qpos = torch.arange(length - n, length)
            masked = torch.arange(length)[None, :] > qpos[:, None]
            scores = scores.masked_fill(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[first:last] = (probs @ v).transpose(0, 1).to(out.dtype)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                     head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool,
                     rope_dim_offset: int = 0, inverse: bool = False) -> None:
    """Rotary position embedding in place on ``query`` (and ``key``):
    ``cos_sin_cache[pos]`` holds ``rot_dim / 2`` cosines then as many sines;
    NeoX style rotates the two halves of the first ``rot_dim`` dims, GPT-J
    style the even and odd ones."""
    if rope_dim_offset != 0 or inverse:
        _refuse("rotary_embedding with rope_dim_offset or inverse")
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.long().flatten()].chunk(2, dim=-1)
    cos, sin = cos[:, None, :].float(), sin[:, None, :].float()
    for x in (query, key):
        if x is None:
            continue
        shaped = x.view(positions.numel(), -1, head_size)
        rot = shaped[..., :rot_dim].float()
        if is_neox:
            x1, x2 = rot.chunk(2, dim=-1)
            new = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = rot[..., ::2], rot[..., 1::2]
            new = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        shaped[..., :rot_dim] = new.to(x.dtype)


_SCHEMAS = {
    "init_cpu_memory_env": "(int[] nodes) -> ()",
    "cpu_attn_has_isa": "(str isa) -> bool",
    "get_scheduler_metadata": "(int num_reqs, int num_heads, int num_kv_heads, int head_dim, "
                              "Tensor seq_lens, ScalarType dtype, Tensor query_start_loc, "
                              "bool causal, int sliding_window_size, str isa, "
                              "bool enable_kv_split, Tensor? dynamic_causal, "
                              "str kv_cache_dtype) -> Tensor",
    "cpu_attn_reshape_and_cache": "(Tensor key, Tensor value, Tensor(a!) key_cache, "
                                  "Tensor(b!) value_cache, Tensor slot_mapping, str isa, "
                                  "float k_scale, float v_scale, str kv_cache_dtype) -> ()",
    "cpu_attention_with_kv_cache": "(Tensor query, Tensor key_cache, Tensor value_cache, "
                                   "Tensor(a!) output, Tensor query_start_loc, Tensor seq_lens, "
                                   "float scale, bool causal, Tensor? alibi_slopes, "
                                   "int sliding_window, Tensor block_table, float softcap, "
                                   "Tensor scheduler_metadata, Tensor? s_aux, "
                                   "Tensor? dynamic_causal, float k_scale, float v_scale, "
                                   "str kv_cache_dtype) -> ()",
    "rotary_embedding": "(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
                        "Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, "
                        "bool inverse=False) -> ()",
}


def register() -> None:
    """Register every op in ``OPS`` under ``torch.ops._C`` (once a process).
    Fails, naming it, if an op of that name exists already (a real
    ``vllm._C`` is loaded: the stand-ins are not needed)."""
    global _LIB
    if _LIB is not None:
        return
    for name in OPS:
        if hasattr(torch.ops._C, name):
            raise RuntimeError(f"torch.ops._C.{name} exists already: a compiled vllm._C is "
                               f"loaded, and the test stand-ins would shadow it")
    lib = torch.library.Library("_C", "FRAGMENT")
    for name in OPS:
        lib.define(name + _SCHEMAS[name])
        lib.impl(name, globals()[name], "CompositeExplicitAutograd")
    _LIB = lib
