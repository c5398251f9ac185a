"""EAGLE-3 head: numerics against a reference written from the math (full
causal attention, GQA, RoPE), KV cache and tree masks, the d2t mapping of the
draft logits, vLLM's default aux layers, and checkpoint I/O. No engine."""
from __future__ import annotations

import ast
import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from helpers import F64, bin_folder, both_fail, rewrite_weights, small_config

from vllm_specplug.eagle import (Eagle3Head, Eagle3HeadConfig, EagleHead, check_head_folder,
                                 default_aux_layers, load_head, save_head3)
from vllm_specplug.options import SpecPlugConfigError

H, VOCAB, DRAFT = 64, 50, 20


def config3(**kw) -> Eagle3HeadConfig:
    """helpers.small_config's Llama (h 64, 4/2 heads, vocab 50) as an EAGLE-3
    head with a 20-token draft vocabulary."""
    fields = {**vars(small_config()), "draft_vocab_size": DRAFT, "aux_layer_ids": (2, 5, 9)}
    return Eagle3HeadConfig(**{**fields, **kw})


def random_head3(cfg: Eagle3HeadConfig, seed: int = 0, dtype=torch.float64) -> Eagle3Head:
    """N(0, 0.2) weights, norm weights around 1, d2t: draft id i -> 2i + 1."""
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
        if head.d2t is not None:
            head.d2t.copy_(torch.arange(cfg.draft_vocab_size) + 1)
    return head.to(dtype).eval()


def seq(T, seed, dtype=torch.float64, width=H):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, width, generator=g, dtype=dtype),
            torch.randn(T, width, generator=g, dtype=dtype))


def reference(head: Eagle3Head, e, f, pos, allowed=None):
    """EAGLE-3's layer from the math, in float64, over a whole sequence:
    ``allowed[i, j]`` True when token i attends token j (default causal)."""
    cfg = head.config
    w = {k: v.double() for k, v in head.state_dict().items()}
    nh, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    T = e.shape[0]

    def rms(x, weight):
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    def lin(x, name):
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    def rope(t):  # t [T, heads, d]; angle = pos * theta^(-2i/d), halves rotated
        ang = pos.double()[:, None] * cfg.rope_theta ** (-2 * torch.arange(d // 2).double() / d)
        c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
        t1, t2 = t[..., :d // 2], t[..., d // 2:]
        return torch.cat((t1 * c - t2 * s, t2 * c + t1 * s), -1)

    en = rms(e, w["midlayer.input_layernorm.weight"])
    fn = rms(f, w["midlayer.hidden_norm.weight"])
    x = torch.cat((en, fn), -1)
    q = rope(lin(x, "midlayer.self_attn.q_proj").view(T, nh, d))
    k = rope(lin(x, "midlayer.self_attn.k_proj").view(T, kvh, d))
    v = lin(x, "midlayer.self_attn.v_proj").view(T, kvh, d)
    if allowed is None:
        allowed = torch.ones(T, T, dtype=torch.bool).tril()
    heads = []
    for i in range(nh):
        g = i // (nh // kvh)  # GQA: consecutive query heads share a KV head
        scores = (q[:, i] @ k[:, g].T / math.sqrt(d)).masked_fill(~allowed, float("-inf"))
        heads.append(torch.softmax(scores, -1) @ v[:, g])
    a = lin(torch.cat(heads, -1), "midlayer.self_attn.o_proj")
    r = a + (fn if cfg.norm_before_residual else f)
    m = rms(r, w["midlayer.post_attention_layernorm.weight"])
    out = r + lin(F.silu(lin(m, "midlayer.mlp.gate_proj")) * lin(m, "midlayer.mlp.up_proj"),
                  "midlayer.mlp.down_proj")
    return rms(out, w["norm.weight"]) if cfg.norm_output else out


REF = dict(atol=2e-5, rtol=2e-5)  # RMSNorm runs in float32 inside the module


def test_state_dict_keys_are_checkpoint_keys():
    for cfg in (config3(), config3(draft_vocab_size=VOCAB), config3(attention_bias=True),
                config3(own_embed_tokens=True, own_lm_head=False, draft_vocab_size=VOCAB)):
        sd = Eagle3Head(cfg).state_dict()
        assert {k: tuple(v.shape) for k, v in sd.items()} == cfg.expected_shapes()
    shapes = config3().expected_shapes()
    assert shapes["fc.weight"] == (H, 3 * H)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (64, 2 * H)
    assert shapes["lm_head.weight"] == (DRAFT, H) and shapes["d2t"] == (DRAFT,)
    assert "d2t" not in config3(draft_vocab_size=VOCAB).expected_shapes()
    assert config3(target_hidden_size=32).expected_shapes()["fc.weight"] == (H, 96)
    assert Eagle3Head(config3()).kind == "eagle3" and EagleHead.kind == "eagle1"


def test_config_round_trip_through_config_json():
    for cfg in (config3(), config3(aux_layer_ids=None, draft_vocab_size=VOCAB),
                config3(target_hidden_size=32, norm_before_residual=True, norm_output=True,
                        logit_scale=0.5, num_aux_hidden_states=4, aux_layer_ids=(1, 2, 3, 4))):
        assert Eagle3HeadConfig.from_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg
    with pytest.raises(SpecPlugConfigError, match="draft_vocab_size 60 must be between 1 and "
                                                  "vocab_size 50"):
        Eagle3HeadConfig.from_dict({**config3().to_hf_dict(), "draft_vocab_size": 60})


@pytest.mark.parametrize("variant", [{}, {"attention_bias": True},
                                     {"norm_before_residual": True}, {"norm_output": True}])
def test_forward_equals_reference(variant):
    cfg = config3(rope_theta=50000.0, **variant)
    head = random_head3(cfg, seed=1)
    e, f = seq(9, seed=2)
    pos = torch.arange(4, 13)  # offset start: RoPE must use the given positions
    with torch.no_grad():
        out, k, v = head(e, f, pos)
        ref = reference(head, e, f, pos)
    torch.testing.assert_close(out, ref, **REF)
    assert k.shape == v.shape == (cfg.num_key_value_heads, 9, cfg.head_dim)
    assert (out - ref).abs().max() < 1e-3 * ref.abs().max()


def test_reference_catches_a_wrong_layer():
    """The reference is sensitive to what it checks: swapping the embedding
    and feature halves of the q/k/v input, or other relative positions
    (RoPE is relative: a constant shift changes nothing), changes the output."""
    head = random_head3(config3(), seed=1)
    e, f = seq(6, seed=3)
    pos = torch.arange(6)
    with torch.no_grad():
        ours, _, _ = head(e, f, pos)
        assert not torch.allclose(ours, reference(head, f, e, pos), **REF)
        assert not torch.allclose(ours, reference(head, e, f, 2 * pos), **REF)
        torch.testing.assert_close(ours, reference(head, e, f, pos + 7), **REF)


def test_incremental_kv_cache_equals_full_forward():
    """Decoding in chunks with the returned keys/values as the cache gives the
    full forward's outputs and cache."""
    head = random_head3(config3(), seed=4)
    e, f = seq(11, seed=5)
    pos = torch.arange(11)
    with torch.no_grad():
        full = head(e, f, pos)
        cache = [torch.zeros(2, 0, 16, dtype=torch.float64)] * 2
        pieces = []
        for chunk in torch.tensor_split(torch.arange(11), (3, 4, 9)):
            out, k, v = head(e[chunk], f[chunk], pos[chunk], *cache)
            cache = [torch.cat((cache[0], k), 1), torch.cat((cache[1], v), 1)]
            pieces.append(out)
    for got, want in zip((torch.cat(pieces), *cache), full):
        torch.testing.assert_close(got, want, **F64)


def test_tree_mask_equals_reference_per_path():
    head = random_head3(config3(), seed=6)
    P = 4
    pe, pf = seq(P, seed=7)
    parents = [-1, 0, 0, 1, 1, 2, 4]  # 0 -> 1, 2; 1 -> 3, 4; 2 -> 5; 4 -> 6
    T = len(parents)
    te, tf = seq(T, seed=8)
    paths = []
    for i in range(T):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        paths.append(path[::-1])
    mask = torch.zeros(T, P + T, dtype=torch.bool)
    mask[:, :P] = True
    for i, path in enumerate(paths):
        mask[i, [P + j for j in path]] = True
    depth = torch.tensor([len(p) - 1 for p in paths])
    with torch.no_grad():
        _, pk, pv = head(pe, pf, torch.arange(P))
        tree, _, _ = head(te, tf, P + depth, pk, pv, mask)
        for i, path in enumerate(paths):
            ref = reference(head, torch.cat((pe, te[path])), torch.cat((pf, tf[path])),
                            torch.arange(P + len(path)))
            torch.testing.assert_close(tree[i], ref[-1], **REF)


def test_batched_forward_and_fuse():
    cfg = config3(target_hidden_size=32)
    head = random_head3(cfg, seed=9)
    e, f = seq(5, seed=10)
    e2, f2 = seq(5, seed=11)
    pos = torch.arange(5)
    aux = torch.randn(2, 5, 96, dtype=torch.float64)
    with torch.no_grad():
        b, _, _ = head.forward_batched(torch.stack((e, e2)), torch.stack((f, f2)),
                                       torch.stack((pos, pos)))
        torch.testing.assert_close(b[1], head(e2, f2, pos)[0], **F64)
        torch.testing.assert_close(head.fuse(aux), aux @ head.fc.weight.T, **F64)
        with pytest.raises(ValueError, match="width 64, expected 96"):
            head.fuse(aux[..., :64])


# -------------------------------------------------------------------- logits


def _logit_head(draft, vocab, d2t):
    """norm = identity on all-ones hidden, lm_head row j gives logit j + 1."""
    cfg = Eagle3HeadConfig(hidden_size=4, intermediate_size=8, num_attention_heads=1,
                           num_key_value_heads=1, head_dim=4, rms_norm_eps=0.0,
                           vocab_size=vocab, draft_vocab_size=draft, aux_layer_ids=(1, 2, 3))
    head = Eagle3Head(cfg)
    with torch.no_grad():
        head.norm.weight.fill_(1.0)
        head.lm_head.weight.copy_((torch.arange(draft, dtype=torch.float)[:, None] + 1) / 4)
        if d2t is not None:
            head.d2t.copy_(torch.tensor(d2t))
    return head


def test_logits_map_draft_ids_through_d2t():
    # draft 0 -> target 0 + 1 = 1, draft 1 -> 1 + 2 = 3, draft 2 -> 2 + 0 = 2
    head = _logit_head(3, 6, [1, 2, 0])
    assert head.target_ids().tolist() == [1, 3, 2]
    lp = head.logits(torch.ones(2, 4))  # draft logits [1, 2, 3]
    z = math.log(math.exp(1) + math.exp(2) + math.exp(3))
    inf = float("-inf")
    expected = torch.tensor([inf, 1 - z, 3 - z, 2 - z, inf, inf])
    assert lp.shape == (2, 6) and lp.dtype == torch.float32
    torch.testing.assert_close(lp[0], expected)
    torch.testing.assert_close(lp[1], expected)
    assert torch.isclose(lp[0].exp().sum(), torch.tensor(1.0))
    assert lp[0].argmax() == 2  # the best draft id (2) comes back as target id 2


def test_logits_without_d2t_and_without_own_lm_head():
    head = _logit_head(4, 4, None)
    assert head.d2t is None
    torch.testing.assert_close(head.logits(torch.ones(4)),
                               torch.log_softmax(torch.tensor([1., 2., 3., 4.]), -1))
    cfg = config3(draft_vocab_size=VOCAB, own_lm_head=False)
    shared = random_head3(cfg, seed=12, dtype=torch.float32)
    with pytest.raises(ValueError, match="no lm_head of its own"):
        shared.logits(torch.randn(H))
    target_lm = torch.randn(VOCAB, H)
    h = torch.randn(3, H)
    torch.testing.assert_close(shared.logits(h, target_lm),
                               torch.log_softmax(shared.norm(h) @ target_lm.T, -1))


def test_eagle1_logits_use_the_given_lm_head():
    from vllm_specplug.eagle import EagleHeadConfig

    head = EagleHead(EagleHeadConfig(hidden_size=64, intermediate_size=96,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    h, w = torch.randn(3, 64), torch.randn(50, 64)
    torch.testing.assert_close(head.logits(h, w), torch.log_softmax(h @ w.T, -1))


# -------------------------------------------------------------------- aux layers


def test_default_aux_layers_hand_values():
    assert default_aux_layers(30) == (2, 15, 27)  # SmolLM2-135M
    assert default_aux_layers(32) == (2, 16, 29)  # Llama-3.1-8B
    assert default_aux_layers(80) == (2, 40, 77)  # Llama-3.3-70B
    head = Eagle3Head(config3(aux_layer_ids=None, num_target_layers=32))
    assert head.needs_aux_layers == (2, 16, 29)
    assert Eagle3Head(config3(aux_layer_ids=(9, 2, 5))).needs_aux_layers == (2, 5, 9)
    with pytest.raises(SpecPlugConfigError, match="num_target_layers="):
        Eagle3Head(config3(aux_layer_ids=None)).needs_aux_layers


def _vllm_file(rel: str) -> Path:
    spec = importlib.util.find_spec("vllm")  # locates vLLM without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    return Path(spec.submodule_search_locations[0]) / rel


def _method(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    return None


def test_default_aux_layers_equal_vllms():
    """Runs the installed vLLM's own default-layer method (taken from its source:
    importing vLLM takes ~20 s) and checks that its Llama does not override it."""
    name = "get_eagle3_default_aux_hidden_state_layers"
    interfaces = ast.parse(_vllm_file("model_executor/models/interfaces.py").read_text())
    fn = _method(interfaces, "SupportsEagle3", name)
    assert fn is not None, "vLLM's SupportsEagle3 has no " + name
    ns: dict = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "interfaces.py", "exec"), ns)
    llama = _vllm_file("model_executor/models/llama.py").read_text()
    assert f"def {name}" not in llama
    cls = next(n for n in ast.parse(llama).body
               if isinstance(n, ast.ClassDef) and n.name == "LlamaForCausalLM")
    assert "SupportsEagle3" in [ast.unparse(b) for b in cls.bases]
    for n in (7, 16, 22, 28, 30, 32, 40, 80, 126):
        model = SimpleNamespace(model=SimpleNamespace(layers=[None] * n))
        assert default_aux_layers(n) == tuple(ns[name](model)), n


# -------------------------------------------------------------------- files


def folder3(where: Path, seed: int = 13, **kw) -> tuple[Eagle3Head, Eagle3HeadConfig, Path]:
    """A random head saved with save_head3 (config3(**kw)) in ``where``."""
    head = random_head3(config3(**kw), seed=seed, dtype=torch.float32)
    save_head3(head, head.config, where)
    return head, head.config, where


@pytest.fixture
def saved3(tmp_path):
    return folder3(tmp_path / "head3")


def test_save_load_round_trip(saved3):
    head, cfg, path = saved3
    d = json.loads((path / "config.json").read_text())
    assert d["architectures"] == ["LlamaForCausalLMEagle3"] and d["num_hidden_layers"] == 1
    assert d["draft_vocab_size"] == DRAFT and d["eagle_aux_hidden_state_layer_ids"] == [2, 5, 9]
    tensors = load_file(str(path / "model.safetensors"))
    assert set(tensors) == set(cfg.expected_shapes())
    assert tensors["d2t"].dtype == torch.int64 and "midlayer.hidden_norm.weight" in tensors
    loaded, cfg2 = load_head(path, hidden_size=H, vocab_size=VOCAB)
    assert isinstance(loaded, Eagle3Head) and cfg2 == cfg and loaded.kind == "eagle3"
    assert loaded.needs_aux_layers == (2, 5, 9)
    for k, v in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    check_head_folder(path, {"hidden_size": H, "vocab_size": VOCAB, "num_hidden_layers": 12})
    half, _ = load_head(path, dtype=torch.bfloat16)
    assert half.fc.weight.dtype == torch.bfloat16 and half.d2t.dtype == torch.int64
    assert half.inv_freq.dtype == torch.float32
    e, f = seq(3, seed=14, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(e, f, torch.arange(3))[0], head(e, f, torch.arange(3))[0])


def test_config_without_layer_ids_takes_vllms_default(saved3):
    _, _, path = saved3
    cfg_path = path / "config.json"
    d = json.loads(cfg_path.read_text())
    del d["eagle_aux_hidden_state_layer_ids"]
    cfg_path.write_text(json.dumps(d))
    head, cfg = load_head(path, num_target_layers=30)
    assert cfg.aux_layer_ids is None and head.needs_aux_layers == (2, 15, 27)
    d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}
    cfg_path.write_text(json.dumps(d))
    assert load_head(path)[0].needs_aux_layers == (1, 3, 6)
    d["eagle_aux_hidden_state_layer_ids"] = [1, 3]
    cfg_path.write_text(json.dumps(d))
    both_fail(path, r"names 2 distinct layers but the head's fc takes 3")


def test_layers0_spelling_and_bin_file(saved3, tmp_path):
    head, _, path = saved3
    rewrite_weights(path, lambda t: t.update(
        {"layers.0." + k[len("midlayer."):]: t.pop(k) for k in list(t) if k.startswith("mid")}))
    loaded, _ = load_head(path)
    assert torch.equal(loaded.midlayer.hidden_norm.weight, head.midlayer.hidden_norm.weight)
    folder = bin_folder(saved3, tmp_path, head.state_dict())
    assert torch.equal(load_head(folder)[0].fc.weight, head.fc.weight)
    check_head_folder(folder)


def test_wrong_shaped_fc(saved3):
    _, _, path = saved3
    rewrite_weights(path, lambda t: t.__setitem__("fc.weight", torch.zeros(H, 2 * H)))
    msg, _ = both_fail(path, r"fc.weight has shape \[64, 128\], expected \[64, 192\]")
    assert "model.safetensors" in msg and "config.json" in msg


def test_missing_d2t_and_lm_head(saved3):
    _, _, path = saved3
    rewrite_weights(path, lambda t: t.pop("d2t"))
    msg, _ = both_fail(path, r"missing tensor d2t: config.json's draft_vocab_size 20 < vocab_size "
                           r"50, so the head needs the draft-to-target id map")
    assert "model.safetensors" in msg
    rewrite_weights(path, lambda t: (t.__setitem__("d2t", torch.zeros(DRAFT, dtype=torch.int64)),
                              t.pop("lm_head.weight")))
    both_fail(path, "missing tensor lm_head.weight: .*its own LM head")


def test_pickle_refused(saved3, tmp_path):
    head = saved3[0]
    folder = bin_folder(saved3, tmp_path, {**head.state_dict(), "evil": SimpleNamespace(x=1)})
    msg, _ = both_fail(folder, "refused to load .*weights_only=True")
    assert "pytorch_model.bin" in msg


def test_head_for_another_model(saved3):
    _, _, path = saved3
    msg, _ = both_fail(path, r"model.safetensors: fc.weight has shape \[64, 192\], but the "
                           r"target's hidden_size 576 needs \[64, 1728\]", hidden_size=576)
    assert "another model" in msg
    both_fail(path, "vocab_size is 50 but the target's is 49152", vocab_size=49152)
    too_few = r"\[2, 5, 9\] go past the target's 6 layers"
    with pytest.raises(SpecPlugConfigError, match=too_few):
        load_head(path, num_target_layers=6)
    with pytest.raises(SpecPlugConfigError, match=too_few):
        check_head_folder(path, {"text_config": {"num_hidden_layers": 6}})
    cfg_path = path / "config.json"
    d = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**d, "target_hidden_size": 576}))
    both_fail(path, r"fc.weight has shape \[64, 192\], expected \[64, 1728\]")


def test_own_embedding_and_lm_head_for_full_vocab(tmp_path):
    head, _, path = folder3(tmp_path / "h", seed=15, draft_vocab_size=VOCAB, own_embed_tokens=True)
    loaded, cfg2 = load_head(path, hidden_size=H, vocab_size=VOCAB)
    assert cfg2.own_embed_tokens and loaded.d2t is None
    assert torch.equal(loaded.embed_tokens.weight, head.embed_tokens.weight)
    rewrite_weights(path, lambda t: t.__setitem__("d2t", torch.zeros(VOCAB, dtype=torch.int64)))
    both_fail(path, "unexpected tensor 'd2t' .*set draft_vocab_size")
    rewrite_weights(path, lambda t: (t.pop("d2t"), t.__setitem__("lm_head.weight",
                                                                      torch.zeros(49, H))))
    both_fail(path, r"lm_head.weight has shape \[49, 64\], expected \[50, 64\]",
               vocab_size=VOCAB)


def test_bad_vocab_maps(saved3):
    _, _, path = saved3
    rewrite_weights(path, lambda t: t.__setitem__("d2t", torch.full((DRAFT,), 40)))
    with pytest.raises(SpecPlugConfigError, match=r"d2t maps draft id 10 to target id 50, "
                                                  r"outside the target vocabulary \[0, 50\)"):
        load_head(path)
    rewrite_weights(path, lambda t: t.__setitem__("d2t", torch.tensor([1] + [0] * (DRAFT - 1))))
    with pytest.raises(SpecPlugConfigError, match="two draft ids to the same target id"):
        load_head(path)
    ok = torch.arange(DRAFT) + 1
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[torch.arange(DRAFT) + ok] = True
    rewrite_weights(path, lambda t: t.update({"d2t": ok, "t2d": t2d}))
    assert load_head(path)[0].ignored_tensors == ["t2d"]
    rewrite_weights(path, lambda t: t.__setitem__("t2d", ~t2d))
    with pytest.raises(SpecPlugConfigError, match="t2d does not mark exactly"):
        load_head(path)
    rewrite_weights(path, lambda t: t.__setitem__("t2d", torch.zeros(VOCAB + 1, dtype=torch.bool)))
    both_fail(path, r"t2d has shape \[51\], expected \[50\]")
    rewrite_weights(path, lambda t: (t.pop("t2d"), t.__setitem__("d2t", ok.float())))
    with pytest.raises(SpecPlugConfigError, match="d2t must be an integer tensor"):
        load_head(path)


def test_unsupported_variants(saved3):
    _, _, path = saved3
    cfg_path = path / "config.json"
    d = json.loads(cfg_path.read_text())
    for extra, match in (({"num_hidden_layers": 2}, "num_hidden_layers is 2"),
                         ({"norm_before_fc": True}, "norm_before_fc true"),
                         ({"eagle_config": {"use_aux_hidden_state": False}},
                          "use_aux_hidden_state false"),
                         ({"speculators_model_type": "eagle3"}, "speculators"),
                         ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0],
                                            "long_factor": [1.0]}},
                          r"rope_scaling\['rope_type'\] 'longrope' is not supported")):
        cfg_path.write_text(json.dumps({**d, **extra}))
        both_fail(path, match)
    cfg_path.write_text(json.dumps(d))
    rewrite_weights(path, lambda t: t.__setitem__("mask_hidden", torch.zeros(3 * H)))
    both_fail(path, "unexpected tensor 'mask_hidden' .*parallel-drafting")
    rewrite_weights(path, lambda t: (t.pop("mask_hidden"), t.__setitem__("layers.1.hidden_norm.weight",
                                                                    torch.ones(H))))
    both_fail(path, "more than one decoder layer")
