"""Refusals of models and engine settings the tree path cannot serve, all
before the engine serves a request (never inside a forward pass).

Three points, earliest first:

* :func:`check_tree_model` -- process 0, when our patch of
  ``EngineArgs.create_speculative_config`` validates a tree method against the
  target's ``ModelConfig`` (before any engine process starts): model shapes
  whose attention the tree path cannot reproduce or whose KV cache it cannot
  address, whatever the platform.
* :func:`check_cuda_tree_config` -- the worker, when the drafter installs the
  tree patches (before the model is built): the CUDA path runs inside vLLM's
  FLASH_ATTN backend, pinned here; what would make FLASH_ATTN itself refuse
  (an old GPU, a head size, fp32) and what our kernel cannot take is refused in
  our words, naming what to change.
* :func:`kv_spec_problems` -- the worker, when vLLM builds the attention
  metadata builders at KV-cache initialisation (before the warm-up runs): the
  exact per-layer KV-cache specs vLLM derived from the built model.

Why several KV-cache groups are refused: the tree path reads one block table
(``input_batch.block_table[0]``) and moves the accepted nodes' slots in every
layer's cache, while in vLLM 0.32 each KV-cache group has its own block table
(sliding-window layers next to full-attention layers form two groups on CUDA)
and chunked-local layers (Llama-4) read a rewritten per-chunk block table.
Both would read or overwrite other requests' KV.
"""
from __future__ import annotations

from typing import Any, Mapping

from ...options import SpecPlugConfigError

#: what a refusal tells the user to do instead
CHAIN_HINT = "use a chain method (e.g. sam) for this model"

#: layer types (``hf_text_config.layer_types``) that are plain full attention
FULL_ATTENTION_LAYER_TYPES = ("full_attention", "attention")


def uses_tree_path(plugin: Mapping[str, Any]) -> bool:
    """Whether a translated plugin config verifies on our tree path (tree
    drafts, or chains routed there by a non-default acceptance rule)."""
    return _drafts_trees(plugin) or bool(plugin.get("acceptance"))


def tree_model_problems(model_config: Any) -> list[str]:
    """What in the target model the tree path cannot serve (empty: nothing).

    Read from vLLM's ``ModelConfig`` (process 0, before the model exists);
    :func:`kv_spec_problems` checks the built model's KV-cache specs again."""
    problems = []
    chunk = model_config.attention_chunk_size
    if chunk is not None:
        problems.append(
            f"chunked local attention (attention_chunk_size={chunk}, e.g. Llama-4's "
            f"ChunkedLocalAttention layers: vLLM rewrites their block tables into per-chunk "
            f"virtual batches, which the tree kernel does not read)")
    if model_config.is_attention_free or model_config.is_hybrid:
        problems.append("state-space or linear-attention layers (a hybrid or attention-free "
                        "model: their state cannot be rolled back to a tree's accepted path)")
    if model_config.use_mla:
        problems.append("multi-head latent attention (MLA: a compressed KV cache the tree "
                        "kernel does not read)")
    if model_config.is_encoder_decoder:
        problems.append("an encoder-decoder model (its cross-attention cache is a second "
                        "KV-cache group)")
    layer_types = getattr(model_config.hf_text_config, "layer_types", None) or ()
    other = sorted({str(t) for t in layer_types} - set(FULL_ATTENTION_LAYER_TYPES))
    if other:
        problems.append(
            f"layers of type {', '.join(other)} besides full attention "
            f"(hf config layer_types; e.g. Gemma-2/3's interleaved sliding-window layers: "
            f"vLLM gives them their own KV-cache group and block table on GPUs, and the "
            f"tree path reads one block table and no sliding window)")
    if model_config.rswa_window is not None:
        problems.append(f"R-SWA attention (rswa_window={model_config.rswa_window})")
    rope = multidimensional_rope(model_config)
    if rope:
        problems.append(
            f"{rope} (vLLM feeds such a model a position tensor of its own, which the tree "
            f"path does not rewrite to each node's depth: tree nodes would attend with wrong "
            f"positions, or every draft would be verified as a chain)")
    return problems


def multidimensional_rope(model_config: Any) -> str | None:
    """The model's multi-dimensional rotary positions, named (None: plain
    1-D positions): XD-RoPE (HunYuan-VL's ``xdrope_section``, in the HF config
    or its rope parameters; vLLM 0.32 serves it as M-RoPE, later releases
    through their own ``xdrope_positions``) or M-RoPE (``uses_mrope``)."""
    for cfg in (model_config.hf_config, model_config.hf_text_config):
        # HF config fields: absent on models that do not use them
        holders = [cfg] + [p for p in (getattr(cfg, "rope_parameters", None),
                                       getattr(cfg, "rope_scaling", None)) if p]
        for holder in holders:
            params = holder if isinstance(holder, dict) else vars(holder)
            nested = [v for v in params.values() if isinstance(v, dict)]
            for p in [params] + nested:
                if p.get("xdrope_section") is not None:
                    return f"XD-RoPE (xdrope_section={p['xdrope_section']})"
    if model_config.uses_mrope:
        return "M-RoPE (multimodal rotary positions, e.g. Qwen2-VL)"
    return None


def check_tree_model(plugin: Mapping[str, Any], model_config: Any) -> None:
    """Process 0: refuse a tree method (or a routed 'acceptance') for a target
    whose attention or KV cache the tree path cannot serve."""
    if model_config is None or not uses_tree_path(plugin):
        return
    problems = tree_model_problems(model_config)
    if problems:
        what = (f"method {plugin['method']!r} verifies draft trees" if _drafts_trees(plugin)
                else f"method {plugin['method']!r} with speculative_config['acceptance'] "
                     f"verifies its drafts on the tree path")
        raise SpecPlugConfigError(
            f"{what}, and vllm-specplug's tree verification does not support this model "
            f"({model_config.model}): {'; '.join(problems)}. Tree verification needs every "
            f"attention layer to be plain full causal attention in one KV-cache group; "
            f"{CHAIN_HINT}")


def _drafts_trees(plugin: Mapping[str, Any]) -> bool:
    from ...registry import get_proposer_class

    return bool(get_proposer_class(plugin["method"]).drafts_trees)


def kv_spec_problems(kv_cache_specs: Mapping[str, Any]) -> list[str]:
    """What in the per-layer KV-cache specs (``{layer name: KVCacheSpec}``,
    vLLM's ``get_kv_cache_spec``) the tree path cannot serve. Accepted: every
    layer a plain ``FullAttentionSpec`` without sliding window or chunking,
    which vLLM always puts in one KV-cache group (checked against
    ``get_kv_cache_groups`` in the tests)."""
    from vllm.v1.kv_cache_interface import (AttentionSpec, ChunkedLocalAttentionSpec,
                                            FullAttentionSpec, SlidingWindowSpec)

    kinds: dict[str, list[str]] = {}
    for name, spec in kv_cache_specs.items():
        if type(spec) is FullAttentionSpec:
            if spec.attention_chunk_size is not None:
                kind = "chunked local attention"
            elif spec.sliding_window is not None:
                kind = "sliding-window attention"
            else:
                continue
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            kind = "chunked local attention"
        elif isinstance(spec, SlidingWindowSpec):
            kind = "sliding-window attention"
        elif not isinstance(spec, AttentionSpec):
            kind = f"non-attention state ({type(spec).__name__})"
        else:
            kind = f"{type(spec).__name__} layers"
        kinds.setdefault(kind, []).append(name)
    total = len(kv_cache_specs)
    out = []
    for kind, names in kinds.items():
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        out.append(f"{kind} in {len(names)} of {total} layers ({shown})")
    return out


def check_kv_specs(kv_cache_specs: Mapping[str, Any]) -> None:
    """Worker, at KV-cache initialisation: refuse specs :func:`kv_spec_problems`
    names (several KV-cache groups, chunked-local or sliding-window layers)."""
    problems = kv_spec_problems(kv_cache_specs)
    if problems:
        raise NotImplementedError(
            f"vllm_specplug tree verification needs every attention layer to be plain full "
            f"causal attention in one KV-cache group (it reads one block table and moves "
            f"accepted KV in every layer); this model has {'; '.join(problems)}. "
            f"{CHAIN_HINT[0].upper()}{CHAIN_HINT[1:]}")


def model_kv_specs(vllm_config: Any) -> dict[str, Any]:
    """The built model's per-layer KV-cache specs, as vLLM's runner derives
    them (``GPUModelRunner.get_kv_cache_spec``: layers that share another
    layer's cache and layers without a cache are left out)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    specs = {}
    for name, layer in get_layers_from_vllm_config(vllm_config, AttentionLayerBase).items():
        if isinstance(layer, Attention) and layer.kv_sharing_target_layer_name:
            continue
        spec = layer.get_kv_cache_spec(vllm_config)
        if spec:
            specs[name] = spec
    return specs


# --------------------------------------------------------------- CUDA path

def flash_attention_problems(model_config: Any, cache_config: Any, capability: Any
                             ) -> list[str]:
    """Why vLLM's FLASH_ATTN backend (the CUDA tree path's base), pinned by us,
    would fail or our kernel could not run: each with what to change. vLLM
    picks another backend itself in these cases when nothing is pinned, but a
    pinned backend turns them into its generic 'no valid backend' error."""
    import torch
    from vllm.v1.kv_cache_interface import is_quantized_kv_cache
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    problems = []
    if capability is not None and not FlashAttentionBackend.supports_compute_capability(
            capability):
        problems.append(
            f"this GPU (compute capability {capability.major}.{capability.minor}): vLLM's "
            f"FLASH_ATTN backend, which tree verification on CUDA extends, needs 8.0 or newer "
            f"(Ampere, Ada, Hopper, Blackwell); on this GPU {CHAIN_HINT}")
    head_size = model_config.get_head_size()
    if not FlashAttentionBackend.supports_head_size(head_size):
        problems.append(
            f"head size {head_size}: vLLM's FLASH_ATTN backend takes multiples of 8 up to "
            f"256; for this model {CHAIN_HINT}")
    dtype = model_config.dtype
    if dtype not in FlashAttentionBackend.supported_dtypes:
        problems.append(
            f"dtype {str(dtype).removeprefix('torch.')}: vLLM's FLASH_ATTN backend runs "
            f"float16 and bfloat16 only; use --dtype bfloat16 (or float16)")
    cache_dtype = str(cache_config.cache_dtype or "auto")
    if is_quantized_kv_cache(cache_dtype):
        problems.append(
            f"a quantized KV cache (kv_cache_dtype={cache_dtype}): the tree kernel reads "
            f"16-bit keys and values; use --kv-cache-dtype auto")
    elif cache_dtype != "auto" and getattr(torch, cache_dtype, None) != dtype:
        problems.append(
            f"kv_cache_dtype={cache_dtype} with a {str(dtype).removeprefix('torch.')} model: "
            f"the tree kernel needs keys and values in the queries' dtype; use "
            f"--kv-cache-dtype auto")
    if model_config.is_mm_prefix_lm and not FlashAttentionBackend.supports_mm_prefix():
        problems.append(
            "a multimodal prefix-LM (bidirectional image tokens), which vLLM's FLASH_ATTN "
            f"backend serves only with FlashAttention 4, not available here; {CHAIN_HINT}")
    return problems


def check_cuda_tree_config(vllm_config: Any, capability: Any = None) -> None:
    """Refuse CUDA configurations the tree path cannot serve, and make vLLM pick
    FLASH_ATTN (the override's base) where it would pick another backend by
    default (FlashInfer first on SM100; FLASH_ATTN first on SM80/SM90).
    ``capability``: the GPU's (default: the current platform's)."""
    if vllm_config is None:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from ...kernels.tree_attention_triton import MAX_TREE_NODES

    flash = AttentionBackendEnum.FLASH_ATTN
    # VllmConfig fields read directly: a renamed one must fail, not skip a refusal
    attention = vllm_config.attention_config
    if attention is not None:
        chosen = [attention.backend] + list((attention.backend_per_kind or {}).values())
        other = [b for b in chosen if b is not None and b != flash]
        if other:
            names = ", ".join(getattr(b, "name", str(b)) for b in other)
            raise ValueError(
                f"vllm_specplug tree verification on CUDA runs in the FLASH_ATTN attention "
                f"backend, but this engine selected {names}; use --attention-backend "
                f"FLASH_ATTN (or leave it unset), or a chain method (e.g. sam)")
    problems = []
    model_config = vllm_config.model_config
    if model_config is not None:
        if capability is None:
            from vllm.platforms import current_platform

            capability = current_platform.get_device_capability()
        problems += flash_attention_problems(model_config, vllm_config.cache_config,
                                             capability)
    else:
        from vllm.v1.kv_cache_interface import is_quantized_kv_cache

        cache_dtype = str(vllm_config.cache_config.cache_dtype or "auto")
        if is_quantized_kv_cache(cache_dtype):
            problems.append(f"a quantized KV cache (kv_cache_dtype={cache_dtype}); use "
                            f"--kv-cache-dtype auto")
    k = vllm_config.speculative_config.num_speculative_tokens
    if int(k or 0) > MAX_TREE_NODES:
        problems.append(f"more than {MAX_TREE_NODES} draft nodes per request "
                        f"(num_speculative_tokens={k}); give at most {MAX_TREE_NODES}")
    parallel = vllm_config.parallel_config
    if int(parallel.decode_context_parallel_size or 1) > 1:
        problems.append("decode context parallelism; use decode_context_parallel_size 1")
    if int(parallel.prefill_context_parallel_size or 1) > 1:
        problems.append("prefill context parallelism; use prefill_context_parallel_size 1")
    if parallel.use_ubatching:
        problems.append("micro-batching (DBO); turn off --enable-dbo")
    if problems:
        raise NotImplementedError(
            f"vllm_specplug tree verification on CUDA does not support "
            f"{'; '.join(problems)}")
    if attention is not None and attention.backend is None:
        attention.backend = flash


def request_fallback_reason(num_nodes: int, device_type: str) -> str | None:
    """Why one tree request must be verified as a chain on this device (None:
    it can take the tree path): for ``tree_runtime._falls_back``, so that no
    per-request condition raises mid-serving. The CUDA kernel holds one int64
    ancestor bitmask per node (engine configurations with more draft tokens
    are refused at start; this covers a tree that still has more nodes)."""
    from ...kernels.tree_attention_triton import MAX_TREE_NODES

    if device_type == "cuda" and num_nodes > MAX_TREE_NODES:
        return f"more than {MAX_TREE_NODES} nodes"
    return None
