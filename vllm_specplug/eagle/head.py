"""The EAGLE-1 draft head (pure torch: no vLLM import) and the checkpoint I/O
of EAGLE heads (EAGLE-3 heads: ``head3``; ``load_head`` returns either).

Checkpoint format: EAGLE-1 as vLLM 0.32 loads it for ``"method": "eagle"``
(``vllm/model_executor/models/llama_eagle.py``: ``EagleLlamaForCausalLM``).
A folder with ``config.json`` (a LlamaConfig with ``num_hidden_layers: 1``
and the target's hidden size, heads and RoPE) and ``model.safetensors``::

    fc.weight                                   [h, 2h]   (no bias)
    layers.0.self_attn.{q,k,v,o}_proj.weight    (+ .bias if attention_bias)
    layers.0.mlp.{gate,up,down}_proj.weight
    layers.0.post_attention_layernorm.weight    [h]

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

import json
import math
import os
import pickle
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..options import SpecPlugConfigError

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
BIN_FILE = "pytorch_model.bin"
# Tensors some EAGLE-1 checkpoints carry; the head uses the target's instead.
TOLERATED_KEYS = ("embed_tokens.weight", "lm_head.weight")
_HOW_TO_FIX = ("an EAGLE-1 head folder holds config.json (a LlamaConfig with num_hidden_layers "
               "1) and model.safetensors; train one with `specplug train-eagle`")


# --------------------------------------------------------------------------
# Config


def _rope_theta(d: Mapping[str, Any], where: str) -> float:
    """``rope_theta`` from a Llama config dict (transformers 4 ``rope_theta`` +
    ``rope_scaling`` or transformers 5 ``rope_parameters``); only plain RoPE."""
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    theta = d.get("rope_theta")
    for extra in (params, scaling):
        if extra is None:
            continue
        if not isinstance(extra, Mapping):
            raise SpecPlugConfigError(f"{where}: rope settings {extra!r} are not an object")
        kind = extra.get("rope_type", extra.get("type", "default"))
        if kind not in (None, "default"):
            raise SpecPlugConfigError(
                f"{where}: RoPE scaling {kind!r} is not supported by the EAGLE head (only plain "
                f"RoPE: rope_scaling null / rope_type 'default'); use a target without RoPE "
                f"scaling")
        if theta is None and extra.get("rope_theta") is not None:
            theta = extra["rope_theta"]
    return float(10000.0 if theta is None else theta)


@dataclass
class EagleHeadConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    vocab_size: int = 32000
    attention_bias: bool = False
    max_position_embeddings: int = 4096

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "config") -> "EagleHeadConfig":
        """From a Llama-style HF config dict (the head's or the target's)."""
        if not isinstance(d, Mapping):
            raise SpecPlugConfigError(f"{where}: expected a JSON object, got {type(d).__name__}")
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                               "vocab_size") if k not in d]
        if missing:
            raise SpecPlugConfigError(
                f"{where}: missing {', '.join(missing)} (a Llama config needs them); "
                + _HOW_TO_FIX)
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise SpecPlugConfigError(f"{where}: hidden_act {act!r} is not supported by the "
                                      f"EAGLE head (only 'silu', as Llama)")
        if d.get("mlp_bias"):
            raise SpecPlugConfigError(f"{where}: mlp_bias true is not supported by the EAGLE "
                                      f"head; set it to false")
        try:
            heads = int(d["num_attention_heads"])
            kv = int(d.get("num_key_value_heads") or heads)
            hidden = int(d["hidden_size"])
            head_dim = int(d.get("head_dim") or hidden // heads)
            cfg = cls(hidden_size=hidden, intermediate_size=int(d["intermediate_size"]),
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                      rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                      rope_theta=_rope_theta(d, where), vocab_size=int(d["vocab_size"]),
                      attention_bias=bool(d.get("attention_bias", False)),
                      max_position_embeddings=int(d.get("max_position_embeddings", 4096)))
        except (TypeError, ValueError) as e:
            if isinstance(e, SpecPlugConfigError):
                raise
            raise SpecPlugConfigError(f"{where}: bad value ({e}); " + _HOW_TO_FIX) from None
        if heads <= 0 or kv <= 0 or heads % kv:
            raise SpecPlugConfigError(
                f"{where}: num_attention_heads {heads} must be a positive multiple of "
                f"num_key_value_heads {kv}")
        if head_dim % 2:
            raise SpecPlugConfigError(f"{where}: head_dim {head_dim} must be even (RoPE)")
        return cfg

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json of the head: a one-layer LlamaConfig that vLLM's
        ``"method": "eagle"`` maps to ``EagleLlamaForCausalLM``."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "vocab_size": self.vocab_size,
            "attention_bias": self.attention_bias,
            "mlp_bias": False,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "specplug_eagle": {"format": "eagle1", "config": asdict(self)},
        }

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        h, d = self.hidden_size, self.head_dim
        q, kv, i = self.num_attention_heads * d, self.num_key_value_heads * d, \
            self.intermediate_size
        p = "layers.0."
        shapes = {
            "fc.weight": (h, 2 * h),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "post_attention_layernorm.weight": (h,),
        }
        if self.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (h,)})
        return shapes


# --------------------------------------------------------------------------
# Module


class RMSNorm(nn.Module):
    """Llama's RMSNorm (computed in float32, as transformers and vLLM do)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class _Attention(nn.Module):
    def __init__(self, cfg: EagleHeadConfig, in_size: int | None = None):
        super().__init__()
        h, d, b = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        n = h if in_size is None else in_size  # q/k/v input width (EAGLE-3: 2h)
        self.q_proj = nn.Linear(n, cfg.num_attention_heads * d, bias=b)
        self.k_proj = nn.Linear(n, cfg.num_key_value_heads * d, bias=b)
        self.v_proj = nn.Linear(n, cfg.num_key_value_heads * d, bias=b)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=b)


class _MLP(nn.Module):
    def __init__(self, cfg: EagleHeadConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: EagleHeadConfig):
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_inv_freq(cfg: EagleHeadConfig) -> torch.Tensor:
    d = cfg.head_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[..., T, head_dim]`` (float32) for integer positions ``[..., T]``."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def attend(cfg: EagleHeadConfig, attn: _Attention, inv_freq: torch.Tensor, x: torch.Tensor,
           positions: torch.Tensor, past_k: torch.Tensor | None, past_v: torch.Tensor | None,
           mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Llama self-attention of one layer over ``x`` ``[B, T, in]`` (RoPE, GQA,
    a KV cache and a mask as in ``EagleHead.forward_batched``): returns the
    o_proj output ``[B, T, h]`` and this call's keys (after RoPE) and values."""
    B, T, _ = x.shape
    q = attn.q_proj(x).view(B, T, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
    cos, sin = rope_cos_sin(inv_freq, positions)
    cos, sin = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    keys, vals = k, v
    P = 0
    if past_k is not None:
        if past_v is None:
            raise ValueError("past_k given without past_v")
        P = past_k.shape[-2]
        keys = torch.cat((past_k.to(k.dtype), k), dim=-2)
        vals = torch.cat((past_v.to(v.dtype), v), dim=-2)
    if mask is None:
        idx = torch.arange(P + T, device=x.device)
        mask = idx[None, :] <= (idx[P:, None])
        mask = mask[None].expand(B, T, P + T)
    elif mask.shape != (B, T, P + T):
        raise ValueError(f"mask shape {tuple(mask.shape)}, expected {(B, T, P + T)}")
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    if group > 1:
        keys_r = keys.repeat_interleave(group, dim=1)
        vals_r = vals.repeat_interleave(group, dim=1)
    else:
        keys_r, vals_r = keys, vals
    o = F.scaled_dot_product_attention(q, keys_r, vals_r, attn_mask=mask[:, None])
    o = o.transpose(1, 2).reshape(B, T, cfg.num_attention_heads * cfg.head_dim)
    return attn.o_proj(o), k, v


class HeadBase(nn.Module):
    """What EAGLE-1 and EAGLE-3 heads share: the calling convention
    (``forward`` over one sequence, ``forward_batched``) and RoPE."""

    kind = ""

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[..., T, head_dim]`` (float32) for integer positions ``[..., T]``."""
        return rope_cos_sin(self.inv_freq, positions)

    def forward_batched(self, embeds: torch.Tensor, features: torch.Tensor,
                        positions: torch.Tensor, past_k: torch.Tensor | None = None,
                        past_v: torch.Tensor | None = None, mask: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                past_k: torch.Tensor | None = None, past_v: torch.Tensor | None = None,
                mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sequence: embeds/features ``[T, h]``, positions ``[T]``,
        past_k/past_v ``[kvh, P, d]``, mask ``[T, P+T]`` (True = query i may
        attend key j; keys are past then new; None = causal over the new
        tokens, all past visible). Returns hidden ``[T, h]`` and this call's
        keys (after RoPE) and values ``[kvh, T, d]`` for the caller's cache."""
        out, k, v = self.forward_batched(
            embeds[None], features[None], positions[None],
            None if past_k is None else past_k[None], None if past_v is None else past_v[None],
            None if mask is None else mask[None])
        return out[0], k[0], v[0]


class EagleHead(HeadBase):
    """One Llama decoder layer over ``fc(cat(embed, feature))``; see the module
    docstring. ``state_dict()`` keys are exactly the checkpoint keys."""

    kind = "eagle1"

    def __init__(self, cfg: EagleHeadConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([_Layer(cfg)])
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

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
        a, k, v = attend(self.config, layer.self_attn, self.inv_freq, x, positions, past_k,
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


def _read_config(folder: Path) -> dict:
    if not folder.exists():
        raise SpecPlugConfigError(f"EAGLE head folder {folder} does not exist; " + _HOW_TO_FIX)
    if not folder.is_dir():
        raise SpecPlugConfigError(f"EAGLE head path {folder} is not a folder; " + _HOW_TO_FIX)
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise SpecPlugConfigError(f"{path}: no such file; " + _HOW_TO_FIX)
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecPlugConfigError(f"{path}: not valid JSON ({e}); " + _HOW_TO_FIX) from None
    if not isinstance(d, dict):
        raise SpecPlugConfigError(f"{path}: expected a JSON object; " + _HOW_TO_FIX)
    return d


def _weights_file(folder: Path) -> Path:
    for name in (SAFETENSORS_FILE, BIN_FILE):
        if (folder / name).is_file():
            return folder / name
    if (folder / (SAFETENSORS_FILE + ".index.json")).exists():
        raise SpecPlugConfigError(
            f"{folder}: sharded checkpoints (model.safetensors.index.json) are not supported "
            f"for EAGLE heads; save the head as one model.safetensors")
    raise SpecPlugConfigError(f"{folder}: no {SAFETENSORS_FILE} (or {BIN_FILE}); "
                              + _HOW_TO_FIX)


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _safetensors_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype string) from a safetensors header (no tensor read)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("file shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 2**20 or n > path.stat().st_size:
                raise ValueError(f"header length {n} is implausible")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise SpecPlugConfigError(f"{path}: not a readable safetensors file ({e}); "
                                  f"re-save the head with save_head") from None
    if not isinstance(header, dict):
        raise SpecPlugConfigError(f"{path}: not a safetensors file (bad header)")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or "shape" not in info:
            raise SpecPlugConfigError(f"{path}: bad header entry for {name!r}")
        out[name] = (tuple(int(s) for s in info["shape"]), str(info.get("dtype")))
    return out


def _load_bin(path: Path, *, meta: bool = False) -> dict[str, torch.Tensor]:
    """A ``pytorch_model.bin`` state dict, read only with ``weights_only=True``
    (no arbitrary pickles); every value must be a tensor."""
    try:
        obj = torch.load(str(path), map_location="meta" if meta else "cpu",
                         weights_only=True, mmap=not meta)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError,
            AttributeError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpecPlugConfigError(
            f"{path}: refused to load (only plain tensor state dicts are accepted, read with "
            f"torch.load(weights_only=True)): {first}; convert the head to "
            f"{SAFETENSORS_FILE}") from None
    if not isinstance(obj, dict):
        raise SpecPlugConfigError(f"{path}: expected a dict of tensors, got "
                                  f"{type(obj).__name__}; convert the head to {SAFETENSORS_FILE}")
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise SpecPlugConfigError(
            f"{path}: entries that are not tensors: {', '.join(map(repr, bad[:5]))}; an EAGLE "
            f"head file must hold only the head's tensors (convert it to {SAFETENSORS_FILE})")
    return obj


def is_eagle3(d: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> bool:
    """An EAGLE-3 folder: an ``*Eagle3*`` architecture in config.json, or
    EAGLE-3 tensors (``midlayer.*``, ``*.hidden_norm.weight``, ``d2t``/``t2d``)."""
    archs = d.get("architectures")
    if isinstance(archs, list) and any(isinstance(a, str) and "Eagle3" in a for a in archs):
        return True
    return "d2t" in shapes or "t2d" in shapes or any(
        k.startswith("midlayer.") or k.endswith(".hidden_norm.weight") for k in shapes)


def check_shapes(wfile: Path, cfg_path: Path, shapes: Mapping[str, tuple[int, ...]],
                 expected: Mapping[str, tuple[int, ...]], *, kind: str, sizes: str,
                 tolerated: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
                 hint=lambda key, shape: "") -> None:
    """Every ``expected`` tensor present with its shape, nothing else but the
    ``tolerated`` ones (name -> (shape, what to do when it is wrong)).
    ``kind`` names the head ("EAGLE-1"), ``sizes`` the config values the
    shapes come from, ``hint(key, shape)`` an explanation for a wrong or
    unexpected tensor (" (...)" or "")."""
    tolerated = tolerated or {}
    missing = [k for k in expected if k not in shapes]
    if missing:
        raise SpecPlugConfigError(
            f"{wfile}: missing tensor(s) {', '.join(missing)}; an {kind} head needs "
            f"{', '.join(expected)}")
    for k, shape in expected.items():
        if tuple(shapes[k]) != shape:
            raise SpecPlugConfigError(
                f"{wfile}: {k} has shape {list(shapes[k])}, expected {list(shape)} from "
                f"{cfg_path} ({sizes}){hint(k, shapes[k])}; fix config.json or the weights")
    for k in shapes:
        if k in expected:
            continue
        if k in tolerated:
            shape, fix = tolerated[k]
            if tuple(shapes[k]) != shape:
                raise SpecPlugConfigError(
                    f"{wfile}: {k} has shape {list(shapes[k])}, expected {list(shape)}; {fix}")
            continue
        optional = f" (optionally {' and '.join(tolerated)})" if tolerated else ""
        raise SpecPlugConfigError(
            f"{wfile}: unexpected tensor {k!r}{hint(k, shapes[k])}; an {kind} head holds only "
            f"{', '.join(expected)}{optional}")


def describe_sizes(cfg: EagleHeadConfig) -> str:
    return (f"hidden_size {cfg.hidden_size}, heads {cfg.num_attention_heads}/"
            f"{cfg.num_key_value_heads}, head_dim {cfg.head_dim}, intermediate_size "
            f"{cfg.intermediate_size}")


def _eagle1_hint(k: str, shape: tuple[int, ...]) -> str:
    if k == "fc.weight" and len(shape) == 2 and shape[1] == 3 * shape[0]:
        return (" (an fc over 3 hidden states is EAGLE-3's, but the folder has no EAGLE-3 "
                "midlayer.* / d2t tensors nor an Eagle3 architecture)")
    if k == "fc.bias":
        return " (vLLM's EAGLE-1 head has no fc bias; the original EAGLE repo's heads do)"
    if k == "layers.0.input_layernorm.weight":
        return " (vLLM's EAGLE-1 layer 0 has no input_layernorm)"
    if k.endswith(".bias") and "self_attn" in k:
        return " (set attention_bias true in config.json if the head has them)"
    return ""


def _validate(folder: Path, wfile: Path, d: dict, shapes: Mapping[str, tuple[int, ...]],
              hidden_size: int | None, vocab_size: int | None) -> EagleHeadConfig:
    cfg_path = folder / CONFIG_FILE
    if "fc.weight" not in shapes or not any(k.startswith("layers.0.") for k in shapes):
        sample = ", ".join(sorted(shapes)[:6]) or "(no tensors)"
        raise SpecPlugConfigError(
            f"{wfile}: not an EAGLE-1 head (expected fc.weight and layers.0.* tensors; found "
            f"{sample}) nor an EAGLE-3 head (fc.weight and midlayer.*); " + _HOW_TO_FIX)
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


def _target_sizes(target_config: Mapping[str, Any] | None
                  ) -> tuple[int | None, int | None, int | None]:
    """hidden size, vocabulary size and number of layers of the target."""
    if not target_config:
        return None, None, None
    t = target_config.get("text_config", target_config)
    return t.get("hidden_size"), t.get("vocab_size"), t.get("num_hidden_layers")


def _read_tensors(wfile: Path) -> dict[str, torch.Tensor]:
    if wfile.suffix != ".safetensors":
        return _load_bin(wfile)
    header = _safetensors_header(wfile)
    unknown_dtype = [k for k, (_, dt) in header.items() if dt not in _ST_DTYPES]
    if unknown_dtype:
        raise SpecPlugConfigError(f"{wfile}: unsupported dtype for {unknown_dtype[0]!r}")
    from safetensors.torch import load_file

    try:
        return load_file(str(wfile))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise SpecPlugConfigError(f"{wfile}: cannot read ({e}); re-save the head with "
                                  f"save_head") from None


def check_head_folder(path: str | os.PathLike, target_config: Mapping[str, Any] | None = None
                      ) -> None:
    """Cheap validation of a head folder (EAGLE-1 or EAGLE-3) before an engine
    starts: config.json and the tensors' names and shapes (safetensors header;
    ``.bin`` read on the meta device), against the target's HF config dict when
    given (hidden size, vocabulary, and for EAGLE-3 the layer count)."""
    folder = Path(path)
    d = _read_config(folder)
    wfile = _weights_file(folder)
    if wfile.suffix == ".safetensors":
        shapes = {k: s for k, (s, _) in _safetensors_header(wfile).items()}
    else:
        shapes = {k: tuple(v.shape) for k, v in _load_bin(wfile, meta=True).items()}
    hidden, vocab, layers = _target_sizes(target_config)
    if is_eagle3(d, shapes):
        from .head3 import validate_eagle3

        validate_eagle3(folder, wfile, d, shapes, hidden, vocab, layers)
        return
    _validate(folder, wfile, d, shapes, hidden, vocab)


def load_head(path: str | os.PathLike, *, hidden_size: int | None = None,
              vocab_size: int | None = None, dtype: torch.dtype = torch.float32,
              num_target_layers: int | None = None) -> tuple[HeadBase, EagleHeadConfig]:
    """Load and validate a head folder: ``(EagleHead, EagleHeadConfig)`` for
    EAGLE-1, ``(Eagle3Head, Eagle3HeadConfig)`` for EAGLE-3 (``head.kind``
    tells them apart; ``num_target_layers`` gives the EAGLE-3 head its aux
    layers when config.json names none). Raises ``SpecPlugConfigError`` naming
    the file and the fix. EAGLE-1: ``embed_tokens.weight`` / ``lm_head.weight``
    in the file are ignored (the head uses the target's; note that vLLM uses
    the file's copies when they differ from the target's)."""
    folder = Path(path)
    d = _read_config(folder)
    wfile = _weights_file(folder)
    tensors = _read_tensors(wfile)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if is_eagle3(d, shapes):
        from .head3 import load_eagle3

        return load_eagle3(folder, wfile, d, tensors, hidden_size=hidden_size,
                           vocab_size=vocab_size, num_target_layers=num_target_layers,
                           dtype=dtype)
    cfg = _validate(folder, wfile, d, shapes, hidden_size, vocab_size)
    bad = [k for k in cfg.expected_shapes() if not tensors[k].is_floating_point()]
    if bad:
        raise SpecPlugConfigError(f"{wfile}: {bad[0]} is not a floating-point tensor "
                                  f"({tensors[bad[0]].dtype})")
    head = EagleHead(cfg)
    state = {k: tensors[k] for k in cfg.expected_shapes()}
    head.load_state_dict(state, strict=True)
    head.ignored_tensors = sorted(k for k in tensors if k in TOLERATED_KEYS)
    return head.to(dtype).eval(), cfg


def save_head(head: HeadBase, config: EagleHeadConfig, path: str | os.PathLike,
              *, extra_config: Mapping[str, Any] | None = None) -> None:
    """Write ``config.json`` (``config.to_hf_dict()``) and ``model.safetensors``
    (the head's ``state_dict()``, float32 unless the head is in another
    floating dtype) into ``path`` (created)."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    expected = config.expected_shapes()
    if set(state) != set(expected):
        raise ValueError(f"head state keys {sorted(state)} do not match the config's "
                         f"{sorted(expected)}")
    cfg = config.to_hf_dict()
    dtypes = {v.dtype for v in state.values() if v.is_floating_point()}
    if len(dtypes) == 1:
        cfg["torch_dtype"] = str(next(iter(dtypes))).removeprefix("torch.")
    if extra_config:
        cfg.update(extra_config)
    tmp = folder / (SAFETENSORS_FILE + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, folder / SAFETENSORS_FILE)
    (folder / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")


def head_param_count(cfg: EagleHeadConfig) -> int:
    return sum(math.prod(s) for s in cfg.expected_shapes().values())


__all__ = ["EagleHead", "EagleHeadConfig", "HeadBase", "RMSNorm", "check_head_folder",
           "head_param_count", "is_eagle3", "load_head", "save_head", "rotate_half"]
