"""Masked tree attention over vLLM's paged KV cache (Triton), and a torch reference.

Tree speculative decoding verifies a draft *tree* of ``n`` nodes per request in
one target forward. The query rows of request ``r`` are its ``n`` draft nodes:
rows ``query_start[r] .. query_start[r] + n - 1`` of ``q``
(``[total_query_tokens, num_heads, head_size]``); rows outside these ranges are
neither read nor written.

KV layout (vLLM's FlashAttention layout): ``k_cache`` and ``v_cache`` are each
``[num_blocks, block_size, num_kv_heads, head_size]`` (any strides). Request
``r`` owns logical positions ``0 .. P + n - 1`` with ``P = prefix_lens[r]``;
position ``p`` lives in slot ``block_table[r, p // block_size] * block_size +
p % block_size``. Positions ``0 .. P - 1`` are the committed prefix (the root,
i.e. the last committed token, is position ``P - 1``); position ``P + j`` holds
the KV of draft node ``j`` (already written by the forward pass).

Mask: node ``i`` attends to every prefix position and to node ``j`` iff bit
``j`` of ``ancestor_bits[r, i]`` is set: ``j`` is ``i`` itself or one of its
ancestors (:func:`ancestor_bits_from_parents`). An int64 bitmask per node
limits a request to 64 nodes. This is the ``[n, P + n]`` boolean mask
``[ones(n, P) | ancestor_mask]`` of :func:`vllm_specplug.tree.ancestor_mask`.

GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

Kernel: one program per (request, KV head, tile of ``BLOCK_M`` query rows),
where the rows of a tile are (node, query head of the group) pairs, so the
heads sharing a KV head share every K/V load. Each program runs a
flash-attention style online softmax (fp32 statistics and accumulator) first
over the prefix (no mask but the length) and then over the ``n`` node
positions (bitmask). Keys are gathered per position through the block table,
so any page size works. q/k/v may be fp16, bf16 or fp32 (all the same dtype);
fp32 uses full-precision (IEEE) dots, not TF32. Output is in q's dtype.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

MAX_TREE_NODES = 64  # one int64 ancestor bitmask per node

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def ancestor_bits_from_parents(parents) -> torch.Tensor:
    """int64 tensor ``[n]``: bit ``j`` of entry ``i`` is set iff node ``j`` is
    node ``i`` or one of its ancestors. ``parents[i]`` is the parent's index
    among the nodes, -1 for children of the root; parents come before children.
    Node 63's own bit is the int64 sign bit (the entry is then negative)."""
    from vllm_specplug.tree.structure import validate_parents

    if isinstance(parents, torch.Tensor):
        parents = parents.detach().cpu().numpy()
    parents = validate_parents(np.asarray(parents))
    if parents.size > MAX_TREE_NODES:
        raise ValueError(f"tree attention supports at most {MAX_TREE_NODES} draft nodes "
                         f"per request (int64 ancestor bitmask), got {parents.size}")
    bits: list[int] = []
    for i, p in enumerate(parents.tolist()):
        bits.append((bits[p] if p >= 0 else 0) | (1 << i))
    signed = [b - (1 << 64) if b >= 1 << 63 else b for b in bits]
    return torch.tensor(signed, dtype=torch.int64)


def _request_masks(ancestor_mask, node_counts: list[int]) -> list[torch.Tensor]:
    """Per-request ``[n, n]`` bool masks from a sequence of masks or a padded
    ``[R, N, N]`` tensor/array."""
    out = []
    for r, n in enumerate(node_counts):
        m = ancestor_mask[r]
        m = m.cpu() if isinstance(m, torch.Tensor) else torch.from_numpy(np.asarray(m))
        out.append(m[:n, :n].to(torch.bool))
    return out


def tree_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_table: torch.Tensor, prefix_lens, node_counts,
                             ancestor_mask, scale: float) -> torch.Tensor:
    """Plain-torch tree attention (slow, for tests): same semantics as
    :func:`paged_tree_attention`, with the requests' queries packed back to
    back (request ``r``'s rows start at ``sum(node_counts[:r])``) and the mask
    given as booleans: ``ancestor_mask[r]`` is request ``r``'s ``[n, n]``
    ancestor mask (a sequence of masks, or a padded ``[R, N, N]`` tensor).

    Computes in fp32 and returns ``[sum(node_counts), num_heads, head_size]``
    in q's dtype."""
    prefix_lens = [int(x) for x in torch.as_tensor(prefix_lens).tolist()]
    node_counts = [int(x) for x in torch.as_tensor(node_counts).tolist()]
    masks = _request_masks(ancestor_mask, node_counts)
    _, block_size, num_kv_heads, head_size = k_cache.shape
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    table = block_table.cpu().long()
    outs = []
    row = 0
    for r, (plen, n) in enumerate(zip(prefix_lens, node_counts)):
        pos = torch.arange(plen + n)
        blocks = table[r, pos // block_size].to(k_cache.device)
        offsets = (pos % block_size).to(k_cache.device)
        k = k_cache[blocks, offsets].float()                               # [L, Hkv, D]
        v = v_cache[blocks, offsets].float()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)              # [H, L, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qr = q[row: row + n].float().transpose(0, 1)                       # [H, n, D]
        allowed = torch.cat([torch.ones(n, plen, dtype=torch.bool), masks[r]], dim=1)
        scores = (qr @ k.transpose(1, 2)) * scale                          # [H, n, L]
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        outs.append((torch.softmax(scores, dim=-1) @ v).transpose(0, 1))   # [n, H, D]
        row += n
    if not outs:
        return q.new_empty((0, num_heads, head_size))
    return torch.cat(outs).to(q.dtype)


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


if triton is not None:

    @triton.jit
    def _dot(a, b, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
        """``a @ b`` accumulated in fp32. ``DOT_FP32`` upcasts the operands first
        (exact for fp16/bf16 inputs, so the same result): Triton's CPU
        interpreter multiplies bf16 operands as raw integers."""
        if DOT_FP32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b, input_precision=PRECISION)

    @triton.jit
    def _attend_tile(acc, l_i, m_i, q, bits, k_ptr, v_ptr, table_ptr, stride_table,
                     stride_kb, stride_ks, stride_vb, stride_vs, stride_kd, stride_vd,
                     start, end, prefix_len, d, d_ok, qk_scale,
                     PAGE: tl.constexpr, BLOCK_N: tl.constexpr, TREE: tl.constexpr,
                     PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
        """Online-softmax update with keys at positions ``start .. start+BLOCK_N-1``
        (those >= ``end`` masked). ``k_ptr``/``v_ptr`` already point at the KV head.
        Scores are in log2 units: ``qk_scale`` is scale * log2(e)."""
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        page = tl.load(table_ptr + (pos // PAGE) * stride_table, mask=pos_ok, other=0)
        page = page.to(tl.int64)
        off = pos % PAGE
        kv_ok = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + page[:, None] * stride_kb + off[:, None] * stride_ks
                    + d[None, :] * stride_kd, mask=kv_ok, other=0.0)
        s = _dot(q, tl.trans(k), PRECISION, DOT_FP32) * qk_scale         # [BLOCK_M, BLOCK_N]
        if TREE:
            j = tl.minimum(pos - prefix_len, 63).to(tl.int64)           # node index
            allowed = (((bits[:, None] >> j[None, :]) & 1) != 0) & pos_ok[None, :]
        else:
            allowed = pos_ok[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + page[:, None] * stride_vb + off[:, None] * stride_vs
                    + d[None, :] * stride_vd, mask=kv_ok, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, DOT_FP32)
        return acc, l_i, m_new

    def _jit(**kwargs):
        """``triton.jit`` with these options, without the alignment one where
        this Triton lacks it."""
        try:
            return triton.jit(**kwargs)
        except TypeError:
            kwargs.pop("do_not_specialize_on_alignment", None)
            return triton.jit(**kwargs)

    # Arguments that change from step to step are not specialized on (Triton
    # would otherwise compile a variant for integers equal to 1, for multiples
    # of 16 and for the rest, and for pointers 16-byte aligned or not: the
    # per-step arguments are views of one int64 buffer, aligned or not with the
    # number of tree requests): the variants are then only the constexprs of
    # :func:`launch_config`, which :func:`warm_up` compiles at engine start.
    @_jit(do_not_specialize=["max_nodes", "stride_bits_r", "stride_table_r"],
          do_not_specialize_on_alignment=["table_ptr", "prefix_lens_ptr", "node_counts_ptr",
                                          "query_start_ptr", "bits_ptr"])
    def _tree_attention_kernel(
            q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, prefix_lens_ptr, node_counts_ptr,
            query_start_ptr, bits_ptr, qk_scale,
            stride_qt, stride_qh, stride_qd,
            stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd,
            stride_ot, stride_oh, stride_od,
            stride_table_r, stride_table_b, stride_bits_r, stride_bits_n,
            head_size, max_nodes,
            PAGE: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
            DOT_FP32: tl.constexpr):
        req = tl.program_id(0)
        kv_head = tl.program_id(1)
        tile = tl.program_id(2)
        n = tl.minimum(tl.load(node_counts_ptr + req), max_nodes)
        if tile * BLOCK_M < n * GROUP:
            prefix_len = tl.load(prefix_lens_ptr + req)
            q_start = tl.load(query_start_ptr + req).to(tl.int64)
            rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)   # (node, head in group) pairs
            node = rows // GROUP
            head = kv_head * GROUP + rows % GROUP
            row_ok = node < n
            d = tl.arange(0, BLOCK_D)
            d_ok = d < head_size
            q_off = (q_start + node)[:, None] * stride_qt + head[:, None] * stride_qh
            io_ok = row_ok[:, None] & d_ok[None, :]
            q = tl.load(q_ptr + q_off + d[None, :] * stride_qd, mask=io_ok, other=0.0)
            bits = tl.load(bits_ptr + req * stride_bits_r + node * stride_bits_n,
                           mask=row_ok, other=0).to(tl.int64)

            table = table_ptr + req.to(tl.int64) * stride_table_r
            k_head = k_ptr + kv_head * stride_kh
            v_head = v_ptr + kv_head * stride_vh
            m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: no inf - inf
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            for start in range(0, prefix_len, BLOCK_N):
                acc, l_i, m_i = _attend_tile(
                    acc, l_i, m_i, q, bits, k_head, v_head, table, stride_table_b,
                    stride_kb, stride_ks, stride_vb, stride_vs, stride_kd, stride_vd,
                    start, prefix_len, prefix_len, d, d_ok, qk_scale,
                    PAGE, BLOCK_N, False, PRECISION, DOT_FP32)
            for start in range(prefix_len, prefix_len + n, BLOCK_N):
                acc, l_i, m_i = _attend_tile(
                    acc, l_i, m_i, q, bits, k_head, v_head, table, stride_table_b,
                    stride_kb, stride_ks, stride_vb, stride_vs, stride_kd, stride_vd,
                    start, prefix_len + n, prefix_len, d, d_ok, qk_scale,
                    PAGE, BLOCK_N, True, PRECISION, DOT_FP32)
            l_i = tl.where(l_i > 0.0, l_i, 1.0)  # a row with no key at all gives 0
            o = acc / l_i[:, None]
            o_off = (q_start + node)[:, None] * stride_ot + head[:, None] * stride_oh
            tl.store(out_ptr + o_off + d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty),
                     mask=io_ok)


def _check_inputs(q, k_cache, v_cache, block_table, prefix_lens, node_counts, query_start,
                  ancestor_bits, out) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("expected q [tokens, heads, head_size] and k_cache/v_cache "
                         "[num_blocks, block_size, num_kv_heads, head_size]")
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache and v_cache must share one dtype of {_DTYPES}, got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    num_heads, head_size = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_size:
        raise ValueError(f"head_size mismatch: q {head_size}, cache {k_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    num_reqs = block_table.shape[0]
    for name, t in (("prefix_lens", prefix_lens), ("node_counts", node_counts),
                    ("query_start", query_start)):
        if t.shape != (num_reqs,):
            raise ValueError(f"{name} must have shape [{num_reqs}], got {tuple(t.shape)}")
    if ancestor_bits.dim() != 2 or ancestor_bits.shape[0] != num_reqs:
        raise ValueError("ancestor_bits must be [num_requests, max_nodes]")
    if ancestor_bits.dtype != torch.int64:
        raise ValueError("ancestor_bits must be int64")
    if ancestor_bits.shape[1] > MAX_TREE_NODES:
        raise ValueError(f"tree attention supports at most {MAX_TREE_NODES} draft nodes per "
                         f"request, ancestor_bits has {ancestor_bits.shape[1]} columns")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError("out must match q's shape and dtype")
    if num_reqs:
        n_max = int(node_counts.max())  # device sync: pass check_inputs=False to skip
        if n_max > MAX_TREE_NODES:
            raise ValueError(f"tree attention supports at most {MAX_TREE_NODES} draft nodes "
                             f"per request, got {n_max}")
        if n_max > ancestor_bits.shape[1]:
            raise ValueError(f"node_counts has {n_max} nodes but ancestor_bits only "
                             f"{ancestor_bits.shape[1]} columns")


def paged_tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_table: torch.Tensor, prefix_lens: torch.Tensor,
                         node_counts: torch.Tensor, query_start: torch.Tensor,
                         ancestor_bits: torch.Tensor, scale: float,
                         out: torch.Tensor | None = None, *, check_inputs: bool = True
                         ) -> torch.Tensor:
    """Tree attention for a batch of requests over the paged KV cache (see the
    module docstring for layout and mask).

    Shapes: ``q`` ``[T, H, D]``; ``k_cache``/``v_cache`` ``[B, block_size, Hkv, D]``;
    ``block_table`` ``[R, max_blocks]`` (int32/int64); ``prefix_lens``,
    ``node_counts``, ``query_start`` ``[R]`` integer; ``ancestor_bits``
    ``[R, N]`` int64 with ``N >= max(node_counts)`` and ``N <= 64``. All on
    q's device. Writes the node rows of ``out`` (allocated like ``q`` if not
    given; other rows are left as they are) and returns it.

    ``check_inputs`` validates shapes, dtypes and node counts; the node-count
    check reads ``node_counts`` on the host (a device sync), so hot paths that
    already guarantee ``n <= 64`` may turn it off.
    """
    if triton is None:
        raise RuntimeError("paged_tree_attention needs Triton, which is not installed")
    if check_inputs:
        _check_inputs(q, k_cache, v_cache, block_table, prefix_lens, node_counts, query_start,
                      ancestor_bits, out)
    if out is None:
        out = torch.empty_like(q)
    num_reqs = block_table.shape[0]
    max_nodes = ancestor_bits.shape[1]
    if num_reqs == 0 or max_nodes == 0:
        return out
    num_heads, head_size = q.shape[1], q.shape[2]
    _, page, num_kv_heads, _ = k_cache.shape
    cfg = launch_config(num_heads, num_kv_heads, head_size, page, q.dtype, max_nodes)
    grid = (num_reqs, num_kv_heads, triton.cdiv(max_nodes * cfg["GROUP"], cfg["BLOCK_M"]))
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, out, block_table, prefix_lens, node_counts, query_start,
        ancestor_bits, scale * math.log2(math.e),
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        block_table.stride(0), block_table.stride(1),
        ancestor_bits.stride(0), ancestor_bits.stride(1),
        head_size, max_nodes,
        **cfg, num_warps=4, num_stages=2)
    return out


def launch_config(num_heads: int, num_kv_heads: int, head_size: int, page: int,
                  dtype: torch.dtype, max_nodes: int) -> dict:
    """The kernel's compile-time constants for one launch: everything that
    makes Triton compile a new variant (with the argument dtypes and the
    16-divisibility of the fixed strides). Within one engine only ``BLOCK_M``
    changes from step to step, with the step's largest tree."""
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_size))
    return dict(PAGE=page, GROUP=group,
                BLOCK_M=max(16, min(64, triton.next_power_of_2(max_nodes * group))),
                BLOCK_N=64 if block_d <= 128 else 32, BLOCK_D=block_d,
                PRECISION="ieee" if dtype == torch.float32 else None,  # fp32: no TF32
                DOT_FP32=dtype == torch.bfloat16 and _interpreting())


def warm_up_node_counts(num_heads: int, num_kv_heads: int,
                        max_nodes: int = MAX_TREE_NODES) -> list[int]:
    """One node count per distinct kernel variant that trees of 1 ..
    ``max_nodes`` nodes use (the smallest count of each ``BLOCK_M``)."""
    group = num_heads // num_kv_heads
    counts: dict[int, int] = {}
    for n in range(1, max_nodes + 1):
        block_m = max(16, min(64, triton.next_power_of_2(n * group)))
        counts.setdefault(block_m, n)
    return sorted(counts.values())


def warm_up(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_table: torch.Tensor, scale: float, max_nodes: int = MAX_TREE_NODES
            ) -> list[int]:
    """Compile (and run once) every kernel variant that trees of up to
    ``max_nodes`` nodes need for these tensors, so that serving never
    compiles. ``q``, the caches and ``block_table`` (one row, as wide as the
    serving path's) only give dtypes, strides and shapes: the launches read
    row 0 of ``q`` and the first ``page`` keys of the table's first block, and
    write a scratch output. Returns the node counts launched with."""
    if triton is None:
        raise RuntimeError("the tree-attention kernel needs Triton, which is not installed")
    device = q.device
    out = torch.empty_like(q)
    table = torch.zeros_like(block_table[:1])
    one = torch.ones(1, dtype=torch.int64, device=device)
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    counts = warm_up_node_counts(q.shape[1], k_cache.shape[2], max_nodes)
    for n in counts:
        bits = torch.zeros(1, n, dtype=torch.int64, device=device)
        bits[0, 0] = 1
        # node_counts 1: only row 0 of q is read, whatever the variant
        paged_tree_attention(q, k_cache, v_cache, table, one, one, zero, bits, scale,
                             out=out, check_inputs=False)
    return counts
