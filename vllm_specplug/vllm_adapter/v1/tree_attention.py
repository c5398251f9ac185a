"""CPU_ATTN with tree rows fixed up after vLLM's kernel (worker only: imports vLLM).

What the tree path cannot serve is refused when a layer is built (sliding
windows, ALiBi, soft-capping, sinks) and when vLLM builds the metadata builder
at KV-cache initialisation (the cache layout, ``cpu_kv.check_isa``), both
before the engine serves a request; nothing raises inside a forward pass.
Should tree attention raise all the same (out of memory), the step's tree
requests accept no draft and decode their next token as plain decoding would
(``StepTrees.fail_attention``, ``tree_runtime.accept_trees``): the engine and
its other requests go on.
"""
from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadataBuilder)

from . import cpu_kv
from .step_state import TreeLayerImpl
from .tree_runtime import tree_attention


class TreeCPUAttentionImpl(TreeLayerImpl, CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if (self.sliding_window not in (None, -1) or self.alibi_slopes is not None
                or self.logits_soft_cap or self.sinks is not None):
            raise NotImplementedError(
                "vllm_specplug tree verification does not support sliding windows, "
                "ALiBi, soft-capping or attention sinks; use a chain method (e.g. sam) "
                "for this model")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                 output_scale, output_block_scale)
        step = self.tree_step_now()   # bound at model load (step_state)
        if attn_metadata is not None and step is not None:
            try:
                tree_attention(self, query, kv_cache, output, step)
            except Exception as e:  # noqa: BLE001 - contained: this step's trees accept no draft
                step.fail_attention(e)
        return result


class TreeCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cpu_kv.check_isa(self.isa)  # the layout tree_attention and cpu_kv read


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TreeCPUAttentionMetadataBuilder
