"""The head-padded embedded model (for tensor-parallel tests) computes the
same function as the embedded model (transformers, no vLLM)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from vllm_specplug.models import default_model_path, padded_heads_model_path


def test_padded_heads_model_has_divisible_heads_and_same_logits():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = padded_heads_model_path(2)
    assert padded_heads_model_path(2) == path  # cached
    cfg = json.loads((Path(path) / "config.json").read_text())
    assert cfg["num_attention_heads"] % 2 == 0 and cfg["num_key_value_heads"] % 2 == 0
    assert cfg["num_attention_heads"] // cfg["num_key_value_heads"] == 3
    tok = AutoTokenizer.from_pretrained(default_model_path())
    ids = tok("The quick brown fox jumps over the lazy dog. " * 3, return_tensors="pt").input_ids
    logits = []
    for p in (default_model_path(), path):
        model = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert torch.allclose(logits[0], logits[1], atol=1e-4, rtol=1e-4), \
        (logits[0] - logits[1]).abs().max()
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
