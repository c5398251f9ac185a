"""FLASH_ATTN with tree rows fixed up after vLLM's kernel (CUDA worker only:
imports vLLM's FlashAttention backend). NOT YET RUN ON A GPU.

``install_tree_patches`` registers :class:`TreeFlashAttentionBackend` over
``AttentionBackendEnum.FLASH_ATTN`` before the model is built. vLLM's
FlashAttention forward runs as usual (draft nodes then attend causally, to
their siblings too); afterwards, when the step has tree requests, their
draft-node rows of ``output`` are recomputed by the Triton paged
tree-attention kernel (``tree_runtime.flash_tree_attention``) over this
layer's paged cache, with the per-step arguments ``prepare_tree_requests``
built (the drafter's ``step.flash``, bound to the layer at model load) and
this layer's block table from its metadata.

The metadata builder reports no CUDA graph support, so vLLM resolves the
cudagraph mode to PIECEWISE (attention outside the graphs, where this Python
code runs every step) instead of replaying full-graph decode steps that would
skip it; an explicit FULL mode is refused by vLLM with its own message.

Nothing here is meant to raise while serving; a Python-level failure of the
tree kernel's launch is contained (``StepTrees.fail_attention``: the step's
tree requests accept no draft). What the tree path cannot serve is refused
before: in process 0 (``cuda_checks.check_tree_model``), when the tree
patches are installed (``cuda_checks.check_cuda_tree_config``), when a layer
is built (:func:`_unsupported_layer`) and when vLLM builds the metadata
builders at KV-cache initialisation (``cuda_checks.check_kv_specs`` on the
built model's specs). Bidirectional multimodal prefixes need no refusal: their
ranges cover prompt tokens only, and a tree request's draft nodes are decode
tokens after them, so the nodes' attention is the same either way.

The Triton kernel's variants are compiled by ``warm_up`` at the first forward
that sees the allocated KV cache (vLLM's warm-up and capture runs, before
serving), once per distinct set of dtypes and strides.
"""
from __future__ import annotations

from vllm.v1.kv_cache_interface import is_quantized_kv_cache
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                   FlashAttentionMetadataBuilder)

from . import cuda_checks, cuda_kv
from .step_state import TreeLayerImpl
from .tree_runtime import flash_tree_attention

_WHAT = "vllm_specplug tree verification on CUDA (FLASH_ATTN + Triton tree kernel)"


def _unsupported_layer(impl: FlashAttentionImpl) -> list[str]:
    reasons = []
    if tuple(impl.sliding_window) != (-1, -1):
        reasons.append("sliding-window attention")
    if impl.alibi_slopes is not None:
        reasons.append("ALiBi")
    if impl.logits_soft_cap:
        reasons.append("logit soft-capping")
    if impl.sinks is not None:
        reasons.append("attention sinks")
    if is_quantized_kv_cache(impl.kv_cache_dtype):
        reasons.append(f"a quantized KV cache ({impl.kv_cache_dtype})")
    if impl.dcp_world_size > 1:
        reasons.append("decode context parallelism")
    return reasons


class TreeFlashAttentionImpl(TreeLayerImpl, FlashAttentionImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Only causal self-attention over the paged cache sees the draft tree;
        # encoder and cross-attention rows do not depend on sibling nodes.
        self.tree_layer = self.attn_type == AttentionType.DECODER
        if self.tree_layer:
            reasons = _unsupported_layer(self)
            if reasons:
                raise NotImplementedError(
                    f"{_WHAT} does not support {', '.join(reasons)}; use a chain method "
                    f"(e.g. sam) for this model")
        self.tree_warm = False

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                 output_scale, output_block_scale)
        if attn_metadata is not None and self.tree_layer:
            if not self.tree_warm and kv_cache.numel():
                warm_up_kernel(self, query, kv_cache, attn_metadata.block_table)
                self.tree_warm = True
            step = self.tree_step_now()   # bound at model load (step_state)
            if step is not None:
                try:
                    flash_tree_attention(self, query, kv_cache, attn_metadata.block_table,
                                         output, step.flash)
                except Exception as e:  # noqa: BLE001 - contained: no tree draft accepted
                    # (a Python-level failure: a launch or compile error; a fault
                    # inside the kernel poisons the CUDA context and cannot be)
                    step.fail_attention(e)
        return result


#: kernel variants already compiled in this process, by dtypes and strides
_WARMED: set = set()


def warm_up_kernel(impl, query, kv_cache, block_table) -> bool:
    """Compile the Triton tree kernel's variants for this layer's tensors
    (trees of 1 .. 64 nodes) unless a layer with the same dtypes and strides
    already did; True if it launched. Reads row 0 of ``query`` and one block
    of the cache; writes nothing of vLLM's."""
    from ...kernels.tree_attention_triton import warm_up

    q = query.view(-1, impl.num_heads, impl.head_size)
    k_cache, v_cache = cuda_kv.split_kv(kv_cache)
    key = (q.dtype, q.stride(), k_cache.shape[1:], k_cache.stride(), v_cache.stride(),
           block_table.dtype, block_table.shape[1], str(q.device))
    if key in _WARMED:
        return False
    warm_up(q, k_cache, v_cache, block_table, impl.scale)
    _WARMED.add(key)
    return True


class TreeFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
    # Full CUDA graphs would replay attention without the tree fix-up.
    _cudagraph_support = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        # Built at KV-cache initialisation, before any request: the built
        # model's exact specs (every group, chunked-local and sliding-window
        # layers; vLLM's chunked-local builder subclasses this one).
        cuda_checks.check_kv_specs(cuda_checks.model_kv_specs(vllm_config))
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return AttentionCGSupport.NEVER


class TreeFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[TreeFlashAttentionImpl]:
        return TreeFlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TreeFlashAttentionMetadataBuilder]:
        return TreeFlashAttentionMetadataBuilder
