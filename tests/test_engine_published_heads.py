"""Published heads' configurations against vLLM's own EAGLE (issue 22).

A random head of each configuration runs in vLLM's ``"method": "eagle3"`` /
``"eagle"``; vLLM's first chain draft for each prompt equals the chain our
head computes from transformers' features (as tests/test_engine_eagle3.py
does for plain RoPE):

* an EAGLE-3 head with Llama-3.1's RoPE scaling (``rope_type: llama3``; a
  64-token original context, so that most frequencies are scaled at the
  prompts' positions) for the embedded Llama target;
* an EAGLE-1 head for a Qwen2-family target (``qkv_bias: true``: biases on
  q, k and v, none on o_proj), for a tiny random ``Qwen2ForCausalLM`` saved
  here with the embedded model's tokenizer.

Both heads have larger attention weights than the default random head, so
that their drafts depend on RoPE and on the biases: the same head without
the scaling (or the biases) drafts differently for at least one prompt,
which each test checks too. Second tier (each starts one engine).
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from capture_vllm_drafts import COMPARE_PROMPTS, head_chain, save_random_head, vllm_first_drafts

from vllm_specplug.eagle import load_head

pytestmark = [pytest.mark.engine, pytest.mark.slow]

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
ATTN_STD = 0.3


def _variant(head, **config):
    """The same weights under another config (e.g. plain RoPE)."""
    other = type(head)(dataclasses.replace(head.config, **config))
    other.load_state_dict(head.state_dict())
    return other.eval()


def _compare(head, model, rows, variant) -> None:
    """vLLM's first drafts equal ``head``'s chains; ``variant`` (the head
    without the feature under test) misses at least one of them."""
    missed = 0
    for row in rows:
        chain, ties = head_chain(head, model, row["prompt_ids"], row["output_ids"][0],
                                 row["first_draft"])
        assert chain == row["first_draft"], (row, chain, ties)
        other, _ = head_chain(variant, model, row["prompt_ids"], row["output_ids"][0],
                              row["first_draft"])
        missed += other != row["first_draft"]
    assert missed > 0, "the comparison cannot tell the feature under test from its absence"
    print(f"{len(rows)} prompts: vLLM's first drafts = ours; without the feature "
          f"{missed}/{len(rows)} differ")


def test_vllm_eagle3_llama3_rope_head(model_path, tmp_path):
    from vllm_specplug.eagle.train import load_target

    theta = json.loads((Path(model_path) / "config.json").read_text())["rope_parameters"][
        "rope_theta"]
    head_dir = save_random_head(model_path, tmp_path / "head", eagle3=True, attn_std=ATTN_STD,
                                rope_parameters={**LLAMA3_ROPE, "rope_theta": theta})
    rows = vllm_first_drafts(head_dir, tmp_path, "eagle3")
    model = load_target(model_path)
    head, cfg = load_head(head_dir, num_target_layers=model.config.num_hidden_layers)
    assert head.kind == "eagle3" and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.rope_theta == theta
    _compare(head, model, rows, _variant(head, rope_scaling=None))


@pytest.fixture(scope="module")
def qwen2_target(model_path, tmp_path_factory):
    """A tiny random Qwen2ForCausalLM (q/k/v biases; 2 layers, hidden 256)
    with the embedded model's tokenizer and chat template."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("qwen2_target")
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                      max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=True,
                      use_sliding_window=False, bos_token_id=1, eos_token_id=2)
    Qwen2ForCausalLM(cfg).eval().save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(model_path) / name, out / name)
    return str(out)


def test_vllm_eagle_qwen2_biased_head(qwen2_target, tmp_path):
    from transformers import AutoModelForCausalLM

    head_dir = save_random_head(qwen2_target, tmp_path / "head", attn_std=ATTN_STD,
                                qkv_bias=True)
    written = json.loads((Path(head_dir) / "config.json").read_text())
    assert written["qkv_bias"] is True and written["attention_bias"] is False
    rows = vllm_first_drafts(head_dir, tmp_path, "eagle", model=qwen2_target)
    assert len(rows) == len(COMPARE_PROMPTS)
    model = AutoModelForCausalLM.from_pretrained(qwen2_target, dtype=torch.float32).eval()
    head, cfg = load_head(head_dir, hidden_size=256, vocab_size=49152)
    assert head.kind == "eagle1" and cfg.has_qkv_bias and not cfg.attention_bias
    no_bias = _variant(head)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(no_bias.layers[0].self_attn, name).bias.zero_()
    _compare(head, model, rows, no_bias)
