"""CPU check of the CUDA tree-attention impl (no GPU, no engine).

Builds ``TreeFlashAttentionImpl`` (features it refuses, then a plain layer),
replaces vLLM's FlashAttention forward (it needs CUDA) by a stub that writes 7
into every row, and runs the impl's forward on a flash-layout cache with the
real Triton kernel under Triton's CPU interpreter. Checks that only the
draft-node rows are rewritten and that they equal the CPU path's SDPA (fp32
and bf16). Needs vLLM (the CPU build is enough) and Triton; about 15 s.

Usage: python scripts/cpu_check_tree_attention_cuda.py   (prints OK or fails)
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

BLOCK = 16


def stub_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args):
    output.fill_(7.0)  # stands for vLLM's causal result in every row
    return output


def check_refusals(impl_cls) -> None:
    base = dict(num_heads=4, head_size=16, scale=0.25, num_kv_heads=2, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype="auto")
    for extra in (dict(sliding_window=4096), dict(logits_soft_cap=30.0),
                  dict(alibi_slopes=[0.5] * 4), dict(kv_cache_dtype="fp8")):
        try:
            impl_cls(**{**base, **extra})
        except NotImplementedError as e:  # ours, or FlashAttention's own fp8 refusal
            print("refused:", e)
        else:
            raise SystemExit(f"not refused: {extra}")


def make_case(dtype, rng, heads=4, kv_heads=2, d=16):
    from vllm_specplug.vllm_adapter.v1 import tree_runtime

    # batch rows: (tree or chain, root position, nodes)
    batch = [("tree", 37, 7), ("chain", 20, 3), ("tree", 15, 5), ("tree", 0, 1),
             ("tree", 70, 64)]
    need = [math.ceil((base + 1 + n) / BLOCK) for _, base, n in batch]
    num_blocks = sum(need) + 3
    perm = rng.permutation(num_blocks)
    table = np.zeros((len(batch) + 2, max(need) + 2), dtype=np.int32)
    raw = torch.full((num_blocks, 2, BLOCK, kv_heads, 2 * d), float("nan"), dtype=dtype)
    kv = raw[:, 1].permute(0, 2, 1, 3)  # layer 1 of an LBNHC-like allocation
    gen = torch.Generator().manual_seed(4)
    used, q_rows, requests, node_rows = 0, 0, [], []
    for row, (kind, base, n) in enumerate(batch):
        table[row, : need[row]] = perm[used: used + need[row]]
        used += need[row]
        pos = np.arange(base + 1 + n)
        for s in (table[row, pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK).tolist():
            kv[s // BLOCK, :, s % BLOCK] = torch.randn(kv_heads, 2 * d, generator=gen).to(dtype)
        root = q_rows
        q_rows += 1 + n
        if kind == "tree":
            parents = np.array([-1 if i == 0 else int(rng.integers(-1, i)) for i in range(n)],
                               dtype=np.int32)
            requests.append(tree_runtime.tree_request(f"r{row}", row, root, base, parents,
                                                      np.zeros(n), table[row], BLOCK))
            node_rows += range(root + 1, root + 1 + n)
    query = torch.randn(q_rows + 2, heads, d, generator=gen).to(dtype)
    return kv, table, requests, node_rows, query


def main() -> None:
    import vllm.v1.attention.backends.flash_attn as fa

    from vllm_specplug.vllm_adapter.v1 import cuda_kv, tree_runtime
    from vllm_specplug.vllm_adapter.v1.step_state import StepTrees
    from vllm_specplug.vllm_adapter.v1.tree_attention_cuda import TreeFlashAttentionImpl

    fa.FlashAttentionImpl.forward = stub_forward
    check_refusals(TreeFlashAttentionImpl)
    impl = TreeFlashAttentionImpl(4, 16, 16 ** -0.5, 2, None, None, "auto")
    assert impl.tree_layer and impl.tree_step is None
    step = impl.tree_step = StepTrees()   # bound at model load in an engine
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
        kv, table, requests, node_rows, query = make_case(dtype, np.random.default_rng(3))
        output = torch.empty_like(query)
        meta = SimpleNamespace(block_table=torch.from_numpy(table), causal=True,
                               mm_prefix_query_range_tensor=None, rswa_prefix_lens=None)
        step.requests = requests
        step.flash = tree_runtime.build_flash_args(requests, "cpu")
        step.attended = True
        try:
            impl.forward(None, query, None, None, kv, meta, output)
        finally:
            step.clear()
        others = torch.ones(len(query), dtype=torch.bool)
        others[node_rows] = False
        assert (output[others] == 7.0).all(), "rows other than draft nodes were written"
        want = torch.full(query.shape, 7.0)
        step.requests = requests
        step.groups = tree_runtime.build_groups(requests)
        try:
            tree_runtime.tree_attention(impl, query.float(), kv.float(), want, step,
                                        gather=cuda_kv.gather)
        finally:
            step.clear()
        err = (output[node_rows].float() - want[node_rows]).abs().max().item()
        print(f"{dtype}: max |kernel - CPU SDPA| over {len(node_rows)} node rows = {err:.3g}")
        assert err < tol, err
    print("OK")


if __name__ == "__main__":
    main()
