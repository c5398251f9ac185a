"""The EAGLE-3 draft head (pure torch: no vLLM import) and its checkpoint
validation; ``loading.load_head`` returns one for an EAGLE-3 folder (shared
pieces, RoPE scaling included: ``common``).

Checkpoint format: EAGLE-3 as vLLM 0.32 loads it for ``"method": "eagle3"``
(``vllm/model_executor/models/llama_eagle3.py``: ``Eagle3LlamaForCausalLM``).
A folder with ``config.json`` (a LlamaConfig with ``num_hidden_layers: 1``,
``architectures: ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size`` and
optionally ``target_hidden_size`` / ``eagle_aux_hidden_state_layer_ids``) and
``model.safetensors``::

    fc.weight                                    [h, n_aux * target_h]  (n_aux = 3)
    midlayer.input_layernorm.weight              [h]     (on the token embedding)
    midlayer.hidden_norm.weight                  [h]     (on the feature)
    midlayer.self_attn.{q,k,v}_proj.weight       [*, 2h] (+ .bias if attention_bias)
    midlayer.self_attn.o_proj.weight             [h, heads * head_dim] (+ .bias, idem)
    midlayer.mlp.{gate,up,down}_proj.weight
    midlayer.post_attention_layernorm.weight     [h]
    norm.weight                                  [h]     (final norm, before lm_head)
    lm_head.weight                               [draft_vocab, h]
    d2t                                          [draft_vocab] int (draft_vocab < vocab)
    t2d                                          [vocab] bool (optional; unused)
    embed_tokens.weight                          [vocab, h] (optional; else the target's)

(``layers.0.`` instead of ``midlayer.`` is accepted too: vLLM maps one to the
other.) Forward (vLLM's), for target position i::

    feature[i] = fc(cat(aux_1[i], aux_2[i], aux_3[i]))    # fuse(); target features
    x   = cat(input_layernorm(embed(token[i+1])), hidden_norm(feature[i]))   # [2h]
    r   = attn(x) + feature[i]                            # RoPE, GQA, causal
    out = r + mlp(post_attention_layernorm(r))            # fed back as the next feature
    draft logits = lm_head(norm(out)), mapped to target ids by d2t

``aux_j`` are the target's residual stream (hidden + residual, before the
final norm) after layers ``2, L // 2, L - 3`` of an L-layer Llama by default
(``default_aux_layers``; vLLM's ``get_eagle3_default_aux_hidden_state_layers``;
layer id n = the output of decoder layer n - 1 = transformers'
``hidden_states[n]``), concatenated in increasing layer order, or the layers
config.json names. Deeper draft steps feed ``out`` (pre-norm) back as the
feature (vLLM's ``hidden_prenorm``; with ``norm_output`` the normed one).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..options import SpecPlugConfigError
from .common import (CONFIG_FILE, EagleHeadConfig, HeadBase, RMSNorm, _Attention, _MLP, attend,
                     check_shapes, describe_sizes, save_head)

ARCHITECTURE = "LlamaForCausalLMEagle3"
LAYER = "midlayer."
ALT_LAYER = "layers.0."
_HOW_TO_FIX3 = ("an EAGLE-3 head folder holds config.json (a LlamaConfig with num_hidden_layers "
                "1, architectures [\"LlamaForCausalLMEagle3\"], draft_vocab_size) and "
                "model.safetensors in vLLM's llama_eagle3 layout")


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """The target layers vLLM 0.32 takes the aux hidden states from for a Llama
    target with ``num_target_layers`` decoder layers when the head's config
    names none (``SupportsEagle3.get_eagle3_default_aux_hidden_state_layers``;
    vLLM then keeps the sorted distinct ids)."""
    n = int(num_target_layers)
    return (2, n // 2, n - 3)


def _int_list(value: Any, where: str, key: str) -> tuple[int, ...] | None:
    if value is None or value == []:
        return None
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise SpecPlugConfigError(f"{where}: {key} must be a list of layer numbers (integers "
                                  f">= 0), got {value!r}")
    return tuple(value)


@dataclass
class Eagle3HeadConfig(EagleHeadConfig):
    """The Llama fields of ``EagleHeadConfig`` plus EAGLE-3's. ``aux_layer_ids``
    None: vLLM's default for the target (``num_target_layers`` must be known)."""
    draft_vocab_size: int | None = None        # None: vocab_size
    target_hidden_size: int | None = None      # None: hidden_size
    num_aux_hidden_states: int = 3
    aux_layer_ids: tuple[int, ...] | None = None
    num_target_layers: int | None = None
    norm_before_residual: bool = False
    norm_output: bool = False
    logit_scale: float = 1.0
    own_lm_head: bool = True
    own_embed_tokens: bool = False

    def __post_init__(self) -> None:
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.aux_layer_ids is not None:
            self.aux_layer_ids = tuple(self.aux_layer_ids)
        if self.qkv_bias is not None and self.qkv_bias != self.attention_bias:
            raise ValueError("vLLM's EAGLE-3 layer has q/k/v biases exactly when it has "
                             "attention_bias (o_proj too); leave qkv_bias None")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "config",
                  num_target_layers: int | None = None, own_lm_head: bool = True,
                  own_embed_tokens: bool = False) -> "Eagle3HeadConfig":
        """From the head's config.json dict, read as vLLM's llama_eagle3 does."""
        # vLLM's llama_eagle3 layer: q/k/v biases from attention_bias alone
        # (qkv_bias is not read), o_proj's from attention_bias or bias
        if d.get("bias") and not d.get("attention_bias"):
            raise SpecPlugConfigError(
                f"{where}: bias true with attention_bias false (an o_proj bias without q/k/v "
                f"biases) is not supported for EAGLE-3 heads; set attention_bias")
        base = super().from_dict({**d, "qkv_bias": None}, where=where)
        if d.get("speculators_model_type") or d.get("transformer_layer_config"):
            raise SpecPlugConfigError(
                f"{where}: a `speculators`-format config; only vLLM's plain llama_eagle3 "
                f"config.json is supported; " + _HOW_TO_FIX3)
        eagle = d.get("eagle_config") or {}
        if not isinstance(eagle, Mapping):
            raise SpecPlugConfigError(f"{where}: eagle_config must be an object")
        if eagle.get("use_aux_hidden_state", True) is not True:
            raise SpecPlugConfigError(f"{where}: eagle_config.use_aux_hidden_state false (a "
                                      f"head without the fc over aux hidden states) is not "
                                      f"supported")
        for key in ("norm_before_fc", "fc_norm"):
            if eagle.get(key, d.get(key, False)):
                raise SpecPlugConfigError(f"{where}: {key} true (extra norms before the fc) is "
                                          f"not supported by the EAGLE-3 head")
        # which layers: as vLLM's model runner (top level first, then eagle_config)
        ids = (_int_list(d.get("eagle_aux_hidden_state_layer_ids"), where,
                         "eagle_aux_hidden_state_layer_ids")
               or _int_list(eagle.get("eagle_aux_hidden_state_layer_ids"), where,
                            "eagle_config.eagle_aux_hidden_state_layer_ids"))
        # how many: as vLLM's llama_eagle3 (num_aux_hidden_states, eagle_config's ids, 3)
        n_aux = d.get("num_aux_hidden_states")
        if n_aux is None:
            eagle_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
            n_aux = len(eagle_ids) if eagle_ids else 3
        try:
            vocab = base.vocab_size
            draft = int(d.get("draft_vocab_size") or vocab)
            cfg = dataclasses.replace(
                base, draft_vocab_size=draft,
                target_hidden_size=int(d.get("target_hidden_size") or base.hidden_size),
                num_aux_hidden_states=int(n_aux), aux_layer_ids=ids,
                num_target_layers=None if num_target_layers is None else int(num_target_layers),
                norm_before_residual=bool(d.get("norm_before_residual", False)),
                norm_output=bool(d.get("norm_output", False)),
                logit_scale=float(d.get("logit_scale", 1.0)), own_lm_head=own_lm_head,
                own_embed_tokens=own_embed_tokens)
        except (TypeError, ValueError) as e:
            raise SpecPlugConfigError(f"{where}: bad value ({e}); " + _HOW_TO_FIX3) from None
        if not 0 < draft <= vocab:
            raise SpecPlugConfigError(f"{where}: draft_vocab_size {draft} must be between 1 "
                                      f"and vocab_size {vocab}")
        if cfg.num_aux_hidden_states <= 0:
            raise SpecPlugConfigError(f"{where}: num_aux_hidden_states must be positive")
        if ids is not None and len(set(ids)) != cfg.num_aux_hidden_states:
            raise SpecPlugConfigError(
                f"{where}: eagle_aux_hidden_state_layer_ids {list(ids)} names "
                f"{len(set(ids))} distinct layers but the head's fc takes "
                f"{cfg.num_aux_hidden_states} aux hidden states (num_aux_hidden_states / "
                f"eagle_config); make them agree")
        return cfg

    @property
    def fc_in(self) -> int:
        return self.num_aux_hidden_states * self.target_hidden_size

    def aux_layers(self) -> tuple[int, ...]:
        """Target layer ids whose outputs ``fuse`` takes, in concatenation
        order (increasing, as vLLM collects them during the target's forward)."""
        if self.aux_layer_ids is not None:
            ids = self.aux_layer_ids
        elif self.num_target_layers is not None:
            ids = default_aux_layers(self.num_target_layers)
        else:
            raise SpecPlugConfigError(
                "the EAGLE-3 head's config.json names no eagle_aux_hidden_state_layer_ids and "
                "the target's layer count is unknown: load the head with num_target_layers= "
                "(vLLM's default is default_aux_layers(num_target_layers))")
        return tuple(sorted(set(ids)))

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json of the head, as vLLM's ``"method": "eagle3"`` loads it
        (``LlamaForCausalLMEagle3`` -> ``Eagle3LlamaForCausalLM``)."""
        d = super().to_hf_dict()
        d["architectures"] = [ARCHITECTURE]
        d["draft_vocab_size"] = self.draft_vocab_size
        d["target_hidden_size"] = self.target_hidden_size
        if self.aux_layer_ids is not None:
            d["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        if self.num_aux_hidden_states != 3:
            d["num_aux_hidden_states"] = self.num_aux_hidden_states
        for key in ("norm_before_residual", "norm_output"):
            if getattr(self, key):
                d[key] = True
        if self.logit_scale != 1.0:
            d["logit_scale"] = self.logit_scale
        d["specplug_eagle"]["format"] = "eagle3"
        return d

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        h = self.hidden_size
        shapes = {k.replace(ALT_LAYER, LAYER, 1): s
                  for k, s in super().expected_shapes().items()}
        for n in "qkv":
            key = f"{LAYER}self_attn.{n}_proj.weight"
            shapes[key] = (shapes[key][0], 2 * h)
        shapes["fc.weight"] = (h, self.fc_in)
        shapes[LAYER + "input_layernorm.weight"] = (h,)
        shapes[LAYER + "hidden_norm.weight"] = (h,)
        shapes["norm.weight"] = (h,)
        if self.own_lm_head:
            shapes["lm_head.weight"] = (self.draft_vocab_size, h)
        if self.draft_vocab_size != self.vocab_size:
            shapes["d2t"] = (self.draft_vocab_size,)
        if self.own_embed_tokens:
            shapes["embed_tokens.weight"] = (self.vocab_size, h)
        return shapes


# --------------------------------------------------------------------------
# Module


class _MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3HeadConfig):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = _Attention(cfg, in_size=2 * h)
        self.mlp = _MLP(cfg)
        self.post_attention_layernorm = RMSNorm(h, eps)


class Eagle3Head(HeadBase):
    """EAGLE-3's one decoder layer over ``cat(norm(embed), norm(feature))``;
    see the module docstring. ``state_dict()`` keys are the checkpoint keys."""

    kind = "eagle3"

    def __init__(self, cfg: Eagle3HeadConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.fc_in, h, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False) if cfg.own_lm_head \
            else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if cfg.own_embed_tokens else None
        d2t = None
        if cfg.draft_vocab_size != cfg.vocab_size:
            d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        self.register_buffer("d2t", d2t)
        self._init_rope()
        self.ignored_tensors: list[str] = []

    @property
    def needs_aux_layers(self) -> tuple[int, ...]:
        """Target layer ids whose outputs (residual stream, before the final
        norm) ``fuse`` takes, in concatenation order."""
        return self.config.aux_layers()

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """``fc`` over the target's aux hidden states concatenated in
        ``needs_aux_layers`` order: ``[..., n_aux * target_h] -> [..., h]``."""
        if aux.shape[-1] != self.config.fc_in:
            raise ValueError(f"aux hidden states of width {aux.shape[-1]}, expected "
                             f"{self.config.fc_in} ({self.config.num_aux_hidden_states} x "
                             f"{self.config.target_hidden_size})")
        return self.fc(aux)

    def forward_batched(self, embeds: torch.Tensor, features: torch.Tensor,
                        positions: torch.Tensor, past_k: torch.Tensor | None = None,
                        past_v: torch.Tensor | None = None, mask: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As ``EagleHead.forward_batched``; ``features`` ``[B, T, h]`` are
        ``fuse``d target features or the head's own previous output. Returns
        the hidden vLLM feeds back (pre final norm unless ``norm_output``)."""
        cfg, layer = self.config, self.midlayer
        e = layer.input_layernorm(embeds)
        f = layer.hidden_norm(features)
        residual = f if cfg.norm_before_residual else features
        a, k, v = attend(cfg, layer.self_attn, self.rope, torch.cat((e, f), dim=-1),
                         positions, past_k, past_v, mask)
        r = a + residual
        out = r + layer.mlp(layer.post_attention_layernorm(r))
        return (self.norm(out) if cfg.norm_output else out), k, v

    def target_ids(self) -> torch.Tensor:
        """Target token id of each draft id (``draft_id + d2t[draft_id]``)."""
        base = torch.arange(self.config.draft_vocab_size, device=self.norm.weight.device)
        return base if self.d2t is None else base + self.d2t

    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Draft log-probabilities over the TARGET vocabulary ``[..., vocab]``
        (float32) from ``hidden`` (``forward``'s output): final norm, the
        head's ``lm_head`` over the draft vocabulary, log-softmax, then draft
        id i -> target id ``i + d2t[i]``; target ids outside the draft
        vocabulary get -inf. ``lm_head_weight`` (the target's ``[vocab, h]``)
        is used only by a head whose file has no lm_head (vLLM then shares the
        target's)."""
        cfg = self.config
        x = hidden if cfg.norm_output else self.norm(hidden)
        if self.lm_head is not None:
            w = self.lm_head.weight
        elif lm_head_weight is not None:
            w = lm_head_weight
        else:
            raise ValueError("this EAGLE-3 head has no lm_head of its own: pass the target's "
                             "lm_head_weight")
        if tuple(w.shape) != (cfg.draft_vocab_size, cfg.hidden_size):
            raise ValueError(f"lm_head weight of shape {tuple(w.shape)}, expected "
                             f"{(cfg.draft_vocab_size, cfg.hidden_size)}")
        lp = torch.log_softmax(
            F.linear(x, w.to(device=x.device, dtype=x.dtype)).float() * cfg.logit_scale, -1)
        if self.d2t is None:
            return lp
        out = lp.new_full((*lp.shape[:-1], cfg.vocab_size), float("-inf"))
        out[..., self.target_ids().to(lp.device)] = lp
        return out


# --------------------------------------------------------------------------
# Files


def _normalize_keys(wfile: Path, names) -> dict[str, str]:
    """file key -> checkpoint key in the ``midlayer.`` spelling."""
    names = list(names)
    if any(k.startswith(LAYER) for k in names) and any(k.startswith(ALT_LAYER) for k in names):
        raise SpecPlugConfigError(f"{wfile}: both midlayer.* and layers.0.* tensors; an EAGLE-3 "
                                  f"head has one decoder layer (spelled either way)")
    return {k: LAYER + k[len(ALT_LAYER):] if k.startswith(ALT_LAYER) else k for k in names}


def _eagle3_hint(k: str, shape: tuple[int, ...]) -> str:
    if k == "d2t":
        return (" (d2t maps a smaller draft vocabulary to the target's; with "
                "draft_vocab_size equal to vocab_size there is none: set draft_vocab_size in "
                "config.json)")
    if k == "mask_hidden":
        return " (a parallel-drafting head: not supported)"
    if k.startswith(("input_norm.", "fc_norm.")):
        return " (norm_before_fc / fc_norm heads are not supported)"
    if k.startswith("layers."):
        return " (EAGLE-3 heads with more than one decoder layer are not supported)"
    if k.endswith(".bias") and "self_attn" in k:
        return " (set attention_bias true in config.json if the head has them)"
    return ""


def validate_eagle3(folder: Path, wfile: Path, d: Mapping[str, Any],
                    shapes: Mapping[str, tuple[int, ...]], hidden_size: int | None,
                    vocab_size: int | None, num_target_layers: int | None
                    ) -> Eagle3HeadConfig:
    """Names and shapes of an EAGLE-3 folder's tensors (``shapes`` in either
    spelling) against its config.json and the target's sizes."""
    cfg_path = folder / CONFIG_FILE
    names = _normalize_keys(wfile, shapes)
    shapes = {names[k]: tuple(s) for k, s in shapes.items()}
    layers = d.get("num_hidden_layers", 1)
    if layers != 1:
        raise SpecPlugConfigError(f"{cfg_path}: num_hidden_layers is {layers}; only EAGLE-3 "
                                  f"heads with 1 decoder layer are supported (set it to 1)")
    cfg = Eagle3HeadConfig.from_dict(
        d, where=str(cfg_path), num_target_layers=num_target_layers,
        own_lm_head="lm_head.weight" in shapes, own_embed_tokens="embed_tokens.weight" in shapes)
    draft, vocab, h = cfg.draft_vocab_size, cfg.vocab_size, cfg.hidden_size
    if draft != vocab:
        for key, what, shape in (
                ("lm_head.weight", "its own LM head over the draft vocabulary", [draft, h]),
                ("d2t", "the draft-to-target id map", [draft])):
            if key not in shapes:
                raise SpecPlugConfigError(
                    f"{wfile}: missing tensor {key}: config.json's draft_vocab_size {draft} < "
                    f"vocab_size {vocab}, so the head needs {what} ({key} {shape})")
    check_shapes(wfile, cfg_path, shapes, cfg.expected_shapes(), kind="EAGLE-3",
                 sizes=f"{describe_sizes(cfg)}, target_hidden_size {cfg.target_hidden_size} x "
                       f"{cfg.num_aux_hidden_states} aux states, draft_vocab_size {draft}, "
                       f"vocab_size {vocab}",
                 tolerated={"t2d": ((vocab,), "remove it (unused, as in vLLM)")},
                 hint=_eagle3_hint)
    other = "this head was trained for another model; use a head trained for this target"
    if hidden_size is not None and cfg.target_hidden_size != hidden_size:
        raise SpecPlugConfigError(
            f"{wfile}: fc.weight has shape {list(shapes['fc.weight'])}, but the target's "
            f"hidden_size {hidden_size} needs {[h, cfg.num_aux_hidden_states * hidden_size]} "
            f"({cfg.num_aux_hidden_states} aux hidden states of {hidden_size}; {cfg_path} says "
            f"target_hidden_size {cfg.target_hidden_size}): {other}")
    if hidden_size is not None and not cfg.own_embed_tokens and h != hidden_size:
        key = LAYER + "input_layernorm.weight"
        raise SpecPlugConfigError(
            f"{wfile}: {key} has shape {list(shapes[key])}, but the head embeds tokens with the "
            f"target's embedding, so it needs {[hidden_size]} (the target's hidden_size; "
            f"{cfg_path} says hidden_size {h}): {other}")
    if vocab_size is not None and vocab != vocab_size:
        carrier = [k for k in ("t2d", "embed_tokens.weight") if k in shapes]
        if draft == vocab and cfg.own_lm_head:
            carrier.insert(0, "lm_head.weight")
        named = ""
        if carrier:
            k = carrier[0]
            named = (f"; {wfile}: {k} has shape {list(shapes[k])}, expected "
                     f"{[vocab_size, *shapes[k][1:]]}")
        raise SpecPlugConfigError(
            f"{cfg_path}: the head's vocab_size is {vocab} but the target's is {vocab_size}"
            f"{named}: the head must map into the target's vocabulary; {other}")
    if num_target_layers is not None and cfg.aux_layer_ids is not None \
            and max(cfg.aux_layer_ids) > num_target_layers:
        raise SpecPlugConfigError(
            f"{cfg_path}: eagle_aux_hidden_state_layer_ids {list(cfg.aux_layer_ids)} go past "
            f"the target's {num_target_layers} layers (ids 0..{num_target_layers}): {other}")
    if cfg.aux_layer_ids is None and num_target_layers is not None:
        ids = default_aux_layers(num_target_layers)
        if len(set(ids)) != cfg.num_aux_hidden_states or min(ids) < 0 \
                or max(ids) > num_target_layers:
            raise SpecPlugConfigError(
                f"{cfg_path}: no eagle_aux_hidden_state_layer_ids, and vLLM's default for a "
                f"{num_target_layers}-layer target, {list(ids)}, does not give "
                f"{cfg.num_aux_hidden_states} distinct layers; name the layers in config.json")
    return cfg


def _check_vocab_map(wfile: Path, cfg: Eagle3HeadConfig, tensors: Mapping[str, torch.Tensor]
                     ) -> None:
    """d2t gives distinct target ids in range; t2d (if any) marks exactly them."""
    d2t = tensors.get("d2t")
    if d2t is None:
        return
    if d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise SpecPlugConfigError(f"{wfile}: d2t must be an integer tensor, not {d2t.dtype}")
    ids = torch.arange(cfg.draft_vocab_size) + d2t.long()
    bad = ((ids < 0) | (ids >= cfg.vocab_size)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise SpecPlugConfigError(
            f"{wfile}: d2t maps draft id {i} to target id {int(ids[i])}, outside the target "
            f"vocabulary [0, {cfg.vocab_size}) (target id = draft id + d2t[draft id])")
    if len(torch.unique(ids)) != len(ids):
        raise SpecPlugConfigError(f"{wfile}: d2t maps two draft ids to the same target id")
    t2d = tensors.get("t2d")
    if t2d is not None:
        t2d = t2d.bool()
        if int(t2d.sum()) != cfg.draft_vocab_size or not bool(t2d[ids].all()):
            raise SpecPlugConfigError(
                f"{wfile}: t2d does not mark exactly the {cfg.draft_vocab_size} target ids "
                f"that d2t maps to; the file is inconsistent (remove t2d: it is unused)")


def load_eagle3(folder: Path, wfile: Path, d: Mapping[str, Any],
                tensors: Mapping[str, torch.Tensor], *, hidden_size: int | None,
                vocab_size: int | None, num_target_layers: int | None, dtype: torch.dtype
                ) -> tuple[Eagle3Head, Eagle3HeadConfig]:
    """``loading.load_head`` for an EAGLE-3 folder (its tensors already read)."""
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    cfg = validate_eagle3(folder, wfile, d, shapes, hidden_size, vocab_size, num_target_layers)
    names = _normalize_keys(wfile, tensors)
    tensors = {names[k]: v for k, v in tensors.items()}
    expected = cfg.expected_shapes()
    bad = [k for k in expected if k != "d2t" and not tensors[k].is_floating_point()]
    if bad:
        raise SpecPlugConfigError(f"{wfile}: {bad[0]} is not a floating-point tensor "
                                  f"({tensors[bad[0]].dtype})")
    _check_vocab_map(wfile, cfg, tensors)
    head = Eagle3Head(cfg)
    head.load_state_dict({k: tensors[k] for k in expected}, strict=True)
    head.ignored_tensors = ["t2d"] if "t2d" in tensors else []
    return head.to(dtype).eval(), cfg


def save_head3(head: Eagle3Head, config: Eagle3HeadConfig, path, *,
               extra_config: Mapping[str, Any] | None = None) -> None:
    """Write an EAGLE-3 head in vLLM's llama_eagle3 layout (config.json with
    ``architectures: ["LlamaForCausalLMEagle3"]``, model.safetensors with
    ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``)."""
    if not isinstance(head, Eagle3Head) or not isinstance(config, Eagle3HeadConfig):
        raise TypeError("save_head3 takes an Eagle3Head and its Eagle3HeadConfig (EAGLE-1 "
                        "heads: save_head)")
    save_head(head, config, path, extra_config=extra_config)


__all__ = ["Eagle3Head", "Eagle3HeadConfig", "default_aux_layers", "load_eagle3", "save_head3",
           "validate_eagle3"]
