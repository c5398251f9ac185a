"""EAGLE-1 head: numerics (KV cache, tree masks, transformers reference) and
checkpoint I/O (round trip, every bad-file case). No engine: seconds."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import (F64, bin_folder, both_fail, compare_with_hf_layer, head_inputs,
                     random_head, rewrite_weights, small_config)

from vllm_specplug.eagle import EagleHead, EagleHeadConfig, check_head_folder, load_head, \
    save_head
from vllm_specplug.options import SpecPlugConfigError


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
    e, f = head_inputs(cfg, 11, dtype=torch.float64)
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
    pe, pf = head_inputs(cfg, P, seed=4, dtype=torch.float64)
    # tree: 0 root children 1,2; 1 -> 3,4; 2 -> 5; 3 -> 6
    parents = [-1, 0, 0, 1, 1, 2, 3]
    T = len(parents)
    te, tf = head_inputs(cfg, T, seed=5, dtype=torch.float64)
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
    e, f = head_inputs(cfg, 6, seed=10, dtype=torch.float64)
    e2, f2 = head_inputs(cfg, 6, seed=11, dtype=torch.float64)
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


def test_missing_key(saved):
    _, _, path = saved
    rewrite_weights(path, lambda t: t.pop("layers.0.mlp.up_proj.weight"))
    msg, _ = both_fail(path, r"missing tensor\(s\) layers.0.mlp.up_proj.weight")
    assert "model.safetensors" in msg


def test_wrong_shape(saved):
    _, _, path = saved
    rewrite_weights(path, lambda t: t.__setitem__("fc.weight", torch.zeros(64, 64)))
    msg, _ = both_fail(path, r"fc.weight has shape \[64, 64\], expected \[64, 128\]")
    assert "config.json" in msg


def test_wrong_hidden_and_vocab_size(saved):
    _, _, path = saved
    msg, _ = both_fail(path, "hidden_size is 64 but the target's is 576", hidden_size=576)
    assert "train-eagle" in msg
    both_fail(path, "vocab_size is 50 but the target's is 49152", vocab_size=49152)


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

    rewrite_weights(path, to_eagle3)
    msg, _ = both_fail(path, r"missing tensor\(s\) midlayer.input_layernorm.weight, "
                              r"midlayer.hidden_norm.weight, norm.weight; an EAGLE-3 head needs")
    assert "model.safetensors" in msg


def test_fc_over_3_states_in_an_eagle1_folder(saved):
    _, _, path = saved
    rewrite_weights(path, lambda t: t.__setitem__("fc.weight", torch.zeros(64, 192)))
    both_fail(path, r"fc.weight has shape \[64, 192\], expected \[64, 128\] .*an fc over 3 "
                     r"hidden states is EAGLE-3's")


def test_unknown_format_and_unexpected_keys(saved):
    _, _, path = saved
    rewrite_weights(path, lambda t: t.__setitem__("fc.bias", torch.zeros(64)))
    both_fail(path, "unexpected tensor 'fc.bias'.*no fc bias")
    rewrite_weights(path, lambda t: (t.pop("fc.bias"), t.__setitem__(
        "layers.0.input_layernorm.weight", torch.ones(64))))
    both_fail(path, "input_layernorm")
    save_file({"medusa_head.0.weight": torch.zeros(4, 4)}, str(path / "model.safetensors"))
    both_fail(path, "not an EAGLE-1 head")


def test_tolerated_embed_and_lm_head(saved):
    _, _, path = saved
    rewrite_weights(path, lambda t: t.update({"embed_tokens.weight": torch.zeros(50, 64),
                                       "lm_head.weight": torch.zeros(50, 64)}))
    head, _ = load_head(path)
    assert head.ignored_tensors == ["embed_tokens.weight", "lm_head.weight"]
    check_head_folder(path)
    rewrite_weights(path, lambda t: t.__setitem__("embed_tokens.weight", torch.zeros(49, 64)))
    both_fail(path, r"embed_tokens.weight has shape \[49, 64\]")


def test_config_problems(saved, tmp_path):
    _, _, path = saved
    cfg_path = path / "config.json"
    d = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**d, "num_hidden_layers": 2}))
    both_fail(path, "num_hidden_layers is 2")
    cfg_path.write_text("{not json")
    both_fail(path, "config.json: not valid JSON")
    cfg_path.unlink()
    both_fail(path, "config.json: no such file")
    with pytest.raises(SpecPlugConfigError, match="does not exist"):
        load_head(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(d))
    both_fail(empty, "no model.safetensors")
    (empty / "model.safetensors").write_bytes(b"garbage")
    both_fail(empty, "not a readable safetensors file")


class NotATensor:
    pass


def test_bin_checkpoint(saved, tmp_path):
    head, cfg, _ = saved
    folder = bin_folder(saved, tmp_path, head.state_dict())
    loaded, _ = load_head(folder)
    assert torch.equal(loaded.fc.weight, head.fc.weight)
    check_head_folder(folder)


def test_bin_with_non_tensor_content_refused(saved, tmp_path):
    head, _, _ = saved
    obj = {**head.state_dict(), "evil": NotATensor()}
    folder = bin_folder(saved, tmp_path, obj)
    msg, _ = both_fail(folder, "refused to load .*weights_only=True")
    assert "pytorch_model.bin" in msg
    (folder / "pytorch_model.bin").unlink()
    torch.save({**head.state_dict(), "step": 3}, folder / "pytorch_model.bin")
    both_fail(folder, "entries that are not tensors: 'step'")


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
