"""Checking and loading a head folder, EAGLE-1 (``head``) or EAGLE-3
(``head3``): the one place that knows both (pure torch: no vLLM import)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch

from .common import (EagleHeadConfig, HeadBase, is_eagle3, load_bin, read_config, read_tensors,
                     safetensors_header, target_sizes, weights_file)
from .head import load_eagle1, validate_eagle1
from .head3 import load_eagle3, validate_eagle3


def check_head_folder(path: str | os.PathLike, target_config: Mapping[str, Any] | None = None
                      ) -> None:
    """Cheap validation of a head folder (EAGLE-1 or EAGLE-3) before an engine
    starts: config.json (RoPE included) and the tensors' names and shapes
    (safetensors header; ``.bin`` read on the meta device), against the
    target's HF config dict when given (hidden size, vocabulary, and for
    EAGLE-3 the layer count)."""
    folder = Path(path)
    d = read_config(folder)
    wfile = weights_file(folder)
    if wfile.suffix == ".safetensors":
        shapes = {k: s for k, (s, _) in safetensors_header(wfile).items()}
    else:
        shapes = {k: tuple(v.shape) for k, v in load_bin(wfile, meta=True).items()}
    hidden, vocab, layers = target_sizes(target_config)
    if is_eagle3(d, shapes):
        validate_eagle3(folder, wfile, d, shapes, hidden, vocab, layers)
    else:
        validate_eagle1(folder, wfile, d, shapes, hidden, vocab)


def load_head(path: str | os.PathLike, *, hidden_size: int | None = None,
              vocab_size: int | None = None, dtype: torch.dtype = torch.float32,
              num_target_layers: int | None = None) -> tuple[HeadBase, EagleHeadConfig]:
    """Load and validate a head folder: ``(EagleHead, EagleHeadConfig)`` for
    EAGLE-1, ``(Eagle3Head, Eagle3HeadConfig)`` for EAGLE-3 (``head.kind``
    tells them apart; ``num_target_layers`` gives the EAGLE-3 head its aux
    layers when config.json names none). Raises ``SpecPlugConfigError`` naming
    the file and the fix."""
    folder = Path(path)
    d = read_config(folder)
    wfile = weights_file(folder)
    tensors = read_tensors(wfile)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if is_eagle3(d, shapes):
        return load_eagle3(folder, wfile, d, tensors, hidden_size=hidden_size,
                           vocab_size=vocab_size, num_target_layers=num_target_layers,
                           dtype=dtype)
    return load_eagle1(folder, wfile, d, tensors, hidden_size=hidden_size,
                       vocab_size=vocab_size, dtype=dtype)


__all__ = ["check_head_folder", "load_head"]
