"""Masked paged tree attention: Triton kernel vs torch reference vs brute force.

With CUDA the kernel runs on the GPU in fp16/bf16/fp32. Without it the kernel
runs under Triton's CPU interpreter, which must be chosen before Triton is
imported: one subprocess (this file run as a script) runs every interpreter
case, and the tests here read its results. Without Triton the kernel tests
skip; the reference and bitmask tests need only torch.

Tolerance, against the fp32 reference on the same (already rounded) inputs,
elementwise: ``|out - ref| <= 1e-5 + 2 * u * (max|v| + |ref|)`` with ``u`` the
unit roundoff of the dtype (2^-24 fp32, 2^-11 fp16, 2^-8 bf16). Like
FlashAttention the kernel rounds the softmax weights to the 16-bit dtype
before the P @ V product (absolute error up to ``u * max|v|``) and rounds the
output (up to ``u * |ref|``); the factor 2 is slack. For fp32 this is about
1e-5 absolute.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_specplug.kernels.tree_attention_triton import (  # noqa: E402
    MAX_TREE_NODES, ancestor_bits_from_parents, tree_attention_reference)
from vllm_specplug.tree import ancestor_mask  # noqa: E402

UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
DTYPES = list(UNIT_ROUNDOFF)
SENTINEL = 7.0  # rows of `out` that are not draft nodes must keep it


def tolerance(dtype_name: str, ref: torch.Tensor, v_max: float) -> torch.Tensor:
    return 1e-5 + 2 * UNIT_ROUNDOFF[dtype_name] * (v_max + ref.abs())


# ----------------------------------------------------------------- test data

def random_parents(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    if kind == "chain":
        return np.arange(-1, n - 1, dtype=np.int32)
    if kind == "star":
        return np.full(n, -1, dtype=np.int32)
    # random tree, biased towards deep-ish branches like real drafts
    return np.array([-1 if i == 0 else int(rng.integers(max(-1, i - 4), i))
                     for i in range(n)], dtype=np.int32)


# Each case: requests as (prefix_len, tree kind, n); heads; kv heads; head size;
# page size; q multiplier (a large one makes peaked softmaxes); gaps: extra
# query rows before each request's nodes (as the root rows are in vLLM);
# strided: q and the caches are non-contiguous views, block table int64.
CASES = {
    "mixed_gqa2": dict(reqs=[(37, "random", 7), (16, "chain", 5), (1, "random", 1),
                             (50, "star", 9), (20, "random", 12)],
                       heads=4, kv_heads=2, head_size=64, page=16, q_mul=1.0, gaps=True),
    "n64_mha": dict(reqs=[(23, "random", 64), (64, "chain", 64), (5, "random", 30)],
                    heads=2, kv_heads=2, head_size=64, page=16, q_mul=1.0, gaps=False),
    "peaked_page32": dict(reqs=[(100, "random", 13), (33, "chain", 1)],
                          heads=4, kv_heads=2, head_size=64, page=32, q_mul=4.0, gaps=True,
                          strided=True),
    "head80_gqa4": dict(reqs=[(70, "random", 20), (8, "random", 3)],
                        heads=4, kv_heads=1, head_size=80, page=16, q_mul=1.0, gaps=False),
}
CUDA_ONLY_CASES = {
    "large": dict(reqs=[(1000, "random", 64), (517, "chain", 64), (2049, "random", 40),
                        (1, "random", 1)],
                  heads=32, kv_heads=8, head_size=128, page=16, q_mul=1.0, gaps=True),
}


def make_case(spec: dict, dtype: torch.dtype, device: str, seed: int = 0) -> dict:
    """Random paged inputs. KV slots no request owns hold NaN, so reading one
    shows up in the output."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    page, hkv, d, h = spec["page"], spec["kv_heads"], spec["head_size"], spec["heads"]
    parents = [random_parents(rng, n, kind) for _, kind, n in spec["reqs"]]
    prefix_lens = [p for p, _, _ in spec["reqs"]]
    counts = [len(p) for p in parents]
    blocks = [math.ceil((p + n) / page) for p, n in zip(prefix_lens, counts)]
    num_blocks = sum(blocks) + 5
    perm = rng.permutation(num_blocks)
    table = torch.full((len(blocks), max(blocks) + 2), num_blocks - 1, dtype=torch.int32)
    k_cache = torch.full((num_blocks, page, hkv, d), float("nan"))
    v_cache = torch.full((num_blocks, page, hkv, d), float("nan"))
    k_seq, v_seq = [], []
    used = 0
    for r, (plen, n) in enumerate(zip(prefix_lens, counts)):
        table[r, :blocks[r]] = torch.from_numpy(perm[used: used + blocks[r]])
        used += blocks[r]
        pos = torch.arange(plen + n)
        slots = table[r, pos // page].long() * page + pos % page
        k = torch.randn(plen + n, hkv, d, generator=gen).to(dtype)
        v = torch.randn(plen + n, hkv, d, generator=gen).to(dtype)
        k_cache.view(-1, hkv, d)[slots] = k.float()
        v_cache.view(-1, hkv, d)[slots] = v.float()
        k_seq.append(k)
        v_seq.append(v)
    gap = 1 if spec["gaps"] else 0
    query_start = [sum(counts[:r]) + gap * (r + 1) for r in range(len(counts))]
    total = sum(counts) + gap * (len(counts) + 1)
    q = (torch.randn(total, h, d, generator=gen) * spec["q_mul"]).to(dtype)
    bits = torch.zeros(len(counts), MAX_TREE_NODES, dtype=torch.int64)
    for r, p in enumerate(parents):
        bits[r, :len(p)] = ancestor_bits_from_parents(p)
    node_rows = torch.cat([torch.arange(s, s + n) for s, n in zip(query_start, counts)])
    as_dev = dict(device=device)
    q = q.to(**as_dev)
    k_cache, v_cache = k_cache.to(dtype).to(**as_dev), v_cache.to(dtype).to(**as_dev)
    if spec.get("strided"):  # views made on the device (.to() may make them contiguous)
        pad = torch.randn(total, 3, d, generator=gen).to(dtype).to(**as_dev)
        q = torch.cat([q, pad], dim=1)[:, :h]
        k_cache, v_cache = torch.stack([k_cache, v_cache], dim=1).unbind(1)
        table = table.long()
        assert not (q.is_contiguous() or k_cache.is_contiguous())
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache, block_table=table.to(**as_dev),
        prefix_lens=torch.tensor(prefix_lens, **as_dev),
        node_counts=torch.tensor(counts, **as_dev),
        query_start=torch.tensor(query_start, **as_dev), ancestor_bits=bits.to(**as_dev),
        scale=d ** -0.5, parents=parents, node_rows=node_rows.to(**as_dev),
        k_seq=k_seq, v_seq=v_seq)


def kernel_error(name: str, spec: dict, dtype_name: str, device: str) -> dict:
    """Max abs error of the kernel against the fp32 reference, and the max of
    ``|out - ref| / tolerance`` (must be <= 1); raises if rows outside the
    draft nodes were written."""
    from vllm_specplug.kernels.tree_attention_triton import paged_tree_attention

    dtype = getattr(torch, dtype_name)
    c = make_case(spec, dtype, device, seed=zlib.crc32(name.encode()))
    out = torch.full_like(c["q"], SENTINEL)
    res = paged_tree_attention(c["q"], c["k_cache"], c["v_cache"], c["block_table"],
                               c["prefix_lens"], c["node_counts"], c["query_start"],
                               c["ancestor_bits"], c["scale"], out=out)
    assert res is out and out.dtype == dtype
    others = torch.ones(out.shape[0], dtype=torch.bool, device=device)
    others[c["node_rows"]] = False
    if not bool((out[others] == SENTINEL).all()):
        raise AssertionError("kernel wrote rows that are not draft nodes")
    ref = tree_attention_reference(
        c["q"][c["node_rows"]].float(), c["k_cache"].float(), c["v_cache"].float(),
        c["block_table"], c["prefix_lens"], c["node_counts"],
        [ancestor_mask(p) for p in c["parents"]], c["scale"])
    err = (out[c["node_rows"]].float() - ref).abs()
    v_max = max(float(v.float().abs().max()) for v in c["v_seq"])
    ratio = err / tolerance(dtype_name, ref, v_max).to(err.device)
    return {"max_abs": float(err.max()), "ratio": float(ratio.max())}


# ------------------------------------------------------- reference and bitmask

def brute_force(c: dict) -> torch.Tensor:
    """Per node and head: softmax over the prefix and the node's ancestors
    (found by walking parents), in float64, on the unpaged K/V."""
    q = c["q"][c["node_rows"]].double()
    h, hkv = q.shape[1], c["k_seq"][0].shape[1]
    out = torch.empty_like(q)
    row = 0
    for plen, parents, k, v in zip(c["prefix_lens"].tolist(), c["parents"], c["k_seq"],
                                   c["v_seq"]):
        for i in range(len(parents)):
            keys, j = list(range(plen)), i
            while j >= 0:
                keys.append(plen + j)
                j = int(parents[j])
            for head in range(h):
                kv = head // (h // hkv)
                scores = [float(q[row, head] @ k[p, kv].double()) * c["scale"] for p in keys]
                top = max(scores)
                w = [math.exp(s - top) for s in scores]
                acc = sum(wi * v[p, kv].double() for wi, p in zip(w, keys))
                out[row, head] = acc / sum(w)
            row += 1
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_reference_against_brute_force(name):
    c = make_case(CASES[name], torch.float32, "cpu", seed=zlib.crc32(name.encode()) + 1)
    masks = [ancestor_mask(p) for p in c["parents"]]
    if name == "n64_mha":  # the padded [R, N, N] form of the mask
        padded = torch.zeros(len(masks), 64, 64, dtype=torch.bool)
        for r, m in enumerate(masks):
            padded[r, :m.shape[0], :m.shape[0]] = torch.from_numpy(m)
        masks = padded
    ref = tree_attention_reference(c["q"][c["node_rows"]], c["k_cache"], c["v_cache"],
                                   c["block_table"], c["prefix_lens"], c["node_counts"],
                                   masks, c["scale"])
    assert ref.dtype == torch.float32 and not ref.isnan().any()
    torch.testing.assert_close(ref.double(), brute_force(c), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind,n", [("random", 0), ("random", 1), ("random", 17),
                                    ("random", 64), ("chain", 64), ("star", 64),
                                    ("chain", 63)])
def test_ancestor_bits_match_ancestor_mask(kind, n):
    parents = random_parents(np.random.default_rng(n), n, kind)
    bits = ancestor_bits_from_parents(parents)
    assert bits.dtype == torch.int64 and bits.shape == (n,)
    mask = ancestor_mask(parents)
    for i, b in enumerate(bits.tolist()):
        got = [bool((b >> j) & 1) for j in range(MAX_TREE_NODES)]
        assert got[:n] == mask[i].tolist()
        assert not any(got[n:])
    assert torch.equal(ancestor_bits_from_parents(torch.from_numpy(parents)), bits)


def test_ancestor_bits_rejects_large_or_bad_trees():
    with pytest.raises(ValueError, match="at most 64"):
        ancestor_bits_from_parents(np.arange(-1, 64))
    with pytest.raises(ValueError):
        ancestor_bits_from_parents([-1, 1])  # parent after child


def test_kernel_rejects_more_than_64_nodes():
    pytest.importorskip("triton", reason="Triton is not installed")
    from vllm_specplug.kernels.tree_attention_triton import paged_tree_attention

    c = make_case(CASES["n64_mha"], torch.float32, "cpu")
    args = [c[k] for k in ("q", "k_cache", "v_cache", "block_table", "prefix_lens",
                           "node_counts", "query_start", "ancestor_bits")]
    wide = torch.zeros(3, 65, dtype=torch.int64)
    with pytest.raises(ValueError, match="at most 64"):
        paged_tree_attention(*args[:7], wide, c["scale"])
    args[5] = torch.tensor([65, 1, 1])
    with pytest.raises(ValueError, match="at most 64"):
        paged_tree_attention(*args, c["scale"])


# ------------------------------------------------------------------- kernel

def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


ON_CUDA = torch.cuda.is_available()
KERNEL_CASES = {**CASES, **(CUDA_ONLY_CASES if ON_CUDA else {})}


@pytest.fixture(scope="module")
def interpreter_errors() -> dict:
    """Kernel errors of every (case, dtype), from one interpreter subprocess."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, __file__, "--interpreter"], env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"interpreter subprocess failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _triton_available(), reason="Triton is not installed")
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_matches_reference(name, dtype_name, request):
    if ON_CUDA:
        err = kernel_error(name, KERNEL_CASES[name], dtype_name, "cuda")
    else:
        err = request.getfixturevalue("interpreter_errors")[f"{name}/{dtype_name}"]
        if isinstance(err, str):
            pytest.fail(err)
    assert err["ratio"] <= 1.0, (f"max abs error {err['max_abs']:.3g}, "
                                 f"{err['ratio']:.3g}x the tolerance somewhere")


def _interpreter_main() -> None:
    """Run every case under the interpreter; print {"case/dtype": errors or traceback}."""
    import traceback

    assert os.environ.get("TRITON_INTERPRET") == "1"
    results: dict = {}
    for name, spec in CASES.items():
        for dtype_name in DTYPES:
            try:
                results[f"{name}/{dtype_name}"] = kernel_error(name, spec, dtype_name, "cpu")
            except Exception:  # noqa: BLE001 - reported to the parent test
                results[f"{name}/{dtype_name}"] = traceback.format_exc()
    print(json.dumps(results))



# ------------------------------------------------------------- warm-up

class _Recorder:
    """Stands in for the Triton kernel: records each launch's compile-time
    constants (what makes Triton compile a variant) and launches nothing."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append({k: v for k, v in kwargs.items() if k.isupper()})
        return launch


@pytest.mark.skipif(not _triton_available(), reason="Triton is not installed")
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (32, 8), (64, 8), (28, 4)])
@pytest.mark.parametrize("max_nodes", [64, 16, 5])
def test_warm_up_compiles_every_variant_serving_uses(monkeypatch, heads, kv_heads, max_nodes):
    """Every tree of 1 .. max_nodes nodes (the batch's largest tree picks the
    variant) launches with constants warm_up already launched with."""
    from vllm_specplug.kernels import tree_attention_triton as kt

    rec = _Recorder()
    monkeypatch.setattr(kt, "_tree_attention_kernel", rec)
    head_size, page = 128, 16
    q = torch.zeros(8, heads, head_size, dtype=torch.bfloat16)
    kv = torch.zeros(4, page, kv_heads, head_size, dtype=torch.bfloat16)
    table = torch.zeros(3, 40, dtype=torch.int32)
    counts = kt.warm_up(q, kv, kv, table, 0.1, max_nodes=max_nodes)
    warmed = [tuple(sorted(c.items())) for c in rec.launches]
    assert len(warmed) == len(counts) == len(set(warmed))  # one launch per variant
    for n in range(1, max_nodes + 1):
        cfg = kt.launch_config(heads, kv_heads, head_size, page, torch.bfloat16, n)
        assert tuple(sorted(cfg.items())) in warmed, (n, cfg)
    # and the serving path's launcher uses exactly these constants
    rec.launches.clear()
    n = max_nodes
    kt.paged_tree_attention(q, kv, kv, table[:1], torch.tensor([3]), torch.tensor([n]),
                            torch.tensor([0]), torch.zeros(1, n, dtype=torch.int64), 0.1,
                            check_inputs=False)
    assert tuple(sorted(rec.launches[0].items())) in warmed


def test_cuda_impl_warms_up_once_per_layout(monkeypatch):
    """TreeFlashAttentionImpl (vLLM's FlashAttention forward stubbed; CPU
    tensors) warms the kernel at its first forward with an allocated cache,
    not again, and not for a second layer with the same dtypes and strides;
    an empty cache (vLLM's profile run) warms nothing."""
    pytest.importorskip("vllm")
    import vllm.v1.attention.backends.flash_attn as fa

    from vllm_specplug.kernels import tree_attention_triton as kt
    from vllm_specplug.vllm_adapter.v1 import tree_attention_cuda as tac

    rec = _Recorder()
    monkeypatch.setattr(kt, "_tree_attention_kernel", rec)
    monkeypatch.setattr(fa.FlashAttentionImpl, "forward", lambda self, *a, **k: a[6])
    monkeypatch.setattr(tac, "_WARMED", set())
    layers = [tac.TreeFlashAttentionImpl(8, 64, 0.125, 2, None, None, "auto") for _ in range(2)]
    query = torch.zeros(5, 8 * 64)
    output = torch.zeros(5, 8 * 64)
    meta = SimpleNamespace(block_table=torch.zeros(4, 9, dtype=torch.int32))
    empty = torch.zeros(0, 2, 16, 128)
    layers[0].forward(None, query, None, None, empty, meta, output)
    assert rec.launches == [] and not layers[0].tree_warm
    kv = torch.zeros(6, 16, 2, 128).permute(0, 2, 1, 3)  # [blocks, kv heads, tokens, 2 * D]
    for layer in layers:
        layer.forward(None, query, None, None, kv, meta, output)
        layer.forward(None, query, None, None, kv, meta, output)
    group = 8 // 2
    assert len(rec.launches) == len(kt.warm_up_node_counts(8, 2)) == len(
        {kt.launch_config(8, 2, 64, 16, torch.float32, n)["BLOCK_M"] for n in range(1, 65)})
    assert all(r["GROUP"] == group and r["PAGE"] == 16 for r in rec.launches)
    assert all(layer.tree_warm for layer in layers)
    assert (output == 0).all()  # vLLM's output untouched by the warm-up


if __name__ == "__main__" and "--interpreter" in sys.argv:
    _interpreter_main()
