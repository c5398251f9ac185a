"""What the EAGLE-1 (``head``) and EAGLE-3 (``head3``) draft heads share (pure
torch: no vLLM import): the Llama fields of their config.json (RoPE included),
the attention, MLP and RMSNorm modules, RoPE, and the head folder's file I/O.
Neither head module imports the other; ``loading`` picks one for a folder.

RoPE: plain, and the scalings vLLM 0.32's ``get_rope`` builds for a Llama
decoder layer (``linear``, ``dynamic``, ``yarn``, ``llama3``). The scaling
parameters are read as transformers' ``LlamaConfig`` standardizes them (vLLM
loads the head's config.json through it too) and the inverse frequencies come
from transformers' ``ROPE_INIT_FUNCTIONS``. ``dynamic`` is computed as vLLM
does: one table at ``max_position_embeddings`` (transformers recomputes it for
longer sequences; vLLM does not). Other RoPE variants are refused naming the
key (``read_rope``).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..options import SpecPlugConfigError

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
BIN_FILE = "pytorch_model.bin"
HOW_TO_FIX = ("an EAGLE-1 head folder holds config.json (a LlamaConfig with num_hidden_layers "
               "1) and model.safetensors; train one with `specplug train-eagle`")


# --------------------------------------------------------------------------
# RoPE settings

#: RoPE types the heads compute (those vLLM 0.32's ``get_rope`` builds for a
#: Llama layer with a plain rotary embedding)
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
#: keys that turn vLLM's rotary embedding into another variant
_ROPE_VARIANT_KEYS = {
    "mrope_section": "multimodal RoPE (M-RoPE)",
    "mrope_interleaved": "multimodal RoPE (M-RoPE)",
    "use_fope": "Fourier RoPE",
    "rope_dim": "a partial rotary embedding",
    "alpha": "dynamic NTK-alpha scaling",
    "max_trained_positions": "dynamic NTK scaling over max_trained_positions",
}
_ROPE_FIX = ("the EAGLE heads compute plain RoPE and rope_type " + ", ".join(ROPE_TYPES[1:])
             + "; use a head whose config.json has one of them")


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' logger at error level for a block (its RoPE validation
    warns about settings vLLM accepts; vLLM prints them when it loads the head)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _hf_rope_config(head_dim: int, hidden_size: int, heads: int, max_positions: int | None,
                    theta: float, scaling: Mapping[str, Any]):
    """A transformers ``LlamaConfig`` holding only the head's RoPE settings."""
    from transformers import LlamaConfig

    kw = {"hidden_size": hidden_size, "num_attention_heads": heads, "head_dim": head_dim}
    if max_positions is not None:
        kw["max_position_embeddings"] = max_positions
    with _quiet_transformers():
        return LlamaConfig(**kw, rope_theta=theta, rope_scaling=dict(scaling))


def _hf_rope_parameters(hf) -> dict:
    """The standardized RoPE dict of a transformers config (5.x
    ``rope_parameters``; 4.x ``rope_scaling`` plus ``rope_theta``)."""
    params = getattr(hf, "rope_parameters", None)
    if params is None:
        params = {**hf.rope_scaling, "rope_theta": hf.rope_theta}
    return dict(params)


@functools.lru_cache(maxsize=64)
def _scaled_rope(head_dim: int, hidden_size: int, heads: int, max_positions: int, theta: float,
                 scaling_json: str) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = json.loads(scaling_json)
    hf = _hf_rope_config(head_dim, hidden_size, heads, max_positions, theta, scaling)
    with _quiet_transformers():
        # seq_len None: the table at max_position_embeddings (vLLM's, for dynamic)
        inv_freq, scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, None)
    return inv_freq.float(), float(scale)


def read_rope(d: Mapping[str, Any], where: str) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` of a Llama config dict: ``rope_scaling``
    None for plain RoPE, else its parameters as transformers standardizes
    them (``rope_type`` and its keys, without ``rope_theta``). Accepts
    transformers 4's ``rope_theta`` + ``rope_scaling`` (``type`` or
    ``rope_type``) and transformers 5's ``rope_parameters``. Raises
    ``SpecPlugConfigError`` naming the key for RoPE the heads do not compute."""
    key = "rope_scaling" if d.get("rope_scaling") is not None else "rope_parameters"
    raw = d.get(key)
    if raw is not None and not isinstance(raw, Mapping):
        raise SpecPlugConfigError(f"{where}: {key} {raw!r} is not an object (rope settings)")
    value = dict(raw or {})
    if "type" in value:  # transformers 4's legacy spelling, as vLLM patches it
        legacy = value.pop("type")
        if value.setdefault("rope_type", legacy) != legacy:
            raise SpecPlugConfigError(
                f"{where}: {key} has rope_type {value['rope_type']!r} and type {legacy!r}; "
                f"keep one of them")
    kind = value.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise SpecPlugConfigError(
            f"{where}: {key}['rope_type'] {kind!r} is not supported by the EAGLE heads; "
            + _ROPE_FIX)
    for k, what in _ROPE_VARIANT_KEYS.items():
        if value.get(k) not in (None, False):
            raise SpecPlugConfigError(
                f"{where}: {key}['{k}'] {value[k]!r} ({what}) is not supported by the EAGLE "
                f"heads; " + _ROPE_FIX)
    for k, v in (("partial_rotary_factor", d.get("partial_rotary_factor")),
                 (f"{key}['partial_rotary_factor']", value.get("partial_rotary_factor"))):
        if v not in (None, 1, 1.0):
            raise SpecPlugConfigError(
                f"{where}: {k} {v!r} (a partial rotary embedding) is not supported by the "
                f"EAGLE heads; they rotate the whole head_dim")
    theta = value.get("rope_theta", d.get("rope_theta"))
    try:
        theta = float(10000.0 if theta is None else theta)
    except (TypeError, ValueError):
        raise SpecPlugConfigError(f"{where}: rope_theta {theta!r} is not a number") from None
    if kind == "default":
        return theta, None
    try:
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = int(d.get("head_dim") or hidden // heads)
        max_pos = d.get("max_position_embeddings")
        hf = _hf_rope_config(head_dim, hidden, heads, None if max_pos is None else int(max_pos),
                             theta, value)
        params = _hf_rope_parameters(hf)
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
        _scaled_rope(head_dim, hidden, heads, int(hf.max_position_embeddings),
                     float(params["rope_theta"]), json.dumps(scaling, sort_keys=True))
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise SpecPlugConfigError(
            f"{where}: {key} {dict(raw or {})!r} is not a valid {kind!r} RoPE scaling "
            f"({e})") from None
    return float(params["rope_theta"]), scaling


# --------------------------------------------------------------------------
# Config


@dataclass
class EagleHeadConfig:
    """The Llama fields of a head's config.json (EAGLE-1's whole config; the
    base of ``Eagle3HeadConfig``). ``rope_scaling``: None (plain RoPE) or the
    scaling parameters (``read_rope``). Biases as vLLM's Llama layer:
    ``attention_bias`` on q/k/v and o_proj; ``qkv_bias`` (not None) overrides
    it for q/k/v (Qwen2-family heads: q/k/v biases, none on o_proj)."""
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
    rope_scaling: dict | None = None
    qkv_bias: bool | None = None

    @property
    def has_qkv_bias(self) -> bool:
        return self.attention_bias if self.qkv_bias is None else self.qkv_bias

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
                + HOW_TO_FIX)
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
            theta, scaling = read_rope(d, where)
            # vLLM's LlamaDecoderLayer: o_proj bias = attention_bias or bias;
            # q/k/v: qkv_bias when the config has it, else the same
            bias = bool(d.get("attention_bias", False) or d.get("bias", False))
            qkv = d.get("qkv_bias")
            cfg = cls(hidden_size=hidden, intermediate_size=int(d["intermediate_size"]),
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                      rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                      rope_theta=theta, vocab_size=int(d["vocab_size"]),
                      attention_bias=bias,
                      max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                      rope_scaling=scaling,
                      qkv_bias=None if qkv is None or bool(qkv) == bias else bool(qkv))
        except (TypeError, ValueError) as e:
            if isinstance(e, SpecPlugConfigError):
                raise
            raise SpecPlugConfigError(f"{where}: bad value ({e}); " + HOW_TO_FIX) from None
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
        d = {
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
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
            "rope_parameters": {**(self.rope_scaling or {"rope_type": "default"}),
                                "rope_theta": self.rope_theta},
            "vocab_size": self.vocab_size,
            "attention_bias": self.attention_bias,
            "mlp_bias": False,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "specplug_eagle": {"format": "eagle1", "config": asdict(self)},
        }
        if self.qkv_bias is not None:
            d["qkv_bias"] = self.qkv_bias
        return d

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
        if self.has_qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if self.attention_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        return shapes


def describe_sizes(cfg: EagleHeadConfig) -> str:
    return (f"hidden_size {cfg.hidden_size}, heads {cfg.num_attention_heads}/"
            f"{cfg.num_key_value_heads}, head_dim {cfg.head_dim}, intermediate_size "
            f"{cfg.intermediate_size}")


# --------------------------------------------------------------------------
# Modules


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
        h, d, b = cfg.hidden_size, cfg.head_dim, cfg.has_qkv_bias
        n = h if in_size is None else in_size  # q/k/v input width (EAGLE-3: 2h)
        self.q_proj = nn.Linear(n, cfg.num_attention_heads * d, bias=b)
        self.k_proj = nn.Linear(n, cfg.num_key_value_heads * d, bias=b)
        self.v_proj = nn.Linear(n, cfg.num_key_value_heads * d, bias=b)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=cfg.attention_bias)


class _MLP(nn.Module):
    def __init__(self, cfg: EagleHeadConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# --------------------------------------------------------------------------
# RoPE


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(cfg: EagleHeadConfig) -> tuple[torch.Tensor, float]:
    """The inverse frequencies ``[head_dim / 2]`` (float32) and the factor on
    cos and sin (YaRN's attention factor; 1 otherwise) of the head's RoPE."""
    if cfg.rope_scaling is None:
        d = cfg.head_dim
        return 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)), 1.0
    inv_freq, scale = _scaled_rope(cfg.head_dim, cfg.hidden_size, cfg.num_attention_heads,
                                   cfg.max_position_embeddings, cfg.rope_theta,
                                   json.dumps(cfg.rope_scaling, sort_keys=True))
    return inv_freq.clone(), scale


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, scale: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[..., T, head_dim]`` (float32) for integer positions ``[..., T]``,
    times ``scale``."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale


def attend(cfg: EagleHeadConfig, attn: _Attention,
           rope: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor,
           positions: torch.Tensor, past_k: torch.Tensor | None, past_v: torch.Tensor | None,
           mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Llama self-attention of one layer over ``x`` ``[B, T, in]`` (RoPE:
    ``rope(positions)`` gives cos and sin; GQA, a KV cache and a mask as in
    ``HeadBase.forward_batched``): returns the o_proj output ``[B, T, h]`` and
    this call's keys (after RoPE) and values."""
    B, T, _ = x.shape
    q = attn.q_proj(x).view(B, T, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
    cos, sin = rope(positions)
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
    config: EagleHeadConfig

    def _init_rope(self) -> None:
        inv_freq, self.rope_scale = rope_tables(self.config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, *args, **kwargs):
        # keep the RoPE frequencies in float32 when the head is cast (bf16 would
        # round them; vLLM computes its cos/sin cache in float32)
        out = super()._apply(fn, *args, **kwargs)
        self.inv_freq = rope_tables(self.config)[0].to(self.inv_freq.device)
        return out

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[..., T, head_dim]`` (float32) for integer positions ``[..., T]``
        (times YaRN's attention factor)."""
        return rope_cos_sin(self.inv_freq, positions, self.rope_scale)

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


# --------------------------------------------------------------------------
# Files


def read_config(folder: Path) -> dict:
    if not folder.exists():
        raise SpecPlugConfigError(f"EAGLE head folder {folder} does not exist; " + HOW_TO_FIX)
    if not folder.is_dir():
        raise SpecPlugConfigError(f"EAGLE head path {folder} is not a folder; " + HOW_TO_FIX)
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise SpecPlugConfigError(f"{path}: no such file; " + HOW_TO_FIX)
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecPlugConfigError(f"{path}: not valid JSON ({e}); " + HOW_TO_FIX) from None
    if not isinstance(d, dict):
        raise SpecPlugConfigError(f"{path}: expected a JSON object; " + HOW_TO_FIX)
    return d


def weights_file(folder: Path) -> Path:
    for name in (SAFETENSORS_FILE, BIN_FILE):
        if (folder / name).is_file():
            return folder / name
    if (folder / (SAFETENSORS_FILE + ".index.json")).exists():
        raise SpecPlugConfigError(
            f"{folder}: sharded checkpoints (model.safetensors.index.json) are not supported "
            f"for EAGLE heads; save the head as one model.safetensors")
    raise SpecPlugConfigError(f"{folder}: no {SAFETENSORS_FILE} (or {BIN_FILE}); "
                              + HOW_TO_FIX)


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def safetensors_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
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


def load_bin(path: Path, *, meta: bool = False) -> dict[str, torch.Tensor]:
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


def target_sizes(target_config: Mapping[str, Any] | None
                  ) -> tuple[int | None, int | None, int | None]:
    """hidden size, vocabulary size and number of layers of the target."""
    if not target_config:
        return None, None, None
    t = target_config.get("text_config", target_config)
    return t.get("hidden_size"), t.get("vocab_size"), t.get("num_hidden_layers")


def read_tensors(wfile: Path) -> dict[str, torch.Tensor]:
    if wfile.suffix != ".safetensors":
        return load_bin(wfile)
    header = safetensors_header(wfile)
    unknown_dtype = [k for k, (_, dt) in header.items() if dt not in _ST_DTYPES]
    if unknown_dtype:
        raise SpecPlugConfigError(f"{wfile}: unsupported dtype for {unknown_dtype[0]!r}")
    from safetensors.torch import load_file

    try:
        return load_file(str(wfile))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise SpecPlugConfigError(f"{wfile}: cannot read ({e}); re-save the head with "
                                  f"save_head") from None



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

