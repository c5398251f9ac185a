"""Warm vLLM's CPU GEMM primitives for the token counts a speculative step
verifies, while the engine starts.

On CPU every linear layer of the target (and its LM head) runs through a
kernel vLLM's CPU GEMM dispatch picks when the model loads
(``layer.cpu_linear``: oneDNN, the SGL packed kernel, or torch). oneDNN builds
(JIT-compiles) one primitive per layer and input row count the first time
it sees that count, and keeps 32 per layer. Plain decoding verifies one
token per request, so its counts are warm after a request or two; a
speculative step verifies 1 + the draft's nodes, a count that changes from
step to step, so each new count cost about 1 ms per layer on its first use
(here: 0.9-1.4 ms against 0.06-0.3 ms afterwards, 121 layers in
SmolLM2-135M), paid inside the first requests of every new engine. This
runs each such layer once for every count from 1 to
``min(num_speculative_tokens + 1, 32)`` at engine start (vLLM's CPU runner
has no warm-up run of its own under ``enforce_eager``).
"""
from __future__ import annotations

import time
from typing import Any

#: oneDNN primitives vLLM keeps per layer (``create_onednn_mm(..., 32)``):
#: warming more counts would evict the first ones.
PRIMITIVES_PER_LAYER = 32


def token_counts(num_speculative_tokens: int) -> range:
    """Row counts one request's verify step can have: 1 + 0..k nodes, at most
    ``PRIMITIVES_PER_LAYER`` of them."""
    return range(1, min(int(num_speculative_tokens) + 1, PRIMITIVES_PER_LAYER) + 1)


def warm_cpu_gemms(model: Any, dtype: Any, counts) -> tuple[int, float]:
    """Run every layer of ``model`` that vLLM's CPU GEMM dispatch set up
    (``cpu_linear``) once per row count in ``counts``, through the layer's
    own ``quant_method.apply`` (as its forward does). Returns (layers warmed,
    seconds)."""
    import torch
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    started = time.perf_counter()
    layers = 0
    with torch.inference_mode():
        for module in model.modules():
            if "cpu_linear" not in vars(module):
                continue   # not a layer of vLLM's CPU GEMM dispatch
            if isinstance(module, LinearBase):
                k = module.input_size_per_partition
                bias = None if module.skip_bias_add else module.bias
            elif isinstance(module, VocabParallelEmbedding):   # the LM head
                k, bias = module.embedding_dim, None
            else:
                continue
            for m in counts:
                module.quant_method.apply(module, torch.zeros(m, k, dtype=dtype), bias)
            layers += 1
    return layers, time.perf_counter() - started
