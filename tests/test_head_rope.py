"""Published heads' RoPE and attention biases, no engine.

* RoPE scalings (``linear``, ``dynamic``, ``yarn``, ``llama3``): the head's
  cos/sin on random positions against vLLM's own ``get_rope`` (built as
  vLLM's Llama layer builds it from the same config.json) and against
  transformers' ``LlamaRotaryEmbedding``; whole EAGLE-1 layers against
  transformers' ``LlamaDecoderLayer`` with the scaled rotary embedding.
* Heads for Qwen2-family targets (``qkv_bias``: q/k/v biases, none on
  o_proj): the EAGLE-1 layer against transformers' ``Qwen2DecoderLayer``.
* What stays unsupported is refused before the engine starts, naming the key.
* ``eagle/head.py`` and ``eagle/head3.py`` do not import each other.
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from vllm_specplug.eagle import Eagle3Head, Eagle3HeadConfig, EagleHead, EagleHeadConfig, \
    check_head_folder, load_head, save_head, save_head3
from vllm_specplug.options import SpecPlugConfigError

from helpers import compare_with_hf_layer, random_head

BASE = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 50, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096}
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# config.json RoPE settings as published heads spell them (transformers 4's
# rope_scaling, legacy ``type``, transformers 5's rope_parameters)
ROPE_CASES = {
    "default": {"rope_theta": 10000.0},
    "linear": {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 4.0}},
    "linear_3": {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 3.0}},
    "dynamic": {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    "yarn": {"rope_theta": 10000.0, "max_position_embeddings": 16384,
             "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 4096}},
    "yarn_mscale": {"rope_theta": 1e6, "max_position_embeddings": 16384,
                    "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                        "original_max_position_embeddings": 4096,
                                        "mscale": 0.707, "mscale_all_dim": 1.0,
                                        "beta_fast": 16, "beta_slow": 2}},
    "yarn_attention_factor": {"rope_theta": 10000.0, "max_position_embeddings": 8192,
                              "rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                                               "attention_factor": 0.8, "truncate": False}},
    # Llama-3.1's own settings, at its head_dim and context
    "llama3": {"rope_theta": 500000.0, "head_dim": 128, "num_attention_heads": 2,
               "num_key_value_heads": 1, "max_position_embeddings": 131072,
               "rope_scaling": LLAMA31},
    # a short original context: every band of llama3 (kept, smoothed, divided) at head_dim 16
    "llama3_short": {"rope_theta": 10000.0,
                     "rope_scaling": {**LLAMA31, "original_max_position_embeddings": 64}},
}
F32_EPS = torch.finfo(torch.float32).eps


def head_dict(case: str) -> dict:
    return {**BASE, **ROPE_CASES[case]}


def _vllm_rope(d: dict):
    """vLLM's rotary embedding for a Llama layer of this config.json: the
    config read by transformers and patched by vLLM, then ``get_rope`` as
    ``vllm.model_executor.models.llama.LlamaAttention`` calls it."""
    from transformers import LlamaConfig
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.transformers_utils.config import patch_rope_parameters

    hf = LlamaConfig(**d)
    patch_rope_parameters(hf)
    with set_current_vllm_config(VllmConfig()):
        return get_rope(hf.head_dim, max_position=hf.max_position_embeddings,
                        rope_parameters=hf.rope_parameters, dtype=torch.float32)


def _positions(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat((torch.tensor([0, 1, n - 1]), torch.randint(0, n, (2000,), generator=g)))


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_equals_vllm_get_rope(case):
    """cos and sin at random positions within vLLM's table equal vLLM's
    ``cos_sin_cache`` rows (the table vLLM rotates q and k with)."""
    d = head_dict(case)
    head = EagleHead(EagleHeadConfig.from_dict(d))
    cache = _vllm_rope(d).cos_sin_cache.float()
    pos = _positions(cache.shape[0], seed=len(case))
    cos, sin = head.rope(pos)
    half = head.config.head_dim // 2
    # the angles are rounded float32 products (vLLM: position / factor first
    # for linear): a few ulps of the largest angle
    max_angle = float(pos.max()) * float(head.inv_freq.max())
    tol = 1e-6 + 4 * F32_EPS * max_angle
    err = max((cos[:, :half] - cache[pos, :half]).abs().max().item(),
              (sin[:, :half] - cache[pos, half:]).abs().max().item())
    print(f"{case}: max |ours - vLLM| = {err:.3g} (tolerance {tol:.3g}, {len(pos)} positions "
          f"< {cache.shape[0]})")
    assert err <= tol, (case, err, tol)
    # the neox layout: both halves carry the same angles
    assert torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])
    plain = EagleHead(EagleHeadConfig.from_dict({**d, "rope_scaling": None,
                                                 "rope_parameters": None}))
    pc, ps = plain.rope(pos)
    if case.startswith("dynamic"):
        # vLLM's dynamic NTK table at max_position_embeddings is plain RoPE
        assert torch.equal(cos, pc) and torch.equal(sin, ps)
    elif case != "default":
        # the comparison is sensitive: plain RoPE is far from the scaled table
        assert (pc[:, :half] - cache[pos, :half]).abs().max() > 0.1, case


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_equals_transformers(case):
    """cos and sin equal transformers' ``LlamaRotaryEmbedding`` of the same
    config (float32; for ``dynamic`` within max_position_embeddings, where
    transformers and vLLM agree: past it transformers grows its base, vLLM
    and the head keep the table)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    d = head_dict(case)
    head = EagleHead(EagleHeadConfig.from_dict(d))
    rope = LlamaRotaryEmbedding(LlamaConfig(**d))
    pos = _positions(d["max_position_embeddings"], seed=7 + len(case))
    cos, sin = head.rope(pos)
    ref_cos, ref_sin = rope(torch.zeros(1), pos[None])
    err = max((cos - ref_cos[0]).abs().max().item(), (sin - ref_sin[0]).abs().max().item())
    print(f"{case}: max |ours - transformers| = {err:.3g}")
    assert err <= 1e-6, (case, err)


@pytest.mark.parametrize("case", ["linear", "yarn_mscale", "llama3_short"])
def test_scaled_head_layer_equals_transformers(case):
    """A whole EAGLE-1 layer with scaled RoPE (YaRN's attention factor
    included) equals transformers' LlamaDecoderLayer at far positions."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    d = head_dict(case)
    head = random_head(EagleHeadConfig.from_dict(d), seed=3)
    hf = LlamaConfig(**d)
    hf._attn_implementation = "eager"
    err = compare_with_hf_layer(head, LlamaDecoderLayer(hf, layer_idx=0).eval(),
                         LlamaRotaryEmbedding(hf), start=3000)
    print(f"{case}: EAGLE-1 layer max |ours - transformers| = {err:.3g}")


QWEN2_HEAD = {**BASE, "rope_theta": 1e6, "qkv_bias": True, "attention_bias": False,
              "max_position_embeddings": 32768}


def test_qwen2_biased_head_equals_transformers_qwen2_layer():
    """Heads for Qwen2-family targets (``qkv_bias: true``: biases on q, k and v,
    none on o_proj, as vLLM's Llama layer reads them) equal transformers'
    Qwen2DecoderLayer."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    cfg = EagleHeadConfig.from_dict(QWEN2_HEAD)
    assert cfg.has_qkv_bias and not cfg.attention_bias
    shapes = cfg.expected_shapes()
    assert shapes["layers.0.self_attn.k_proj.bias"] == (32,)
    assert "layers.0.self_attn.o_proj.bias" not in shapes
    head = random_head(cfg, seed=5)
    assert set(head.state_dict()) == set(shapes)
    hf = Qwen2Config(**{k: v for k, v in QWEN2_HEAD.items() if k not in ("qkv_bias",
                                                                        "attention_bias")},
                     num_hidden_layers=1, use_sliding_window=False)
    hf._attn_implementation = "eager"
    err = compare_with_hf_layer(head, Qwen2DecoderLayer(hf, layer_idx=0).eval(),
                         Qwen2RotaryEmbedding(hf), start=100)
    print(f"qwen2 (qkv_bias) EAGLE-1 layer max |ours - transformers| = {err:.3g}")
    # the comparison sees the biases: a reference without the k bias differs
    with pytest.raises(AssertionError):
        compare_with_hf_layer(head, Qwen2DecoderLayer(hf, layer_idx=0).eval(),
                       Qwen2RotaryEmbedding(hf), start=100,
                       change=lambda k, v: v * 0 if k.endswith("k_proj.bias") else v)


def test_bias_keys_read_as_vllm_does(tmp_path):
    """EAGLE-1 (vLLM's LlamaDecoderLayer): o_proj bias = attention_bias or bias;
    q/k/v = qkv_bias when present, else the same. EAGLE-3 (llama_eagle3):
    q/k/v = attention_bias alone."""
    def one(**kw):
        c = EagleHeadConfig.from_dict({**BASE, **kw})
        return c.has_qkv_bias, c.attention_bias

    assert one() == (False, False)
    assert one(attention_bias=True) == (True, True)
    assert one(bias=True) == (True, True)
    assert one(qkv_bias=True) == (True, False)
    assert one(attention_bias=True, qkv_bias=False) == (False, True)
    assert one(qkv_bias=None) == (False, False)
    for kw in ({"qkv_bias": True}, {"attention_bias": True, "qkv_bias": False}):
        c = EagleHeadConfig.from_dict({**BASE, **kw})
        assert EagleHeadConfig.from_dict(c.to_hf_dict()) == c
    d3 = {**BASE, "draft_vocab_size": 20, "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}
    c3 = Eagle3HeadConfig.from_dict({**d3, "qkv_bias": True})   # not read by vLLM's eagle3
    assert not c3.has_qkv_bias and not c3.attention_bias
    c3 = Eagle3HeadConfig.from_dict({**d3, "attention_bias": True})
    assert c3.has_qkv_bias and c3.attention_bias
    with pytest.raises(SpecPlugConfigError, match="bias true with attention_bias false"):
        Eagle3HeadConfig.from_dict({**d3, "bias": True})
    # a Qwen2-style head round-trips through its folder
    head = random_head(EagleHeadConfig.from_dict(QWEN2_HEAD), seed=1)
    save_head(head, head.config, tmp_path / "q")
    assert json.loads((tmp_path / "q" / "config.json").read_text())["qkv_bias"] is True
    loaded, cfg = load_head(tmp_path / "q", hidden_size=64, vocab_size=50)
    assert cfg == head.config
    for k, v in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


@pytest.mark.parametrize("case", ["llama3", "yarn_mscale"])
def test_scaled_heads_round_trip_and_keep_float32_rope(case, tmp_path):
    """EAGLE-1 and EAGLE-3 heads with scaled RoPE save, load and check; cast
    to bfloat16 they keep float32 frequencies (vLLM's cache is float32)."""
    d = head_dict(case)
    cfg1 = EagleHeadConfig.from_dict(d)
    cfg3 = Eagle3HeadConfig.from_dict({**d, "draft_vocab_size": 20,
                                       "eagle_aux_hidden_state_layer_ids": [1, 2, 3]})
    assert cfg1.rope_scaling["rope_type"] == cfg3.rope_scaling["rope_type"] == \
        case.split("_")[0]
    for cfg, cls, save in ((cfg1, EagleHead, save_head), (cfg3, Eagle3Head, save_head3)):
        head = cls(cfg)
        save(head, cfg, tmp_path / cls.__name__)
        check_head_folder(tmp_path / cls.__name__, {"hidden_size": 64, "vocab_size": 50,
                                                    "num_hidden_layers": 4})
        loaded, got = load_head(tmp_path / cls.__name__, dtype=torch.bfloat16)
        assert got == cfg and loaded.inv_freq.dtype == torch.float32
        assert torch.equal(loaded.inv_freq, head.inv_freq)
        assert loaded.rope_scale == head.rope_scale


# ------------------------------------------------------------------ refusals
REFUSED = [
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                       "long_factor": [2.0] * 8, "original_max_position_embeddings": 1024}},
     r"rope_scaling\['rope_type'\] 'longrope' is not supported by the EAGLE heads"),
    ({"rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}},
     r"rope_scaling\['rope_type'\] 'su' is not supported"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "mrope_section": [2, 3, 3]}},
     r"rope_parameters\['mrope_section'\] \[2, 3, 3\] \(multimodal RoPE \(M-RoPE\)\)"),
    ({"rope_scaling": {"rope_type": "dynamic", "alpha": 2.0}},
     r"rope_scaling\['alpha'\] 2.0 \(dynamic NTK-alpha scaling\)"),
    ({"rope_scaling": {"rope_type": "my_rope", "factor": 2.0}},
     r"rope_scaling\['rope_type'\] 'my_rope' is not supported .*plain RoPE and rope_type "
     r"linear, dynamic, yarn, llama3"),
    ({"rope_scaling": {"rope_type": "linear", "type": "yarn", "factor": 2.0}},
     "rope_scaling has rope_type 'linear' and type 'yarn'; keep one of them"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor 0.5 \(a partial rotary"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     r"rope_scaling \{'rope_type': 'llama3', 'factor': 8.0\} is not a valid 'llama3' RoPE "
     r"scaling .*high_freq_factor"),
    ({"rope_scaling": "llama3"}, "rope_scaling 'llama3' is not an object"),
]


@pytest.mark.parametrize("extra, match", REFUSED)
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_unsupported_rope_is_refused_naming_the_key(extra, match, kind, tmp_path):
    """The head-folder check (run before the engine starts) and the loader
    refuse, naming config.json, the key and its value."""
    if kind == "eagle1":
        cfg = EagleHeadConfig.from_dict(BASE)
        save_head(EagleHead(cfg), cfg, tmp_path / "h")
    else:
        cfg = Eagle3HeadConfig.from_dict({**BASE, "draft_vocab_size": 20,
                                          "eagle_aux_hidden_state_layer_ids": [1, 2, 3]})
        save_head3(Eagle3Head(cfg), cfg, tmp_path / "h")
    path = tmp_path / "h" / "config.json"
    d = json.loads(path.read_text())
    d.pop("rope_parameters"), d.pop("rope_scaling")
    path.write_text(json.dumps({**d, **extra}))
    for check in (check_head_folder, load_head):
        with pytest.raises(SpecPlugConfigError, match=match) as info:
            check(tmp_path / "h")
        assert str(path) in str(info.value)


# -------------------------------------------------------------- import cycle
def _eagle_imports(module: str) -> set[str]:
    src = Path(__file__).parents[1] / "vllm_specplug" / "eagle" / f"{module}.py"
    names = set()
    for node in ast.walk(ast.parse(src.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names.add(node.module or "")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "vllm_specplug.eagle."):
            names.add(node.module.rsplit(".", 1)[1])
    return names


def test_head_modules_do_not_import_each_other():
    """Shared pieces live in eagle/common.py; only eagle/loading.py knows both
    heads (any import, module level or inside a function, counts)."""
    assert "head3" not in _eagle_imports("head")
    assert "head" not in _eagle_imports("head3")
    assert not {"head", "head3", "loading"} & _eagle_imports("common")
    assert {"head", "head3"} <= _eagle_imports("loading")
