"""Device check of the Triton tree-attention kernel: correctness at realistic
sizes against the torch reference, and timings. Needs torch + Triton only
(not vLLM). Prints one JSON summary; exits 1 if a correctness check fails.

Usage (GPU):  python scripts/device_check_tree_attention.py
              [--requests 8 --prefix 2000 --nodes 64 --heads 32 --kv-heads 8
               --head-size 128 --page 16 --dtype bfloat16 --iters 50]
Smoke run of this script on CPU (Triton interpreter, tiny sizes, timings
meaningless): python scripts/device_check_tree_attention.py --cpu-interpret

Timings (ms per call, batch of all requests):
  kernel_tree    the kernel with random trees of ``--nodes`` nodes
  kernel_chain   the same kernel with chains (causal mask) of as many nodes
  reference      tree_attention_reference (torch, one loop per request)
  sdpa_chain     torch SDPA over contiguous (unpaged) K/V with a bottom-right
                 causal mask: what a plain chain verify costs, as a yardstick
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

# Pass: |out - ref| <= 1e-5 + 2 * u * (max|v| + |ref|), u the dtype's unit roundoff
# (as in tests/test_tree_attention_triton.py).
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=2000)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=list(UNIT_ROUNDOFF))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--cpu-interpret", action="store_true",
                    help="run tiny sizes on CPU under the Triton interpreter")
    args = ap.parse_args()
    if args.cpu_interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
        args.requests, args.prefix, args.nodes = 2, 40, 9
        args.heads, args.kv_heads, args.head_size, args.iters = 4, 2, 64, 2
    return args


def random_parents(gen, n: int, chain: bool) -> list[int]:
    import torch

    if chain:
        return list(range(-1, n - 1))
    # random tree with deep-ish branches, as drafts have
    return [-1 if i == 0 else int(torch.randint(max(-1, i - 4), i, (1,), generator=gen))
            for i in range(n)]


def build(args, dtype, device, *, prefixes, counts, chain: bool, seed: int) -> dict:
    """Paged inputs: shuffled blocks, one gap row (the root's) before each
    request's node rows; also the contiguous K/V for the SDPA yardstick."""
    import torch

    from vllm_specplug.kernels.tree_attention_triton import ancestor_bits_from_parents

    gen = torch.Generator().manual_seed(seed)
    page, hkv, d = args.page, args.kv_heads, args.head_size
    blocks = [math.ceil((p + n) / page) for p, n in zip(prefixes, counts)]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(counts), max(blocks), dtype=torch.int32)
    k_cache = torch.randn(num_blocks, page, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, page, hkv, d, generator=gen).to(dtype)
    bits = torch.zeros(len(counts), max(counts), dtype=torch.int64)
    parents, used = [], 0
    for r, n in enumerate(counts):
        table[r, :blocks[r]] = perm[used: used + blocks[r]]
        used += blocks[r]
        parents.append(random_parents(gen, n, chain))
        bits[r, :n] = ancestor_bits_from_parents(parents[-1])
    query_start = [sum(counts[:r]) + r + 1 for r in range(len(counts))]
    q = torch.randn(sum(counts) + len(counts) + 1, args.heads, d, generator=gen).to(dtype)
    node_rows = torch.cat([torch.arange(s, s + n) for s, n in zip(query_start, counts)])
    on = dict(device=device)
    return dict(q=q.to(**on), k_cache=k_cache.to(**on), v_cache=v_cache.to(**on),
                block_table=table.to(**on), prefix_lens=torch.tensor(prefixes, **on),
                node_counts=torch.tensor(counts, **on),
                query_start=torch.tensor(query_start, **on), ancestor_bits=bits.to(**on),
                node_rows=node_rows.to(**on), scale=d ** -0.5)


def masks_from_bits(c: dict) -> list:
    import torch

    out = []
    for r, n in enumerate(c["node_counts"].tolist()):
        b = c["ancestor_bits"][r, :n].cpu()
        j = torch.arange(n)
        out.append(((b[:, None] >> j[None, :]) & 1).bool())
    return out


def run_kernel(c: dict):
    from vllm_specplug.kernels.tree_attention_triton import paged_tree_attention

    return paged_tree_attention(c["q"], c["k_cache"], c["v_cache"], c["block_table"],
                                c["prefix_lens"], c["node_counts"], c["query_start"],
                                c["ancestor_bits"], c["scale"], check_inputs=False)


def run_reference(c: dict, masks, upcast: bool = False):
    from vllm_specplug.kernels.tree_attention_triton import tree_attention_reference

    f = (lambda t: t.float()) if upcast else (lambda t: t)
    return tree_attention_reference(f(c["q"][c["node_rows"]]), f(c["k_cache"]),
                                    f(c["v_cache"]), c["block_table"], c["prefix_lens"],
                                    c["node_counts"], masks, c["scale"])


def check(args, dtype_name: str, device: str) -> dict:
    """Kernel vs fp32 reference with varied prefix lengths and node counts."""
    import torch

    n_req = args.requests
    prefixes = [max(1, args.prefix - 97 * r) for r in range(n_req)]
    counts = [args.nodes if r % 3 else max(1, args.nodes - 7 * r) for r in range(n_req)]
    c = build(args, getattr(torch, dtype_name), device, prefixes=prefixes, counts=counts,
              chain=False, seed=1)
    out = run_kernel(c)[c["node_rows"]].float()
    ref = run_reference(c, masks_from_bits(c), upcast=True)
    err = (out - ref).abs()
    v_max = float(c["v_cache"].float().abs().max())
    tol = 1e-5 + 2 * UNIT_ROUNDOFF[dtype_name] * (v_max + ref.abs())
    ratio = float((err / tol).max())
    return {"max_abs": float(err.max()), "tolerance_ratio": round(ratio, 4),
            "ok": bool(ratio <= 1.0 and not out.isnan().any())}


def time_ms(fn, iters: int, device: str) -> float:
    import torch

    fn()  # warm-up (and compile)
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


def sdpa_chain(args, c: dict):
    """Chain attention over contiguous K/V with torch SDPA (bottom-right causal)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    n, p = int(c["node_counts"][0]), int(c["prefix_lens"][0])
    page, hkv, d = args.page, args.kv_heads, args.head_size
    pos = torch.arange(p + n, device=c["q"].device)
    ks, vs = [], []
    for r in range(c["block_table"].shape[0]):
        slots = c["block_table"][r, pos // page].long() * page + pos % page
        ks.append(c["k_cache"].view(-1, hkv, d)[slots].transpose(0, 1))
        vs.append(c["v_cache"].view(-1, hkv, d)[slots].transpose(0, 1))
    group = args.heads // hkv
    k = torch.stack(ks).repeat_interleave(group, dim=1)   # [R, H, P+n, D]
    v = torch.stack(vs).repeat_interleave(group, dim=1)
    q = c["q"][c["node_rows"]].view(-1, n, args.heads, d).transpose(1, 2).contiguous()
    mask = causal_lower_right(n, p + n)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=c["scale"])


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch
    import triton

    device = "cpu" if args.cpu_interpret else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("CUDA is not available (use --cpu-interpret for a CPU smoke run)")
    if not 1 <= args.nodes <= 64:
        sys.exit("--nodes must be in 1..64")
    summary: dict = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__, "triton": triton.__version__,
        "config": {k: v for k, v in vars(args).items() if k != "cpu_interpret"},
        "correctness": {}, "timings_ms": {}, "errors": {}}
    for dtype_name in UNIT_ROUNDOFF:
        try:
            summary["correctness"][dtype_name] = check(args, dtype_name, device)
        except Exception as e:  # noqa: BLE001 - reported in the summary
            summary["correctness"][dtype_name] = {"ok": False, "error": repr(e)}

    dtype = getattr(torch, args.dtype)
    same = dict(prefixes=[args.prefix] * args.requests, counts=[args.nodes] * args.requests)
    tree = build(args, dtype, device, chain=False, seed=2, **same)
    chain = build(args, dtype, device, chain=True, seed=2, **same)
    tree_masks = masks_from_bits(tree)
    bench = {
        "kernel_tree": lambda: run_kernel(tree),
        "kernel_chain": lambda: run_kernel(chain),
        "reference": lambda: run_reference(tree, tree_masks),
    }
    for name, fn in bench.items():
        try:
            iters = max(1, args.iters // 10) if name == "reference" else args.iters
            summary["timings_ms"][name] = round(time_ms(fn, iters, device), 4)
        except Exception as e:  # noqa: BLE001
            summary["errors"][name] = repr(e)
    try:
        summary["timings_ms"]["sdpa_chain"] = round(time_ms(sdpa_chain(args, chain),
                                                            args.iters, device), 4)
    except Exception as e:  # noqa: BLE001
        summary["errors"]["sdpa_chain"] = repr(e)
    t = summary["timings_ms"]
    if "kernel_tree" in t:
        for other in ("kernel_chain", "reference", "sdpa_chain"):
            if other in t:
                summary[f"{other}_over_kernel_tree"] = round(t[other] / t["kernel_tree"], 3)
    print(json.dumps(summary, indent=1))
    if not all(v.get("ok") for v in summary["correctness"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
