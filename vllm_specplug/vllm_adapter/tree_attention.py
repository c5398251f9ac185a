"""CPU_ATTN with tree rows fixed up after vLLM's kernel (worker only: imports vLLM)."""
from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from . import cpu_kv
from .tree_runtime import STEP, tree_attention


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                 output_scale, output_block_scale)
        if attn_metadata is not None and STEP.attended:
            if (self.sliding_window not in (None, -1) or self.alibi_slopes is not None
                    or self.logits_soft_cap or self.sinks is not None):
                raise NotImplementedError(
                    "vllm_specplug tree verification does not support sliding windows, "
                    "ALiBi, soft-capping or attention sinks")
            cpu_kv.check_isa(layer.isa)
            tree_attention(self, query, kv_cache, output)
        return result


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl
