"""FLASH_ATTN with tree rows fixed up after vLLM's kernel (CUDA worker only:
imports vLLM's FlashAttention backend). NOT YET RUN ON A GPU.

``install_tree_patches`` registers :class:`TreeFlashAttentionBackend` over
``AttentionBackendEnum.FLASH_ATTN`` before the model is built. vLLM's
FlashAttention forward runs as usual (draft nodes then attend causally, to
their siblings too); afterwards, when the step has tree requests, their
draft-node rows of ``output`` are recomputed by the Triton paged
tree-attention kernel (``tree_runtime.flash_tree_attention``) over this
layer's paged cache, with the per-step arguments ``prepare_tree_requests``
built (``STEP.flash``) and this layer's block table from its metadata.

The metadata builder reports no CUDA graph support, so vLLM resolves the
cudagraph mode to PIECEWISE (attention outside the graphs, where this Python
code runs every step) instead of replaying full-graph decode steps that would
skip it; an explicit FULL mode is refused by vLLM with its own message.
"""
from __future__ import annotations

from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                   FlashAttentionMetadataBuilder)

from . import tree_runtime
from .tree_runtime import STEP, flash_tree_attention

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


class TreeFlashAttentionImpl(FlashAttentionImpl):
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
            tree_runtime.FLASH_TREE_LAYERS += 1

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                 output_scale, output_block_scale)
        if attn_metadata is not None and STEP.attended and self.tree_layer:
            self._check_step(query, kv_cache, attn_metadata)
            flash_tree_attention(self, query, kv_cache, attn_metadata.block_table, output)
        return result

    def _check_step(self, query, kv_cache, attn_metadata) -> None:
        if STEP.flash is None:
            raise RuntimeError("vllm_specplug: tree requests without kernel arguments "
                               "(prepare_tree_requests did not run for this step)")
        reasons = []
        if attn_metadata.causal is not True:
            reasons.append("non-causal or per-request causal attention")
        if getattr(attn_metadata, "mm_prefix_query_range_tensor", None) is not None:
            reasons.append("bidirectional multimodal prefixes")
        if getattr(attn_metadata, "rswa_prefix_lens", None) is not None:
            reasons.append("R-SWA")
        if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * self.head_size:
            reasons.append(f"a KV cache of shape {tuple(kv_cache.shape)} (expected "
                           f"[blocks, kv heads, block size, 2 * {self.head_size}])")
        if query.dtype != kv_cache.dtype:
            reasons.append(f"a {kv_cache.dtype} KV cache with {query.dtype} queries")
        if reasons:
            raise NotImplementedError(f"{_WHAT} does not support {', '.join(reasons)}")


class TreeFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
    # Full CUDA graphs would replay attention without the tree fix-up.
    _cudagraph_support = AttentionCGSupport.NEVER

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
