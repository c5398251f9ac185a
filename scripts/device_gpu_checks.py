"""GPU checks of the CUDA tree path that need no vLLM (torch + Triton only).

Runs unchanged on the device machine (torch 2.11 + CUDA, Triton 3.6, no
vLLM) and writes one JSON file; ``--smoke`` runs the same code at tiny sizes
on CPU under Triton's interpreter (a few seconds; timings meaningless), which
``tests/test_device_script.py`` does in CI so the script is known to run.

Sections (each written to the JSON as soon as it ends; a section that fails
is recorded with its traceback and the others still run):

a. ``correctness``: ``paged_tree_attention`` against the fp32 torch reference
   for trees of 1, 4, 16 and 64 nodes (one batch of four requests, plus each
   small tree alone so every ``BLOCK_M`` variant runs), contexts 128 .. 32k,
   GQA ratios 1, 4, 8, head sizes 64 and 128, bf16 and fp16, shuffled block
   tables, NaN in every slot no request owns; and the chain (causal) case
   against torch SDPA. Pass: ``|out - ref| <= 1e-5 + 2u(max|v| + |ref|)``
   elementwise (u: the dtype's unit roundoff), as in the unit tests.
b. ``kernel_speed``: ms per call of the kernel (random trees and chains of
   16 and 64 nodes) against a plain chain verify of the same rows (torch SDPA,
   bottom-right causal, over contiguous K/V) at batch 1, 8, 32 with
   Llama-3.1-8B attention shapes (32 query / 8 KV heads, 128, bf16). The
   ratio kernel / SDPA is the tree path's extra attention cost per layer (vLLM
   runs its own attention first, then the kernel rewrites the tree rows).
c. ``verify_cost``: a decoder with Llama-3.1-8B's shapes (32 layers, hidden
   4096, MLP 14336, vocabulary 128256; random bf16 weights) forwarding N new
   tokens per request over a 1k and a 4k context (N = 1, 2, ..., 128) at
   batch 1, 8, 32 (CUDA graphs where capture works, eager otherwise): ms per
   step and the least-squares line ``a + b * tokens`` (tokens = batch * N, the
   tokens a step verifies, as ``vllm_specplug.budget.StepCostModel`` fits it).
d. ``cuda_kv``: ``cuda_kv.gather`` / ``move`` on flash-layout caches (three
   physical axis orders) on the GPU against the same calls on CPU copies, and
   ``layout_of``; and ``warm_up``: the kernel compiles nothing new while
   serving random tree sizes after ``warm_up`` (Triton's compile cache count).

Usage on the device machine (one ``run`` call, timeout_s about 540):
    PYTHONUNBUFFERED=1 python3 scripts/device_gpu_checks.py --out $OUT/gpu_checks.json
Smoke run here:  python3 scripts/device_gpu_checks.py --smoke --out /tmp/smoke.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
SENTINEL = 7.0

# Llama-3.1-8B
LLAMA8B = dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_size=128,
               intermediate=14336, vocab=128256)
TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_size=16, intermediate=96,
            vocab=256)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes on CPU under Triton's interpreter")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "gpu_checks.json"))
    ap.add_argument("--sections", default="a,d,c,b",
                    help="which sections, in this order (default a,d,c,b)")
    ap.add_argument("--time-budget", type=float, default=450.0,
                    help="seconds for all sections; later cases are skipped past it")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    return args


class Budget:
    """Wall-clock budget: ``left()`` seconds remain; sections skip cases past it."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


# ------------------------------------------------------------------ helpers

def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, iters: int, device: str, warmup: int = 2) -> float:
    import torch

    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) * 1e3 / iters


def random_parents(gen, n: int, kind: str) -> list[int]:
    import torch

    if kind == "chain":
        return list(range(-1, n - 1))
    # random tree with deep-ish branches, as drafts have
    return [-1 if i == 0 else int(torch.randint(max(-1, i - 4), i, (1,), generator=gen))
            for i in range(n)]


def ancestor_bits(parents: list[int]) -> list[int]:
    """As ``ancestor_bits_from_parents`` (int64, node 63's bit is the sign)."""
    bits: list[int] = []
    for i, p in enumerate(parents):
        bits.append((bits[p] if p >= 0 else 0) | (1 << i))
    return [b - (1 << 64) if b >= 1 << 63 else b for b in bits]


def masks_of(parents_list) -> list:
    import torch

    out = []
    for parents in parents_list:
        n = len(parents)
        m = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                m[i, j] = True
                j = parents[j]
        out.append(m)
    return out


def build(dtype, device: str, *, prefixes, counts, heads, kv_heads, head_size, page,
          kind: str, seed: int) -> dict:
    """Paged inputs for one kernel call: shuffled blocks, NaN in every slot no
    request owns, one root row before each request's node rows, SENTINEL in
    ``out``; the unpaged K/V per request too (for SDPA)."""
    import torch

    gen = torch.Generator().manual_seed(seed)   # structure (host)
    dgen = torch.Generator(device=device).manual_seed(seed)   # values (on the device)
    blocks = [math.ceil((p + n) / page) for p, n in zip(prefixes, counts)]
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(counts), max(blocks) + 1), num_blocks - 1, dtype=torch.int32)
    k_cache = torch.full((num_blocks, page, kv_heads, head_size), float("nan"), dtype=dtype,
                         device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    parents, used, k_seq, v_seq = [], 0, [], []
    bits = torch.zeros(len(counts), max(counts), dtype=torch.int64)
    for r, (p, n) in enumerate(zip(prefixes, counts)):
        table[r, :blocks[r]] = perm[used: used + blocks[r]]
        used += blocks[r]
        pos = torch.arange(p + n)
        slots = (table[r, pos // page].long() * page + pos % page).to(device)
        k = torch.randn(p + n, kv_heads, head_size, generator=dgen, device=device).to(dtype)
        v = torch.randn(p + n, kv_heads, head_size, generator=dgen, device=device).to(dtype)
        k_cache.view(-1, kv_heads, head_size)[slots] = k
        v_cache.view(-1, kv_heads, head_size)[slots] = v
        k_seq.append(k)
        v_seq.append(v)
        parents.append(random_parents(gen, n, kind))
        bits[r, :n] = torch.tensor(ancestor_bits(parents[-1]), dtype=torch.int64)
    query_start = [sum(counts[:r]) + r + 1 for r in range(len(counts))]
    q = torch.randn(sum(counts) + len(counts) + 1, heads, head_size, generator=dgen,
                    device=device).to(dtype)
    node_rows = torch.cat([torch.arange(s, s + n) for s, n in zip(query_start, counts)])
    on = dict(device=device)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=table.to(**on),
                prefix_lens=torch.tensor(prefixes, **on), node_counts=torch.tensor(counts, **on),
                query_start=torch.tensor(query_start, **on), ancestor_bits=bits.to(**on),
                node_rows=node_rows.to(**on), scale=head_size ** -0.5, parents=parents,
                counts=list(counts), prefixes=list(prefixes), k_seq=k_seq, v_seq=v_seq)


def run_kernel(c: dict, out=None):
    from vllm_specplug.kernels.tree_attention_triton import paged_tree_attention

    return paged_tree_attention(c["q"], c["k_cache"], c["v_cache"], c["block_table"],
                                c["prefix_lens"], c["node_counts"], c["query_start"],
                                c["ancestor_bits"], c["scale"], out=out, check_inputs=False)


def tolerance_ratio(out, ref, dtype_name: str, v_max: float):
    err = (out.float() - ref.float()).abs()
    tol = 1e-5 + 2 * UNIT_ROUNDOFF[dtype_name] * (v_max + ref.float().abs())
    return float(err.max()), float((err / tol).max())


def sdpa_chain(q, k, v, scale, causal: bool = True):
    """Bottom-right causal attention (``causal``; else every query attends
    every key), q ``[B, H, n, D]``, k/v ``[B, Hkv, L, D]``."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    n, length = q.shape[2], k.shape[2]
    mask = causal_lower_right(n, length) if n > 1 and causal else None
    if k.shape[1] != q.shape[1]:
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                  enable_gqa=True)
        except (RuntimeError, TypeError):
            group = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


# ------------------------------------------------------------ a. correctness

def section_correctness(device: str, smoke: bool, budget: Budget) -> dict:
    import torch

    from vllm_specplug.kernels.tree_attention_triton import tree_attention_reference

    if smoke:
        contexts, ratios, head_sizes, nodes = [40], [2], [16], [1, 4, 9]
        dtypes, kv_heads, page, alone = ["bfloat16", "float16"], 2, 16, [1]
        chain_nodes, chain_contexts = [4], [40]
    else:
        contexts, ratios, head_sizes, nodes = [128, 1024, 4096, 32768], [1, 4, 8], [64, 128], \
            [1, 4, 16, 64]
        dtypes, kv_heads, page, alone = ["bfloat16", "float16"], 8, 16, [1, 4, 16]
        chain_nodes, chain_contexts = [16, 64], [128, 4096, 32768]
    rows, chain_rows, skipped = [], [], []
    seed = 0
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for head_size in head_sizes:
            for ratio in ratios:
                heads = kv_heads * ratio
                runs = [(ctx, list(nodes), "random") for ctx in contexts]
                runs += [(contexts[min(1, len(contexts) - 1)], [n], "random-alone")
                         for n in alone]
                runs += [(ctx, [n], "chain") for ctx in chain_contexts for n in chain_nodes]
                for ctx, counts, kind in runs:
                    if budget.left() < 0:
                        skipped.append(f"{dtype_name}/{head_size}/{ratio}/{ctx}/{kind}")
                        continue
                    seed += 1
                    # contexts: the first request exactly ctx, the others a
                    # little shorter (partial last blocks)
                    prefixes = [max(1, ctx - 37 * r) for r in range(len(counts))]
                    c = build(dtype, device, prefixes=prefixes, counts=counts, heads=heads,
                              kv_heads=kv_heads, head_size=head_size, page=page,
                              kind="chain" if kind == "chain" else "random", seed=seed)
                    out = torch.full_like(c["q"], SENTINEL)
                    run_kernel(c, out)
                    others = torch.ones(out.shape[0], dtype=torch.bool, device=device)
                    others[c["node_rows"]] = False
                    untouched = bool((out[others] == SENTINEL).all())
                    got = out[c["node_rows"]]
                    v_max = max(float(v.float().abs().max()) for v in c["v_seq"])
                    masks = masks_of(c["parents"])
                    ref = tree_attention_reference(
                        c["q"][c["node_rows"]].float(), c["k_cache"].float(),
                        c["v_cache"].float(), c["block_table"], c["prefix_lens"],
                        c["node_counts"], masks, c["scale"])
                    base = dict(dtype=dtype_name, head_size=head_size, gqa=ratio,
                                heads=heads, kv_heads=kv_heads, page=page)
                    start = 0
                    for r, n in enumerate(counts):
                        max_abs, ratio_tol = tolerance_ratio(got[start:start + n],
                                                             ref[start:start + n],
                                                             dtype_name, v_max)
                        row = dict(base, context=prefixes[r], nodes=n, kind=kind,
                                   max_abs=max_abs, tol_ratio=round(ratio_tol, 4),
                                   nan=bool(got[start:start + n].isnan().any()),
                                   others_untouched=untouched)
                        if kind == "chain":  # also against torch SDPA
                            q = c["q"][c["node_rows"]][start:start + n].float()
                            sd = sdpa_chain(q.transpose(0, 1)[None],
                                            c["k_seq"][r].float().transpose(0, 1)[None],
                                            c["v_seq"][r].float().transpose(0, 1)[None],
                                            c["scale"])[0].transpose(0, 1)
                            row["sdpa_max_abs"], sd_ratio = tolerance_ratio(
                                got[start:start + n], sd, dtype_name, v_max)
                            row["sdpa_tol_ratio"] = round(sd_ratio, 4)
                            row["ok"] = (ratio_tol <= 1 and sd_ratio <= 1 and untouched
                                         and not row["nan"])
                            chain_rows.append(row)
                        else:
                            row["ok"] = ratio_tol <= 1 and untouched and not row["nan"]
                            rows.append(row)
                        start += n
                    del c, out, ref
    every = rows + chain_rows
    return {"cases": rows, "chain_vs_sdpa": chain_rows, "skipped": skipped,
            "all_ok": bool(every) and all(r["ok"] for r in every) and not skipped,
            "max_tol_ratio": max((r["tol_ratio"] for r in every), default=None)}


# ------------------------------------------------------------ b. kernel speed

def section_kernel_speed(device: str, smoke: bool, budget: Budget) -> dict:
    import torch

    if smoke:
        shape = dict(heads=4, kv_heads=2, head_size=16)
        batches, node_list, contexts, iters, dtype = [2], [4], [24], 1, torch.bfloat16
    else:
        shape = dict(heads=32, kv_heads=8, head_size=128)
        batches, node_list, contexts, iters, dtype = [1, 8, 32], [16, 64], [1024, 4096, 32768], \
            20, torch.bfloat16
    rows, skipped, warmup = [], [], 1 if smoke else 3
    for ctx in contexts:
        for batch in batches:
            for n in node_list:
                if budget.left() < 0 or (ctx >= 32768 and batch > 8):
                    skipped.append(f"{ctx}/{batch}/{n}")
                    continue
                row = dict(context=ctx, batch=batch, nodes=n)
                for kind in ("random", "chain"):
                    c = build(dtype, device, prefixes=[ctx] * batch, counts=[n] * batch,
                              page=16, kind=kind, seed=batch * 1000 + n, **shape)
                    out = torch.empty_like(c["q"])
                    row[f"kernel_{kind}_ms"] = round(time_ms(lambda: run_kernel(c, out),
                                                             iters, device, warmup), 4)
                    if kind == "chain":
                        q = (c["q"][c["node_rows"]].view(batch, n, shape["heads"], -1)
                             .transpose(1, 2).contiguous())
                        k = torch.stack(c["k_seq"]).transpose(1, 2).contiguous()
                        v = torch.stack(c["v_seq"]).transpose(1, 2).contiguous()
                        row["sdpa_chain_ms"] = round(time_ms(
                            lambda: sdpa_chain(q, k, v, c["scale"]), iters, device, warmup), 4)
                        del q, k, v
                    del c, out
                row["tree_over_sdpa"] = round(row["kernel_random_ms"] / row["sdpa_chain_ms"], 3)
                rows.append(row)
    return {"shape": dict(shape, dtype="bfloat16", page=16), "rows": rows, "skipped": skipped}


# ------------------------------------------------------------- c. verify cost

def _decoder(cfg: dict, device: str, dtype, seed: int = 0):
    """Random weights of a Llama-style decoder (fused QKV and gate/up)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    h, d = cfg["hidden"], cfg["head_size"]
    qkv = (cfg["heads"] + 2 * cfg["kv_heads"]) * d

    def w(*shape):
        t = torch.empty(*shape, device=device, dtype=dtype)
        return t.normal_(0.0, shape[-1] ** -0.5, generator=g)

    layers = [dict(qkv=w(qkv, h), o=w(h, cfg["heads"] * d), gate_up=w(2 * cfg["intermediate"], h),
                   down=w(h, cfg["intermediate"]),
                   n1=torch.ones(h, device=device, dtype=dtype),
                   n2=torch.ones(h, device=device, dtype=dtype))
              for _ in range(cfg["layers"])]
    return dict(embed=w(cfg["vocab"], h), layers=layers, norm=torch.ones(h, device=device,
                                                                        dtype=dtype),
                lm_head=w(cfg["vocab"], h))


def _rms(x, weight, eps=1e-5):
    import torch

    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


def _rope(x, pos, base=500000.0):
    import torch

    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos.float()[..., None] * inv                      # [B, n, d/2]
    cos, sin = ang.cos()[:, None].to(x.dtype), ang.sin()[:, None].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _forward(cfg, model, caches, tokens, ctx: int):
    """N new tokens per request after ``ctx`` cached ones: writes their K/V at
    positions ctx .. ctx+N-1 and returns the logits of every new token (what a
    verify step needs)."""
    import torch

    bsz, n = tokens.shape
    h, d, nh, nkv = cfg["hidden"], cfg["head_size"], cfg["heads"], cfg["kv_heads"]
    pos = torch.arange(ctx, ctx + n, device=tokens.device)[None].expand(bsz, n)
    x = model["embed"][tokens]                               # [B, n, h]
    for layer, (kc, vc) in zip(model["layers"], caches):
        y = _rms(x, layer["n1"])
        qkv = y @ layer["qkv"].t()
        q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
        q = _rope(q.view(bsz, n, nh, d).transpose(1, 2), pos)
        k = _rope(k.view(bsz, n, nkv, d).transpose(1, 2), pos)
        kc[:bsz, :, ctx:ctx + n] = k
        vc[:bsz, :, ctx:ctx + n] = v.view(bsz, n, nkv, d).transpose(1, 2)
        # no mask among the n new tokens (at most n^2/2 extra scores: under 6%
        # of the attention at n = 128 over 1k keys), so that torch's
        # FlashAttention kernel runs and CUDA graphs capture
        a = sdpa_chain(q, kc[:bsz, :, :ctx + n], vc[:bsz, :, :ctx + n], d ** -0.5,
                       causal=False)
        x = x + a.transpose(1, 2).reshape(bsz, n, nh * d) @ layer["o"].t()
        y = _rms(x, layer["n2"])
        gate, up = (y @ layer["gate_up"].t()).chunk(2, dim=-1)
        x = x + (torch.nn.functional.silu(gate) * up) @ layer["down"].t()
    return _rms(x, model["norm"]) @ model["lm_head"].t()


def fit_line(tokens: list[float], ms: list[float]) -> dict:
    """Least squares ms = a + b * tokens, with R^2."""
    n = len(tokens)
    mx, my = sum(tokens) / n, sum(ms) / n
    sxx = sum((x - mx) ** 2 for x in tokens)
    b = sum((x - mx) * (y - my) for x, y in zip(tokens, ms)) / sxx if sxx > 0 else 0.0
    a = my - b * mx
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(tokens, ms))
    ss_tot = sum((y - my) ** 2 for y in ms)
    return {"a_ms": round(a, 4), "b_ms_per_token": round(b, 6),
            "b_over_a": round(b / a, 6) if a > 0 else None,
            "r2": round(1 - ss_res / ss_tot, 4) if ss_tot > 0 else None}


def section_verify_cost(device: str, smoke: bool, budget: Budget) -> dict:
    import torch

    if smoke:
        cfg, contexts, batches, ns, iters, dtype = TINY, [8, 16], [1, 2], [1, 2, 4], 1, \
            torch.float32
    else:
        cfg, contexts, batches, iters, dtype = LLAMA8B, [1024, 4096], [1, 8, 32], 5, \
            torch.bfloat16
        ns = [1, 2, 4, 8, 16, 32, 64, 128]
    model = _decoder(cfg, device, dtype)
    max_len = max(contexts) + max(ns)
    caches = [(torch.randn(max(batches), cfg["kv_heads"], max_len, cfg["head_size"],
                           device=device, dtype=dtype),
               torch.randn(max(batches), cfg["kv_heads"], max_len, cfg["head_size"],
                           device=device, dtype=dtype)) for _ in range(cfg["layers"])]
    use_graphs = device == "cuda"
    rows, skipped, graph_errors = [], [], []
    for ctx in contexts:
        for batch in batches:
            for n in ns:
                if budget.left() < 0:
                    skipped.append(f"{ctx}/{batch}/{n}")
                    continue
                tokens = torch.randint(0, cfg["vocab"], (batch, n), device=device)
                step = lambda: _forward(cfg, model, caches, tokens, ctx)  # noqa: E731
                row = dict(context=ctx, batch=batch, n=n, tokens=batch * n)
                with torch.inference_mode():
                    row["eager_ms"] = round(time_ms(step, iters, device, warmup=1), 4)
                    if use_graphs:
                        try:
                            s = torch.cuda.Stream()
                            s.wait_stream(torch.cuda.current_stream())
                            with torch.cuda.stream(s):
                                step()
                            torch.cuda.current_stream().wait_stream(s)
                            graph = torch.cuda.CUDAGraph()
                            with torch.cuda.graph(graph):
                                step()
                            row["graph_ms"] = round(time_ms(graph.replay, iters, device), 4)
                            del graph
                        except Exception as e:  # noqa: BLE001 - recorded; eager still counts
                            graph_errors.append(f"{ctx}/{batch}/{n}: {e!r}"[:300])
                            use_graphs = False
                rows.append(row)
    del model, caches
    if device == "cuda":
        torch.cuda.empty_cache()
    fits = {}
    for ctx in contexts:
        for batch in batches:
            pts = [r for r in rows if r["context"] == ctx and r["batch"] == batch]
            if len(pts) < 2:
                continue
            col = "graph_ms" if all("graph_ms" in r for r in pts) else "eager_ms"
            fits[f"{ctx}/{batch}"] = dict(fit_line([r["tokens"] for r in pts],
                                                   [r[col] for r in pts]), timing=col)
    return {"model": dict(cfg, dtype=str(dtype).removeprefix("torch.")), "rows": rows,
            "fits": fits, "skipped": skipped, "graph_errors": graph_errors,
            "note": "tokens = batch * N (tokens verified per step); fits per context/batch "
                    "over N, CUDA-graph timings where every point has one"}


# ------------------------------------------------------ d. cuda_kv and warm-up

def _flash_cache(num_blocks, heads, block, head_size, order, seed, dtype, device):
    """A ``[B, H, N, 2D]`` view with physical axis order ``order`` (LBNHC: two
    layers per block, layer 1), the same values and strides on any device."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    shape = {"B": num_blocks, "H": heads, "N": block, "C": 2 * head_size}
    if order == "LBNHC":
        raw = torch.randn(num_blocks, 2, block, heads, 2 * head_size, generator=gen)
        return raw.to(device=device, dtype=dtype)[:, 1].permute(0, 2, 1, 3)
    raw = torch.randn(*(shape[a] for a in order), generator=gen)
    return raw.to(device=device, dtype=dtype).permute(*(order.index(a) for a in "BHNC"))


def section_cuda_kv(device: str, smoke: bool, budget: Budget) -> dict:
    import torch

    from vllm_specplug.vllm_adapter.v1 import cuda_kv

    block, rows = 16, []
    for order in ("BHNC", "BNHC", "LBNHC"):
        for dtype in (torch.bfloat16, torch.float16):
            cpu = _flash_cache(12, 4, block, 64, order, len(rows), dtype, "cpu")
            dev = _flash_cache(12, 4, block, 64, order, len(rows), dtype, device)
            assert dev.stride() == cpu.stride() and torch.equal(dev.cpu(), cpu)
            slots = torch.randperm(12 * block, generator=torch.Generator().manual_seed(1))[:70]
            k_c, v_c = cuda_kv.gather(cpu, slots)
            k_d, v_d = cuda_kv.gather(dev, slots.to(device))
            gather_ok = torch.equal(k_d.cpu(), k_c) and torch.equal(v_d.cpu(), v_c)
            # compaction-like (order-free) and arbitrary (sequential) moves
            src, dst = [20, 23, 40, 47], [18, 19, 37, 38]
            arb_src, arb_dst = [5, 9, 30, 9, 60], [9, 61, 5, 2, 5]
            moves_ok = True
            for s, t in ((src, dst), (arb_src, arb_dst)):
                cuda_kv.move(cpu, s, t)
                cuda_kv.move(dev, s, t)
                moves_ok &= torch.equal(dev.cpu(), cpu)
            rows.append(dict(order=order, dtype=str(dtype).removeprefix("torch."),
                             device_strides=list(dev.stride()), cpu_strides=list(cpu.stride()),
                             gather_equal=bool(gather_ok), moves_equal=bool(moves_ok)))
    layouts = {"cpu": cuda_kv.layout_of(torch.zeros(2, 1, block, 8)),
               device: cuda_kv.layout_of(torch.zeros(2, 1, block, 8, device=device))}
    want = {"cpu": cuda_kv.CPU_VEC, "cuda": cuda_kv.FLASH}
    return {"rows": rows, "layout_of": layouts,
            "all_ok": all(r["gather_equal"] and r["moves_equal"] for r in rows)
            and all(layouts[k] == want[k] for k in layouts)}


def _compiled_variants(fn) -> int | None:
    """How many variants Triton compiled for ``fn`` (None: not readable)."""
    caches = getattr(fn, "device_caches", None)
    if caches is None:
        caches = getattr(fn, "cache", None)
        return sum(len(v) for v in caches.values()) if isinstance(caches, dict) else None
    try:
        return sum(len(v[0]) for v in caches.values())
    except (TypeError, IndexError, KeyError):
        return None


def section_warm_up(device: str, smoke: bool, budget: Budget) -> dict:
    import torch

    from vllm_specplug.kernels import tree_attention_triton as kt

    heads, kv_heads, head_size = (4, 2, 16) if smoke else (32, 8, 128)
    out = {}
    for dtype in (torch.bfloat16,) if smoke else (torch.bfloat16, torch.float16):
        # a flash-layout cache view as vLLM hands it (kv heads before tokens)
        kv = torch.zeros(8, kv_heads, 16, 2 * head_size, dtype=dtype, device=device)
        from vllm_specplug.vllm_adapter.v1 import cuda_kv

        k_cache, v_cache = cuda_kv.split_kv(kv)
        q = torch.randn(256, heads, head_size, dtype=dtype, device=device)
        table = torch.zeros(4, 33, dtype=torch.int32, device=device)
        t = time.perf_counter()
        counts = kt.warm_up(q, k_cache, v_cache, table, head_size ** -0.5)
        sync(device)
        warm_s = time.perf_counter() - t
        before = _compiled_variants(kt._tree_attention_kernel)
        gen = torch.Generator().manual_seed(5)
        t = time.perf_counter()
        for _ in range(2 if smoke else 24):   # serving: random batches of random trees
            r = int(torch.randint(1, 4, (1,), generator=gen))
            ns = [int(x) for x in torch.randint(1, 65, (r,), generator=gen)]
            # as tree_runtime.build_flash_args: views of one int64 buffer
            host = torch.zeros(4 * r + r * max(ns), dtype=torch.int64)
            cols, bits = host[: 4 * r].view(4, r), host[4 * r:].view(r, max(ns))
            for i, n in enumerate(ns):
                cols[:, i] = torch.tensor([i, 5, n, sum(ns[:i])])
                bits[i, :n] = torch.tensor(ancestor_bits(random_parents(gen, n, "random")))
            dev = host.to(device)
            kt.paged_tree_attention(q, k_cache, v_cache, table[:r], dev[r: 2 * r],
                                    dev[2 * r: 3 * r], dev[3 * r: 4 * r],
                                    dev[4 * r:].view(r, max(ns)), head_size ** -0.5,
                                    check_inputs=False)
        sync(device)
        after = _compiled_variants(kt._tree_attention_kernel)
        out[str(dtype).removeprefix("torch.")] = dict(
            warm_node_counts=counts, warm_up_s=round(warm_s, 3),
            serving_s=round(time.perf_counter() - t, 3), variants_after_warm_up=before,
            variants_after_serving=after,
            no_compile_while_serving=(None if before is None else before == after))
    return out


# --------------------------------------------------------------------- main

SECTIONS = {"a": ("correctness", section_correctness),
            "b": ("kernel_speed", section_kernel_speed),
            "c": ("verify_cost", section_verify_cost),
            "d": ("cuda_kv", section_cuda_kv)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import torch
    import triton

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available (use --smoke for a CPU run)", file=sys.stderr)
        return 2
    budget = Budget(args.time_budget)
    t0 = time.monotonic()
    summary: dict = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
        "capability": list(torch.cuda.get_device_capability()) if device == "cuda" else None,
        "torch": torch.__version__, "triton": triton.__version__, "smoke": args.smoke,
        "vllm_imported": False, "seconds": {}, "errors": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        summary["vllm_imported"] = "vllm" in sys.modules
        summary["total_s"] = round(time.monotonic() - t0, 2)
        out.write_text(json.dumps(summary, indent=1))

    for key in args.sections.split(","):
        name, fn = SECTIONS[key.strip()]
        t = time.monotonic()
        try:
            summary[name] = fn(device, args.smoke, budget)
            if key.strip() == "d":
                summary["warm_up"] = section_warm_up(device, args.smoke, budget)
        except Exception:  # noqa: BLE001 - recorded; the other sections still run
            summary["errors"][name] = traceback.format_exc()[-4000:]
        summary["seconds"][name] = round(time.monotonic() - t, 2)
        if device == "cuda":
            torch.cuda.empty_cache()
        write()
        print(f"{name}: {summary['seconds'][name]} s", flush=True)
    ok = (not summary["errors"] and summary.get("correctness", {}).get("all_ok", True)
          and summary.get("cuda_kv", {}).get("all_ok", True))
    summary["ok"] = bool(ok)
    write()
    print(json.dumps({k: summary[k] for k in ("device", "ok", "total_s", "seconds")}))
    if summary["errors"]:
        print(json.dumps(summary["errors"], indent=1), file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
