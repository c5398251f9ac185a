"""A model the tree path cannot serve that passes the process-0 check is
refused when the worker builds it, before any request (issue 22, defects 1
and 4): a tiny random Mistral whose every layer has a sliding window (no
``layer_types``), dummy weights, one engine start on CPU."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_uniform_sliding_window_is_refused_at_worker_start(tmp_path, model_path):
    folder = tmp_path / "mistral"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{model_path}/{name}", folder / name)
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="mistral", architectures=["MistralForCausalLM"], vocab_size=49152,
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=32,
        torch_dtype="float32")))
    code = (
        "from vllm import LLM\n"
        f"LLM(model={str(folder)!r}, load_format='dummy', dtype='float32', max_model_len=256,\n"
        "    enforce_eager=True, speculative_config={'method': 'token_recycling',\n"
        "                                            'num_speculative_tokens': 8})\n"
        "print('ENGINE STARTED')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "ENGINE STARTED" not in out, out[-3000:]
    assert "vllm_specplug tree verification does not support sliding windows" in out, \
        out[-3000:]
    assert "use a chain method (e.g. sam)" in out
