"""Bad speculative configs fail before any engine starts, with messages that
name the key and list the valid ones (real vLLM, no engine)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from vllm_specplug.options import SpecPlugConfigError


def _llm(model_path, spec):
    from vllm import LLM

    return LLM(model=model_path, dtype="float32", enforce_eager=True, max_model_len=512,
               speculative_config=spec)


@pytest.mark.parametrize("spec, must_mention", [
    ({"method": "sam", "sam_bogus": 1}, ["sam_bogus", "sam_min_match_len", "sam_spec_factor"]),
    ({"method": "sam", "num_speculative_tokens": 0}, ["num_speculative_tokens", "[1, 128]"]),
    ({"method": "sam", "num_speculative_tokens": 1000}, ["num_speculative_tokens"]),
    ({"method": "sam", "sam_min_match_len": "3"}, ["sam_min_match_len", "integer"]),
    ({"method": "sam", "sam_spec_factor": -1}, ["sam_spec_factor", ">="]),
    ({"method": "sam", "model": "x.Y"}, ["model", "remove it"]),
    ({"method": "sma"}, ["unknown speculative method", "sam", "ngram", "suffix"]),
])
def test_bad_config_fails_before_engine_start(model_path, spec, must_mention):
    t = time.perf_counter()
    with pytest.raises(SpecPlugConfigError) as e:
        _llm(model_path, spec)
    msg = str(e.value)
    for word in must_mention:
        assert word in msg, msg
    assert time.perf_counter() - t < 60


def test_vllm_methods_still_work_through_the_patch(model_path):
    """vLLM's own validation still applies to its own methods."""
    with pytest.raises(Exception) as e:
        _llm(model_path, {"method": "ngram", "num_speculative_tokens": 4, "bogus_key": 1})
    assert "bogus_key" in str(e.value)


@pytest.mark.server  # a `vllm serve` process (it stops before its engine): ~1 min
def test_serve_cli_rejects_bad_key_before_engine_start(model_path):
    t = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "vllm_specplug.cli", "vllm", "serve", model_path,
         "--dtype", "float32", "--speculative-config",
         json.dumps({"method": "sam", "sam_min_match": 3})],
        capture_output=True, text=True, timeout=240)
    assert r.returncode != 0
    err = r.stderr + r.stdout
    assert "sam_min_match" in err and "sam_min_match_len" in err, err[-3000:]
    assert "EngineCore" not in err  # no engine process was started
    assert time.perf_counter() - t < 240


def test_unsupported_vllm_version_fails_at_plugin_load():
    code = ("import vllm; vllm.__version__ = '0.31.1'\n"
            "from vllm.plugins import load_general_plugins\n"
            "load_general_plugins()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=240)
    assert r.returncode != 0
    assert "UnsupportedVLLMVersion" in r.stderr, r.stderr[-3000:]
    assert "0.32.0" in r.stderr and "0.31.1" in r.stderr


def test_plugin_is_registered_as_a_general_plugin():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "specplug"]
    assert eps and eps[0].value == "vllm_specplug:register"


def test_corpus_from_another_tokenizer_fails_in_vllm_config(model_path, tmp_path):
    """Through vLLM's own config path: the target's tokenizer reaches our check."""
    from vllm_specplug.proposers.corpus_automaton import build_corpus_automaton

    path = tmp_path / "other.sam"
    build_corpus_automaton([[1, 2, 3]], 0, {"name": "other-tok", "vocab_sha256": "0" * 64},
                           path, progress=False)
    with pytest.raises(SpecPlugConfigError, match="other-tok"):
        _llm(model_path, {"method": "sam", "sam_corpus": str(path)})
    with pytest.raises(SpecPlugConfigError, match="unknown scorer 'fast'"):
        _llm(model_path, {"method": "sam", "acceptance": "fast"})
