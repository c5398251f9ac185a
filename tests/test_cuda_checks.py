"""Refusals of the tree path before the engine serves (``vllm_adapter.cuda_checks``).

* several KV-cache groups and chunked-local attention (issue 22, defect 1):
  the per-layer KV-spec check on vLLM's own spec classes, against vLLM's own
  grouping (``get_kv_cache_groups``); the process-0 model check on fake model
  configs and, through vLLM's ``EngineArgs``, on tiny random Gemma-2 and
  Llama-4 folders (no engine starts);
* FLASH_ATTN's own limits in our words (defect 6): fake GPU capabilities,
  head sizes, dtypes and KV-cache dtypes.
"""
from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from vllm_specplug.options import SpecPlugConfigError
from vllm_specplug.vllm_adapter.v1 import cuda_checks

pytest.importorskip("vllm")

SPEC = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


# ------------------------------------------------------- per-layer KV specs

@pytest.fixture(scope="module")
def vllm_groups():
    """Number of KV-cache groups vLLM makes of some specs (hybrid manager on,
    as on GPUs)."""
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

    cfg = VllmConfig()
    cfg.cache_config.kv_cache_layout = "LBNHC"
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    return lambda specs: len(get_kv_cache_groups(cfg, dict(specs)))


def _specs(kind: str, layers: int = 8) -> dict:
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec,
                                            MambaSpec, SlidingWindowSpec)

    full = FullAttentionSpec(**SPEC)
    other = {
        "full": full,
        "head_sizes": FullAttentionSpec(**{**SPEC, "head_size": 128}),
        "sliding": SlidingWindowSpec(**SPEC, sliding_window=128),
        "chunked": ChunkedLocalAttentionSpec(**SPEC, attention_chunk_size=64),
        "full_with_window": FullAttentionSpec(**SPEC, sliding_window=128),
        "mamba": MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,)),
    }[kind]
    # every other layer of the given kind (Gemma-2 / Llama-4 style interleaving)
    return {f"model.layers.{i}.attn": other if i % 2 else full for i in range(layers)}


@pytest.mark.parametrize("kind", ["full", "head_sizes"])
def test_plain_full_attention_passes_and_is_one_group(kind, vllm_groups):
    specs = _specs(kind)
    assert cuda_checks.kv_spec_problems(specs) == []
    cuda_checks.check_kv_specs(specs)
    assert vllm_groups(specs) == 1  # what the tree path's single block table needs


@pytest.mark.parametrize("kind, words, groups", [
    ("sliding", "sliding-window attention in 4 of 8 layers", 2),
    ("chunked", "chunked local attention in 4 of 8 layers", 2),
    ("full_with_window", "sliding-window attention in 4 of 8 layers", 1),
    ("mamba", "non-attention state (MambaSpec) in 4 of 8 layers", None),
])
def test_other_layers_are_refused(kind, words, groups, vllm_groups):
    specs = _specs(kind)
    problems = cuda_checks.kv_spec_problems(specs)
    assert len(problems) == 1 and problems[0].startswith(words), problems
    assert "model.layers.1.attn" in problems[0]
    with pytest.raises(NotImplementedError) as e:
        cuda_checks.check_kv_specs(specs)
    msg = str(e.value)
    assert "one KV-cache group" in msg and words in msg and "e.g. sam" in msg, msg
    if groups is not None:  # several groups, or one group computed with a window
        assert vllm_groups(specs) >= groups


# ------------------------------------------------------- process-0 check

def _model_config(**over):
    base = dict(model="m", attention_chunk_size=None, is_attention_free=False,
                is_hybrid=False, use_mla=False, is_encoder_decoder=False,
                hf_text_config=SimpleNamespace(), hf_config=SimpleNamespace(),
                rswa_window=None, uses_mrope=False)
    base.update(over)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("over, words", [
    (dict(attention_chunk_size=8192), "chunked local attention (attention_chunk_size=8192"),
    (dict(hf_text_config=SimpleNamespace(layer_types=["sliding_attention", "full_attention"])),
     "layers of type sliding_attention besides full attention"),
    (dict(is_hybrid=True), "state-space"),
    (dict(use_mla=True), "MLA"),
    (dict(is_encoder_decoder=True), "encoder-decoder"),
    (dict(rswa_window=512), "R-SWA"),
    # XD-RoPE (HunYuan-VL): in the rope parameters, per layer type, or at the
    # config's top level (older checkpoints)
    (dict(hf_text_config=SimpleNamespace(rope_parameters={
        "rope_type": "default", "xdrope_section": [16, 16, 16, 16]})),
     "XD-RoPE (xdrope_section=[16, 16, 16, 16])"),
    (dict(hf_text_config=SimpleNamespace(rope_parameters={
        "full_attention": {"rope_type": "default", "xdrope_section": [8, 8]}})),
     "XD-RoPE (xdrope_section=[8, 8])"),
    (dict(hf_config=SimpleNamespace(xdrope_section=[4, 4, 4])), "XD-RoPE"),
    (dict(uses_mrope=True), "M-RoPE"),
])
def test_tree_model_problems(over, words):
    assert cuda_checks.tree_model_problems(_model_config()) == []
    problems = cuda_checks.tree_model_problems(_model_config(**over))
    assert len(problems) == 1 and words in problems[0], problems
    plugin = {"method": "token_recycling"}
    with pytest.raises(SpecPlugConfigError) as e:
        cuda_checks.check_tree_model(plugin, _model_config(**over))
    assert "'token_recycling' verifies draft trees" in str(e.value)
    assert "use a chain method (e.g. sam)" in str(e.value)
    # chain methods keep working on these models; 'acceptance' routes chains
    # through the tree path, so it is refused too
    cuda_checks.check_tree_model({"method": "sam"}, _model_config(**over))
    with pytest.raises(SpecPlugConfigError,
                       match=r"'sam' with speculative_config\['acceptance'\]"):
        cuda_checks.check_tree_model({"method": "sam", "acceptance": {"name": "block"}},
                                     _model_config(**over))


def test_full_attention_layer_types_pass():
    cfg = _model_config(hf_text_config=SimpleNamespace(layer_types=["full_attention"] * 4))
    assert cuda_checks.tree_model_problems(cfg) == []


def _tiny_folder(tmp_path, model_path, config: dict):
    """A model folder with a random tiny config and the test model's tokenizer
    (vLLM reads the config and tokenizer at engine-config time; no weights)."""
    folder = tmp_path / config["model_type"]
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{model_path}/{name}", folder / name)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, torch_dtype="float32")


@pytest.mark.parametrize("config, words", [
    (dict(TINY, model_type="gemma2", architectures=["Gemma2ForCausalLM"], sliding_window=64,
          layer_types=["sliding_attention", "full_attention"] * 2),
     "layers of type sliding_attention besides full attention"),
    (dict(TINY, model_type="llama4_text", architectures=["Llama4ForCausalLM"],
          attention_chunk_size=32, num_local_experts=1, num_experts_per_tok=1,
          intermediate_size_mlp=128, interleave_moe_layer_step=1, no_rope_layers=[1, 1, 1, 0]),
     "chunked local attention (attention_chunk_size=32"),
    (dict(TINY, model_type="llama", architectures=["LlamaForCausalLM"],
          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                           "xdrope_section": [2, 2, 2, 2]}),
     "XD-RoPE (xdrope_section=[2, 2, 2, 2])"),
])
def test_engine_config_refuses_tree_methods_for_these_models(tmp_path, model_path, config,
                                                              words):
    """Through vLLM's EngineArgs, as ``LLM(...)`` and ``vllm serve`` run it:
    refused in process 0 for a tree method, accepted for sam."""
    from vllm.engine.arg_utils import EngineArgs

    folder = _tiny_folder(tmp_path, model_path, config)

    def engine_config(spec):
        return EngineArgs(model=folder, dtype="float32", max_model_len=256, enforce_eager=True,
                          speculative_config=spec).create_engine_config()

    with pytest.raises(SpecPlugConfigError) as e:
        engine_config({"method": "token_recycling", "num_speculative_tokens": 8})
    assert words in str(e.value) and "e.g. sam" in str(e.value), str(e.value)
    cfg = engine_config({"method": "sam", "num_speculative_tokens": 4})
    assert cfg.additional_config["specplug"]["method"] == "sam"


# ---------------------------------------------------- CUDA: FLASH_ATTN's limits

def _cuda_config(dtype=torch.bfloat16, head_size=128, cache_dtype="auto", mm_prefix=False,
                 backend=None, k=8, pcp=1):
    model = SimpleNamespace(dtype=dtype, get_head_size=lambda: head_size,
                            is_mm_prefix_lm=mm_prefix)
    return SimpleNamespace(
        model_config=model, cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        attention_config=SimpleNamespace(backend=backend, backend_per_kind={}),
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1,
                                        prefill_context_parallel_size=pcp,
                                        use_ubatching=False))


def test_flash_attention_limits_in_our_words(monkeypatch):
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    h100, t4 = DeviceCapability(9, 0), DeviceCapability(7, 5)
    cfg = _cuda_config()
    cuda_checks.check_cuda_tree_config(cfg, capability=h100)
    assert cfg.attention_config.backend == AttentionBackendEnum.FLASH_ATTN  # pinned
    cuda_checks.check_cuda_tree_config(_cuda_config(dtype=torch.float16, head_size=64,
                                                    cache_dtype="float16"), capability=h100)
    cases = [
        (dict(), t4, "compute capability 7.5", "needs 8.0 or newer"),
        (dict(head_size=100), h100, "head size 100", "multiples of 8 up to 256"),
        (dict(dtype=torch.float32), h100, "dtype float32", "--dtype bfloat16"),
        (dict(cache_dtype="float16"), h100, "kv_cache_dtype=float16 with a bfloat16 model",
         "--kv-cache-dtype auto"),
        (dict(cache_dtype="fp8"), h100, "quantized KV cache", "--kv-cache-dtype auto"),
        (dict(k=65), h100, "more than 64 draft nodes", "at most 64"),
        (dict(pcp=2), h100, "prefill context parallelism", "prefill_context_parallel_size 1"),
    ]
    for over, cap, what, change in cases:
        cfg = _cuda_config(**over)
        with pytest.raises(NotImplementedError) as e:
            cuda_checks.check_cuda_tree_config(cfg, capability=cap)
        msg = str(e.value)
        assert what in msg and change in msg, msg
        assert cfg.attention_config.backend is None  # nothing pinned on a refusal
    monkeypatch.setattr(FlashAttentionBackend, "supports_mm_prefix", classmethod(lambda c: False))
    with pytest.raises(NotImplementedError, match="prefix-LM .* FlashAttention 4"):
        cuda_checks.check_cuda_tree_config(_cuda_config(mm_prefix=True), capability=h100)
    with pytest.raises(ValueError, match="--attention-backend FLASH_ATTN"):
        cuda_checks.check_cuda_tree_config(
            _cuda_config(backend=AttentionBackendEnum.TRITON_ATTN), capability=h100)


def test_request_fallback_reason():
    assert cuda_checks.request_fallback_reason(64, "cuda") is None
    assert cuda_checks.request_fallback_reason(65, "cuda") == "more than 64 nodes"
    assert cuda_checks.request_fallback_reason(65, "cpu") is None  # SDPA path: any size


def test_cpu_tree_layers_refuse_unsupported_attention_when_built():
    """The CPU tree impl refuses at layer build (was: inside the forward)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_specplug.vllm_adapter.v1.tree_attention import TreeCPUAttentionImpl

    base = dict(num_heads=4, head_size=16, scale=0.25, num_kv_heads=2, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype="auto")
    cfg = VllmConfig()
    object.__setattr__(cfg, "model_config", SimpleNamespace(dtype=torch.float32))
    with set_current_vllm_config(cfg):
        TreeCPUAttentionImpl(**base)
        for extra in (dict(sliding_window=32), dict(alibi_slopes=[0.5] * 4),
                      dict(logits_soft_cap=30.0)):
            with pytest.raises(NotImplementedError, match=r"sliding windows.*e\.g\. sam"):
                TreeCPUAttentionImpl(**{**base, **extra})
