"""The EAGLE-1 draft head (pure torch: no vLLM import) and its checkpoint
validation; ``loading.load_head`` returns one for an EAGLE-1 folder (shared
pieces: ``common``; EAGLE-3 heads: ``head3``).

Checkpoint format: EAGLE-1 as vLLM 0.32 loads it for ``"method": "eagle"``
(``vllm/model_executor/models/llama_eagle.py``: ``EagleLlamaForCausalLM``).
A folder with ``config.json`` (a LlamaConfig with ``num_hidden_layers: 1``
and the target's hidden size, heads and RoPE, scaled RoPE included: see
``common``) and ``model.safetensors``::

    fc.weight                                   [h, 2h]   (no bias)
    layers.0.self_attn.{q,k,v,o}_proj.weight    (+ .bias: see below)
    layers.0.mlp.{gate,up,down}_proj.weight
    layers.0.post_attention_layernorm.weight    [h]

Attention biases as vLLM's Llama layer reads them: ``attention_bias`` (or
``bias``) true gives q/k/v and o_proj biases; ``qkv_bias`` overrides it for
q/k/v (heads for Qwen2-family targets: ``qkv_bias: true``, no o_proj bias).

Layer 0 has no ``input_layernorm`` (vLLM replaces it with Identity) and the
file holds no embedding or LM head: the head shares the target's. Forward
(vLLM's)::

    x = fc(cat(embed(token[i+1]), feature[i]))       # at position i
    h = x + attn(x)                                  # RoPE, GQA, causal
    out = h + mlp(rmsnorm(h))                        # no final norm

``feature[i]`` is the target's last hidden state at position i after its
final norm (vLLM's Llama output; HF's ``hidden_states[-1]``), and the target's
LM head applied to ``out`` gives the draft logits for token i+2.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..options import SpecPlugConfigError
from .common import (CONFIG_FILE, HOW_TO_FIX, EagleHeadConfig, HeadBase, RMSNorm, _Attention,
                     _MLP, attend, check_shapes, describe_sizes, rotate_half, save_head)

# Tensors some EAGLE-1 checkpoints carry; the head uses the target's instead.
TOLERATED_KEYS = ("embed_tokens.weight", "lm_head.weight")


class _Layer(nn.Module):
    def __init__(self, cfg: EagleHeadConfig):
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class EagleHead(HeadBase):
    """One Llama decoder layer over ``fc(cat(embed, feature))``; see the module
    docstring. ``state_dict()`` keys are exactly the checkpoint keys."""

    kind = "eagle1"

    def __init__(self, cfg: EagleHeadConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([_Layer(cfg)])
        self._init_rope()

    def forward_batched(self, embeds: torch.Tensor, features: torch.Tensor,
                        positions: torch.Tensor, past_k: torch.Tensor | None = None,
                        past_v: torch.Tensor | None = None, mask: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Batched forward: embeds/features ``[B, T, h]``, positions ``[B, T]``,
        past_k/past_v ``[B, kvh, P, d]``, mask ``[B, T, P+T]`` (True = may
        attend; keys are past then new; None = causal over the new tokens with
        all past visible). Returns hidden ``[B, T, h]`` and this call's keys
        (after RoPE) and values ``[B, kvh, T, d]``."""
        layer = self.layers[0]
        x = self.fc(torch.cat((embeds, features), dim=-1))
        a, k, v = attend(self.config, layer.self_attn, self.rope, x, positions, past_k,
                         past_v, mask)
        h = x + a
        out = h + layer.mlp(layer.post_attention_layernorm(h))
        return out, k, v

    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Draft log-probabilities ``[..., vocab]`` (float32) from ``hidden``
        (``forward``'s output) with the target's LM head weight ``[vocab, h]``
        (an EAGLE-1 head has none of its own; no final norm)."""
        w = lm_head_weight.to(device=hidden.device, dtype=hidden.dtype)
        return torch.log_softmax(F.linear(hidden, w).float(), dim=-1)


# --------------------------------------------------------------------------
# Files


def _eagle1_hint(k: str, shape: tuple[int, ...]) -> str:
    if k == "fc.weight" and len(shape) == 2 and shape[1] == 3 * shape[0]:
        return (" (an fc over 3 hidden states is EAGLE-3's, but the folder has no EAGLE-3 "
                "midlayer.* / d2t tensors nor an Eagle3 architecture)")
    if k == "fc.bias":
        return " (vLLM's EAGLE-1 head has no fc bias; the original EAGLE repo's heads do)"
    if k == "layers.0.input_layernorm.weight":
        return " (vLLM's EAGLE-1 layer 0 has no input_layernorm)"
    if k.endswith(".bias") and "self_attn" in k:
        return (" (set attention_bias true in config.json if the head has them, or qkv_bias "
                "true for q/k/v biases only, as heads for Qwen2-family targets have)")
    return ""


def validate_eagle1(folder: Path, wfile: Path, d: Mapping, shapes: Mapping[str, tuple[int, ...]],
                    hidden_size: int | None, vocab_size: int | None) -> EagleHeadConfig:
    """Names and shapes of an EAGLE-1 folder's tensors against its config.json
    and the target's sizes."""
    cfg_path = folder / CONFIG_FILE
    if "fc.weight" not in shapes or not any(k.startswith("layers.0.") for k in shapes):
        sample = ", ".join(sorted(shapes)[:6]) or "(no tensors)"
        raise SpecPlugConfigError(
            f"{wfile}: not an EAGLE-1 head (expected fc.weight and layers.0.* tensors; found "
            f"{sample}) nor an EAGLE-3 head (fc.weight and midlayer.*); " + HOW_TO_FIX)
    layers = d.get("num_hidden_layers", 1)
    if layers != 1:
        raise SpecPlugConfigError(f"{cfg_path}: num_hidden_layers is {layers}; EAGLE-1 heads "
                                  f"have exactly 1 decoder layer (set it to 1)")
    cfg = EagleHeadConfig.from_dict(d, where=str(cfg_path))
    h = cfg.hidden_size
    fix = "remove it (the head uses the target's)"
    check_shapes(wfile, cfg_path, shapes, cfg.expected_shapes(), kind="EAGLE-1",
                 sizes=describe_sizes(cfg),
                 tolerated={k: ((cfg.vocab_size, h), fix) for k in TOLERATED_KEYS},
                 hint=_eagle1_hint)
    if hidden_size is not None and h != hidden_size:
        raise SpecPlugConfigError(
            f"{cfg_path}: the head's hidden_size is {h} but the target's is {hidden_size}: this "
            f"head was trained for another model; train one for this target "
            f"(`specplug train-eagle --target MODEL`)")
    if vocab_size is not None and cfg.vocab_size != vocab_size:
        raise SpecPlugConfigError(
            f"{cfg_path}: the head's vocab_size is {cfg.vocab_size} but the target's is "
            f"{vocab_size}: the head must share the target's vocabulary; train one for this "
            f"target")
    return cfg


def load_eagle1(folder: Path, wfile: Path, d: Mapping, tensors: Mapping[str, torch.Tensor], *,
                hidden_size: int | None, vocab_size: int | None, dtype: torch.dtype
                ) -> tuple[EagleHead, EagleHeadConfig]:
    """``loading.load_head`` for an EAGLE-1 folder (its tensors already read).
    ``embed_tokens.weight`` / ``lm_head.weight`` in the file are ignored (the
    head uses the target's; note that vLLM uses the file's copies when they
    differ from the target's)."""
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    cfg = validate_eagle1(folder, wfile, d, shapes, hidden_size, vocab_size)
    bad = [k for k in cfg.expected_shapes() if not tensors[k].is_floating_point()]
    if bad:
        raise SpecPlugConfigError(f"{wfile}: {bad[0]} is not a floating-point tensor "
                                  f"({tensors[bad[0]].dtype})")
    head = EagleHead(cfg)
    state = {k: tensors[k] for k in cfg.expected_shapes()}
    head.load_state_dict(state, strict=True)
    head.ignored_tensors = sorted(k for k in tensors if k in TOLERATED_KEYS)
    return head.to(dtype).eval(), cfg


def head_param_count(cfg: EagleHeadConfig) -> int:
    return sum(math.prod(s) for s in cfg.expected_shapes().values())


__all__ = ["EagleHead", "EagleHeadConfig", "HeadBase", "RMSNorm", "head_param_count",
           "load_eagle1", "rotate_half", "save_head", "validate_eagle1"]
