"""Our reader/mover of vLLM's CPU paged KV cache agrees with vLLM's own writer
(`cpu_attn_reshape_and_cache`) for the layout we support. No engine."""
from __future__ import annotations

import pytest
import torch

ops = pytest.importorskip("vllm._custom_ops")

from vllm_specplug.vllm_adapter.v1 import cpu_kv  # noqa: E402


def _write(kv, key, val, slots, isa="vec"):
    nb, h, bs, two_d = kv.shape
    kc, vc = kv.view(nb, h, bs * 2, two_d // 2).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, val, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")


@pytest.mark.parametrize("heads, head_size, block_size", [(3, 64, 128), (2, 32, 32)])
def test_gather_reads_what_vllm_wrote(heads, head_size, block_size):
    torch.manual_seed(0)
    kv = torch.zeros(6, heads, block_size, 2 * head_size)
    n = 3 * block_size // 2
    slots = torch.randperm(6 * block_size)[:n].to(torch.int64)
    key, val = torch.randn(n, heads, head_size), torch.randn(n, heads, head_size)
    _write(kv, key, val, slots)
    k, v = cpu_kv.gather(kv, slots)
    assert torch.equal(k, key) and torch.equal(v, val)


def test_move_compacts_an_accepted_path():
    torch.manual_seed(1)
    heads, d, bs = 3, 64, 128
    kv = torch.zeros(4, heads, bs, 2 * d)
    base = 120  # the path crosses a block boundary
    nodes = 10
    slots = torch.arange(base, base + 1 + nodes, dtype=torch.int64)
    key, val = torch.randn(nodes + 1, heads, d), torch.randn(nodes + 1, heads, d)
    _write(kv, key, val, slots)
    path = [1, 4, 9]  # node indices; node i sits at offset i + 1 after the root
    src = [base + 1 + i for i in path]
    dst = [base + 1 + k for k in range(len(path))]
    cpu_kv.move(kv, src, dst)
    k, v = cpu_kv.gather(kv, torch.tensor(dst))
    want = torch.tensor([1 + i for i in path])
    assert torch.equal(k, key[want]) and torch.equal(v, val[want])
    # the root and earlier slots are untouched
    k0, _ = cpu_kv.gather(kv, torch.tensor([base]))
    assert torch.equal(k0[0], key[0])


def test_other_layouts_are_refused():
    cpu_kv.check_isa("vec")
    with pytest.raises(cpu_kv.UnsupportedKVLayout, match="amx"):
        cpu_kv.check_isa("amx")
