"""EAGLE-1 head: numerics (KV cache, tree masks, transformers reference) and
checkpoint I/O (round trip, every bad-file case). No engine: seconds."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_specplug.eagle import EagleHead, EagleHeadConfig, check_head_folder, load_head, \
    save_head
from vllm_specplug.options import SpecPlugConfigError


def small_config(**kw) -> EagleHeadConfig:
    base = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                vocab_size=50, attention_bias=False, max_position_embeddings=512)
    base.update(kw)
    return EagleHeadConfig(**base)


def random_head(cfg: EagleHeadConfig, seed: int = 0, dtype=torch.float32) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    return head.to(dtype).eval()


def inputs(cfg, T, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, cfg.hidden_size, generator=g, dtype=dtype),
            torch.randn(T, cfg.hidden_size, generator=g, dtype=dtype))


F64 = dict(atol=1e-10, rtol=1e-10)  # structural tests run in float64: exact up to rounding


def test_module_does_not_import_vllm():
    import subprocess

    code = ("import sys, vllm_specplug.eagle.head, vllm_specplug.eagle.head3; "
            "print(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def test_state_dict_keys_are_checkpoint_keys():
    cfg = small_config()
    assert set(EagleHead(cfg).state_dict()) == set(cfg.expected_shapes())
    assert "layers.0.input_layernorm.weight" not in EagleHead(cfg).state_dict()
    cfg_b = small_config(attention_bias=True)
    assert "layers.0.self_attn.q_proj.bias" in EagleHead(cfg_b).state_dict()
    for k, v in EagleHead(cfg).state_dict().items():
        assert tuple(v.shape) == cfg.expected_shapes()[k], k


def test_incremental_kv_cache_equals_full_causal():
    cfg = small_config()
    head = random_head(cfg, dtype=torch.float64)
    e, f = inputs(cfg, 11, dtype=torch.float64)
    pos = torch.arange(11)
    with torch.no_grad():
        full, k_full, v_full = head(e, f, pos)
        outs, ks, vs = [], None, None
        for a, b in ((0, 4), (4, 5), (5, 8), (8, 11)):
            o, k, v = head(e[a:b], f[a:b], pos[a:b], ks, vs)
            outs.append(o)
            ks = k if ks is None else torch.cat((ks, k), 1)
            vs = v if vs is None else torch.cat((vs, v), 1)
    torch.testing.assert_close(torch.cat(outs), full, **F64)
    torch.testing.assert_close(ks, k_full, **F64)
    torch.testing.assert_close(vs, v_full, **F64)
    assert k_full.shape == (cfg.num_key_value_heads, 11, cfg.head_dim)


def test_tree_mask_equals_per_path_forward():
    cfg = small_config()
    head = random_head(cfg, seed=3, dtype=torch.float64)
    P = 5
    pe, pf = inputs(cfg, P, seed=4, dtype=torch.float64)
    # tree: 0 root children 1,2; 1 -> 3,4; 2 -> 5; 3 -> 6
    parents = [-1, 0, 0, 1, 1, 2, 3]
    T = len(parents)
    te, tf = inputs(cfg, T, seed=5, dtype=torch.float64)
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    with torch.no_grad():
        _, pk, pv = head(pe, pf, torch.arange(P))
        mask = torch.zeros(T, P + T, dtype=torch.bool)
        mask[:, :P] = True
        for i in range(T):
            j = i
            while j >= 0:
                mask[i, P + j] = True
                j = parents[j]
        tree_out, _, _ = head(te, tf, P + torch.tensor(depth), pk, pv, mask)
        for i in range(T):
            path = []
            j = i
            while j >= 0:
                path.append(j)
                j = parents[j]
            path = path[::-1]
            o, _, _ = head(te[path], tf[path], P + torch.arange(len(path)), pk, pv)
            torch.testing.assert_close(tree_out[i], o[-1], **F64)


def compare_with_hf_layer(head, layer, rope, start: int, change=None) -> float:
    """The head's forward over 9 random rows at positions ``start, start+1, ...``
    against a transformers decoder layer (input norm replaced by Identity, as
    vLLM's EAGLE-1 layer 0) fed by the head's ``fc`` and loaded with its
    weights (``change(name, tensor)`` alters them first). Returns the max error."""
    missing = layer.load_state_dict(
        {k[len("layers.0."):]: (v if change is None else change(k, v))
         for k, v in head.state_dict().items() if k.startswith("layers.")},
        strict=False)
    assert missing.missing_keys == ["input_layernorm.weight"] and not missing.unexpected_keys
    layer.input_layernorm = torch.nn.Identity()
    T = 9
    e, f = inputs(head.config, T, seed=start)
    pos = torch.arange(start, start + T)  # an offset start: RoPE must use the given positions
    with torch.no_grad():
        x = head.fc(torch.cat((e, f), -1))[None]
        cos, sin = rope(x, pos[None])
        causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
        ref = layer(x, attention_mask=causal, position_ids=pos[None],
                    position_embeddings=(cos, sin))
        ref = ref[0] if isinstance(ref, tuple) else ref
        ours, _, _ = head(e, f, pos)
    torch.testing.assert_close(ours, ref[0], atol=2e-5, rtol=1e-5)
    return (ours - ref[0]).abs().max().item()


@pytest.mark.parametrize("bias", [False, True])
def test_matches_transformers_llama_decoder_layer(bias):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = small_config(attention_bias=bias, rope_theta=50000.0)
    head = random_head(cfg, seed=7)
    hf_cfg = LlamaConfig(**{k: v for k, v in cfg.to_hf_dict().items()
                            if k not in ("architectures", "specplug_eagle")})
    hf_cfg._attn_implementation = "eager"
    compare_with_hf_layer(head, LlamaDecoderLayer(hf_cfg, layer_idx=0).eval(),
                          LlamaRotaryEmbedding(hf_cfg), start=3)


def test_batched_forward_equals_single():
    cfg = small_config()
    head = random_head(cfg, seed=9, dtype=torch.float64)
    e, f = inputs(cfg, 6, seed=10, dtype=torch.float64)
    e2, f2 = inputs(cfg, 6, seed=11, dtype=torch.float64)
    pos = torch.arange(6)
    with torch.no_grad():
        b, _, _ = head.forward_batched(torch.stack((e, e2)), torch.stack((f, f2)),
                                       torch.stack((pos, pos)))
        torch.testing.assert_close(b[1], head(e2, f2, pos)[0], **F64)


# -------------------------------------------------------------------- config


def test_config_from_transformers5_and_legacy_dicts():
    d5 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
          "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
          "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
    c = EagleHeadConfig.from_dict(d5)
    assert c.rope_theta == 100000.0 and c.head_dim == 64
    legacy = {**d5, "rope_theta": 5e5, "rope_scaling": None}
    del legacy["rope_parameters"], legacy["head_dim"]
    assert EagleHeadConfig.from_dict(legacy).rope_theta == 5e5
    assert EagleHeadConfig.from_dict(legacy).head_dim == 64
    assert EagleHeadConfig.from_dict(c.to_hf_dict()) == c
    # RoPE scaling (tests/test_head_rope.py has the numbers and the refusals)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    c3 = EagleHeadConfig.from_dict({**legacy, "rope_scaling": {**llama3, "type": "llama3"}})
    assert c3.rope_scaling == llama3 and c3.rope_theta == 5e5
    assert EagleHeadConfig.from_dict(c3.to_hf_dict()) == c3
    with pytest.raises(SpecPlugConfigError, match="rope_scaling .* is not a valid 'llama3' "
                                                  "RoPE scaling .*low_freq_factor"):
        EagleHeadConfig.from_dict({**legacy, "rope_scaling": {"rope_type": "llama3",
                                                              "factor": 8.0}})
    with pytest.raises(SpecPlugConfigError, match="not a valid 'yarn' RoPE scaling .*factor"):
        EagleHeadConfig.from_dict({**d5, "rope_parameters": {"rope_type": "yarn"}})
    with pytest.raises(SpecPlugConfigError, match="hidden_act"):
        EagleHeadConfig.from_dict({**d5, "hidden_act": "gelu"})


# -------------------------------------------------------------------- files


@pytest.fixture
def saved(tmp_path):
    cfg = small_config()
    head = random_head(cfg, seed=12)
    path = tmp_path / "head"
    save_head(head, cfg, path)
    return head, cfg, path


def test_save_load_round_trip(saved):
    head, cfg, path = saved
    d = json.loads((path / "config.json").read_text())
    assert d["architectures"] == ["LlamaForCausalLM"] and d["num_hidden_layers"] == 1
    assert set(load_file(str(path / "model.safetensors"))) == set(cfg.expected_shapes())
    loaded, cfg2 = load_head(path, hidden_size=64, vocab_size=50)
    assert cfg2 == cfg
    for k, v in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)
    check_head_folder(path, {"hidden_size": 64, "vocab_size": 50})
    half, _ = load_head(path, dtype=torch.bfloat16)
    assert half.fc.weight.dtype == torch.bfloat16


def _rewrite(path, change):
    t = load_file(str(path / "model.safetensors"))
    change(t)
    save_file(t, str(path / "model.safetensors"))


def _both_fail(path, match, **kw):
    with pytest.raises(SpecPlugConfigError, match=match) as e1:
        load_head(path, **kw)
    target = {"hidden_size": kw["hidden_size"]} if "hidden_size" in kw else None
    if "vocab_size" in kw:
        target = {**(target or {}), "vocab_size": kw["vocab_size"]}
    with pytest.raises(SpecPlugConfigError, match=match) as e2:
        check_head_folder(path, target)
    return str(e1.value), str(e2.value)


def test_missing_key(saved):
    _, _, path = saved
    _rewrite(path, lambda t: t.pop("layers.0.mlp.up_proj.weight"))
    msg, _ = _both_fail(path, r"missing tensor\(s\) layers.0.mlp.up_proj.weight")
    assert "model.safetensors" in msg


def test_wrong_shape(saved):
    _, _, path = saved
    _rewrite(path, lambda t: t.__setitem__("fc.weight", torch.zeros(64, 64)))
    msg, _ = _both_fail(path, r"fc.weight has shape \[64, 64\], expected \[64, 128\]")
    assert "config.json" in msg


def test_wrong_hidden_and_vocab_size(saved):
    _, _, path = saved
    msg, _ = _both_fail(path, "hidden_size is 64 but the target's is 576", hidden_size=576)
    assert "train-eagle" in msg
    _both_fail(path, "vocab_size is 50 but the target's is 49152", vocab_size=49152)


def test_eagle3_loads_as_eagle3_head(saved, tmp_path):
    from vllm_specplug.eagle import Eagle3Head, Eagle3HeadConfig, save_head3

    cfg3 = Eagle3HeadConfig(**{**vars(small_config()), "draft_vocab_size": 20,
                               "aux_layer_ids": (2, 4, 7)})
    path3 = tmp_path / "head3"
    save_head3(Eagle3Head(cfg3), cfg3, path3)
    head3, got = load_head(path3, hidden_size=64, vocab_size=50)
    assert isinstance(head3, Eagle3Head) and head3.kind == "eagle3" and got == cfg3
    assert head3.needs_aux_layers == (2, 4, 7)
    check_head_folder(path3, {"hidden_size": 64, "vocab_size": 50})
    head1, _ = load_head(saved[2])
    assert isinstance(head1, EagleHead) and head1.kind == "eagle1"
    # an EAGLE-1 file renamed to EAGLE-3 names is taken as a broken EAGLE-3 head
    _, _, path = saved

    def to_eagle3(t):
        for k in list(t):
            if k.startswith("layers.0."):
                t["midlayer." + k[len("layers.0."):]] = t.pop(k)
        t["d2t"] = torch.zeros(50, dtype=torch.int64)
        t["fc.weight"] = torch.zeros(64, 192)

    _rewrite(path, to_eagle3)
    msg, _ = _both_fail(path, r"missing tensor\(s\) midlayer.input_layernorm.weight, "
                              r"midlayer.hidden_norm.weight, norm.weight; an EAGLE-3 head needs")
    assert "model.safetensors" in msg


def test_fc_over_3_states_in_an_eagle1_folder(saved):
    _, _, path = saved
    _rewrite(path, lambda t: t.__setitem__("fc.weight", torch.zeros(64, 192)))
    _both_fail(path, r"fc.weight has shape \[64, 192\], expected \[64, 128\] .*an fc over 3 "
                     r"hidden states is EAGLE-3's")


def test_unknown_format_and_unexpected_keys(saved):
    _, _, path = saved
    _rewrite(path, lambda t: t.__setitem__("fc.bias", torch.zeros(64)))
    _both_fail(path, "unexpected tensor 'fc.bias'.*no fc bias")
    _rewrite(path, lambda t: (t.pop("fc.bias"), t.__setitem__(
        "layers.0.input_layernorm.weight", torch.ones(64))))
    _both_fail(path, "input_layernorm")
    save_file({"medusa_head.0.weight": torch.zeros(4, 4)}, str(path / "model.safetensors"))
    _both_fail(path, "not an EAGLE-1 head")


def test_tolerated_embed_and_lm_head(saved):
    _, _, path = saved
    _rewrite(path, lambda t: t.update({"embed_tokens.weight": torch.zeros(50, 64),
                                       "lm_head.weight": torch.zeros(50, 64)}))
    head, _ = load_head(path)
    assert head.ignored_tensors == ["embed_tokens.weight", "lm_head.weight"]
    check_head_folder(path)
    _rewrite(path, lambda t: t.__setitem__("embed_tokens.weight", torch.zeros(49, 64)))
    _both_fail(path, r"embed_tokens.weight has shape \[49, 64\]")


def test_config_problems(saved, tmp_path):
    _, _, path = saved
    cfg_path = path / "config.json"
    d = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**d, "num_hidden_layers": 2}))
    _both_fail(path, "num_hidden_layers is 2")
    cfg_path.write_text("{not json")
    _both_fail(path, "config.json: not valid JSON")
    cfg_path.unlink()
    _both_fail(path, "config.json: no such file")
    with pytest.raises(SpecPlugConfigError, match="does not exist"):
        load_head(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(d))
    _both_fail(empty, "no model.safetensors")
    (empty / "model.safetensors").write_bytes(b"garbage")
    _both_fail(empty, "not a readable safetensors file")


def _bin_folder(saved, tmp_path, obj):
    _, _, path = saved
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text((path / "config.json").read_text())
    torch.save(obj, folder / "pytorch_model.bin")
    return folder


class NotATensor:
    pass


def test_bin_checkpoint(saved, tmp_path):
    head, cfg, _ = saved
    folder = _bin_folder(saved, tmp_path, head.state_dict())
    loaded, _ = load_head(folder)
    assert torch.equal(loaded.fc.weight, head.fc.weight)
    check_head_folder(folder)


def test_bin_with_non_tensor_content_refused(saved, tmp_path):
    head, _, _ = saved
    obj = {**head.state_dict(), "evil": NotATensor()}
    folder = _bin_folder(saved, tmp_path, obj)
    msg, _ = _both_fail(folder, "refused to load .*weights_only=True")
    assert "pytorch_model.bin" in msg
    (folder / "pytorch_model.bin").unlink()
    torch.save({**head.state_dict(), "step": 3}, folder / "pytorch_model.bin")
    _both_fail(folder, "entries that are not tensors: 'step'")


# -------------------------------------------------------------------- trainer prompts


def test_builtin_prompts_not_from_spec_bench():
    from vllm_specplug.bench.prompts import load_prompts
    from vllm_specplug.eagle.prompts import build_prompt_set
    from vllm_specplug.eagle.train import load_prompt_texts

    ours = load_prompt_texts(None)
    assert len(ours) == 3164 and len(set(ours)) == len(ours)
    bench = {r["prompt"].strip() for r in load_prompts()}
    assert not bench & {p.strip() for p in ours}
    # the template part is reproducible from the generator
    templates = {r["prompt"] for r in build_prompt_set()}
    assert templates <= set(ours) and len(templates) == 3000


def test_prompt_file_errors(tmp_path):
    from vllm_specplug.eagle.train import TrainError, load_prompt_texts

    good = tmp_path / "p.jsonl"
    good.write_text('{"text": "a"}\n\n{"prompt": "b", "text": "ignored"}\n')
    assert load_prompt_texts(str(good)) == ["a", "b"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(TrainError, match="bad.jsonl:2: not JSON"):
        load_prompt_texts(str(bad))
    bad.write_text('{"question": "a"}\n')
    with pytest.raises(TrainError, match="line 1: no 'prompt' or 'text'"):
        load_prompt_texts(str(bad))
    with pytest.raises(TrainError, match="no such file"):
        load_prompt_texts(str(tmp_path / "missing.jsonl"))
