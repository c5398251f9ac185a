"""Config translation, option validation and the vLLM version check. No vLLM import."""
from __future__ import annotations

import importlib
import sys

import pytest

import vllm_specplug

BATCH_DEFAULTS = {"batch_budget": "auto", "disable_by_batch_size": None, "goodput": "off",
                  "batch_drain": "auto",
                  "isolation": "salt"}

from vllm_specplug import config
from vllm_specplug.config import (DEFAULT_NUM_SPECULATIVE_TOKENS, DRAFTER_CLASS_PATH,
                                  build_proposer, translate, unknown_method_error)
from vllm_specplug.options import SpecPlugConfigError
from vllm_specplug.proposers.sam import SamProposer
from vllm_specplug.vllm_adapter.version import (SUPPORTED_VLLM_VERSIONS,
                                                UnsupportedVLLMVersion, check_vllm_version)

SAM_DEFAULTS = {"sam_continuation": "frequent", "sam_min_match_len": 1,
                "sam_min_accept_prob": None,
                "sam_spec_factor": 4.0, "sam_corpus": "", "sam_corpus_bias": None,
                "sam_global_tokens": 500_000, "sam_global_bytes": 0, "sam_global_prompts": False,
                "sam_global_live": True,
                "sam_global_tenants": 16, "sam_stop": "auto", "sam_stop_file": ""}
SAM_KEYS = ("sam_continuation", "sam_min_match_len", "sam_min_accept_prob",
            "sam_spec_factor")


def test_translate_defaults():
    vllm_kwargs, plugin = translate({"method": "sam"})
    assert DEFAULT_NUM_SPECULATIVE_TOKENS == 8
    # sam's own default: a ceiling for its cost-based draft lengths
    assert vllm_kwargs == {"method": "custom_class", "model": DRAFTER_CLASS_PATH,
                           "num_speculative_tokens": 32}
    assert plugin == {"method": "sam", "num_speculative_tokens": 32, "options": SAM_DEFAULTS,
                      "version": vllm_specplug.__version__, **BATCH_DEFAULTS}
    assert isinstance(plugin["options"]["sam_spec_factor"], float)


def test_translate_explicit_none_k_is_default():
    vllm_kwargs, plugin = translate({"method": "sam", "num_speculative_tokens": None})
    assert vllm_kwargs["num_speculative_tokens"] == plugin["num_speculative_tokens"] == 32


@pytest.mark.parametrize("k", [1, 4, 128])
def test_translate_k(k):
    vllm_kwargs, plugin = translate({"method": "sam", "num_speculative_tokens": k})
    assert vllm_kwargs == {"method": "custom_class", "model": DRAFTER_CLASS_PATH,
                           "num_speculative_tokens": k}
    assert plugin["num_speculative_tokens"] == k
    assert plugin["options"] == SAM_DEFAULTS


def test_translate_options():
    spec = {"method": "sam", "num_speculative_tokens": 5, "sam_min_match_len": 3,
            "sam_spec_factor": 2}
    before = dict(spec)
    vllm_kwargs, plugin = translate(spec)
    assert spec == before  # the caller's dict is not modified
    assert vllm_kwargs["num_speculative_tokens"] == 5
    assert plugin == {"method": "sam", "num_speculative_tokens": 5,
                      "options": {**SAM_DEFAULTS, "sam_min_match_len": 3,
                                  "sam_spec_factor": 2.0},
                      "version": vllm_specplug.__version__, **BATCH_DEFAULTS}
    assert isinstance(plugin["options"]["sam_spec_factor"], float)


def test_translate_new_options():
    spec = {"method": "sam", "sam_continuation": "first", "sam_min_accept_prob": 0}
    _, plugin = translate(spec)
    assert plugin["options"] == {**SAM_DEFAULTS, "sam_continuation": "first",
                                 "sam_min_accept_prob": 0.0}
    assert isinstance(plugin["options"]["sam_min_accept_prob"], float)
    _, plugin = translate({"method": "sam", "sam-continuation": "frequent",
                           "sam-min-accept-prob": 0.5})
    assert plugin["options"]["sam_continuation"] == "frequent"
    assert plugin["options"]["sam_min_accept_prob"] == 0.5


def test_translate_accepts_dashed_keys():
    _, plugin = translate({"method": "sam", "num-speculative-tokens": 3,
                           "sam-min-match-len": 4})
    assert plugin["num_speculative_tokens"] == 3
    assert plugin["options"]["sam_min_match_len"] == 4


def test_drafter_class_path_resolves():
    module, _, name = DRAFTER_CLASS_PATH.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    assert cls.__name__ == "SpecPlugDrafter"


# ------------------------------------------------------------------- errors
def test_error_is_a_value_error():
    assert issubclass(SpecPlugConfigError, ValueError)


def test_unknown_key_names_it_and_lists_valid_keys():
    with pytest.raises(SpecPlugConfigError) as info:
        translate({"method": "sam", "sam_min_match": 3})
    msg = str(info.value)
    assert "'sam_min_match'" in msg
    for key in ("method", "num_speculative_tokens") + SAM_KEYS:
        assert key in msg


@pytest.mark.parametrize("value", ["4", True, False, 4.0, 2.5, [4]])
def test_k_wrong_type(value):
    with pytest.raises(SpecPlugConfigError, match="num_speculative_tokens"):
        translate({"method": "sam", "num_speculative_tokens": value})


@pytest.mark.parametrize("value", [0, -1, -8, 129, 10_000])
def test_k_out_of_range(value):
    with pytest.raises(SpecPlugConfigError, match="num_speculative_tokens") as info:
        translate({"method": "sam", "num_speculative_tokens": value})
    assert "128" in str(info.value)


@pytest.mark.parametrize("value", ["2", True, 2.0, None])
def test_int_option_wrong_type(value):
    with pytest.raises(SpecPlugConfigError, match="sam_min_match_len.*integer"):
        translate({"method": "sam", "sam_min_match_len": value})


@pytest.mark.parametrize("value", [0, -1, 1025])
def test_int_option_out_of_range(value):
    with pytest.raises(SpecPlugConfigError, match="sam_min_match_len"):
        translate({"method": "sam", "sam_min_match_len": value})


@pytest.mark.parametrize("value", ["4.0", True, None, float("nan")])
def test_float_option_wrong_type(value):
    with pytest.raises(SpecPlugConfigError, match="sam_spec_factor"):
        translate({"method": "sam", "sam_spec_factor": value})


@pytest.mark.parametrize("value", [0, 0.0, -1.0, 1024.5, float("inf")])
def test_float_option_out_of_range(value):
    with pytest.raises(SpecPlugConfigError, match="sam_spec_factor"):
        translate({"method": "sam", "sam_spec_factor": value})


@pytest.mark.parametrize("value", ["fast", "First", "", None, 1, ["first"]])
def test_continuation_must_be_a_choice(value):
    with pytest.raises(SpecPlugConfigError, match="sam_continuation") as info:
        translate({"method": "sam", "sam_continuation": value})
    if isinstance(value, str):
        msg = str(info.value)
        assert "'frequent'" in msg and "'first'" in msg


@pytest.mark.parametrize("key", ["sam_min_accept_prob"])
@pytest.mark.parametrize("value", [-0.01, 1.01, 2, float("inf"), float("nan"), "0.5", True, None])
def test_probability_options_rejected(key, value):
    with pytest.raises(SpecPlugConfigError, match=key):
        translate({"method": "sam", key: value})


@pytest.mark.parametrize("key", ["sam_min_accept_prob"])
@pytest.mark.parametrize("value", [0, 0.0, 0.5, 1, 1.0])
def test_probability_options_accepted(key, value):
    _, plugin = translate({"method": "sam", key: value})
    assert plugin["options"][key] == float(value)
    assert isinstance(plugin["options"][key], float)


@pytest.mark.parametrize("key", ["model", "custom_class"])
def test_model_key_is_rejected(key):
    with pytest.raises(SpecPlugConfigError) as info:
        translate({"method": "sam", key: "some/model"})
    msg = str(info.value)
    assert repr(key) in msg
    assert "remove it" in msg  # says what to do, not just "unknown key"
    assert "sam_min_match_len" in msg


def test_unknown_method_error():
    err = unknown_method_error("foo", ["ngram", "suffix"])
    assert isinstance(err, SpecPlugConfigError)
    msg = str(err)
    assert "'foo'" in msg
    assert "sam" in msg
    assert "ngram" in msg and "suffix" in msg


# ------------------------------------------------------------ build_proposer
def test_build_proposer_defaults():
    _, plugin = translate({"method": "sam", "num_speculative_tokens": 4})
    prop = build_proposer(plugin)
    assert isinstance(prop, SamProposer)
    assert prop.num_speculative_tokens == 4
    assert prop.continuation == "frequent"
    assert prop.min_match_len == 1
    assert prop.min_accept_prob is None   # draft lengths from the verify cost
    assert prop.spec_factor == 4.0
    assert prop.acceptance.tried.shape[1] == 4


def test_build_proposer_applies_options():
    _, plugin = translate({"method": "sam", "num_speculative_tokens": 3,
                           "sam_min_match_len": 5, "sam_spec_factor": 0.5})
    prop = build_proposer(plugin)
    assert isinstance(prop, SamProposer)
    assert (prop.num_speculative_tokens, prop.min_match_len, prop.spec_factor) == (3, 5, 0.5)
    _, plugin = translate({"method": "sam", "num_speculative_tokens": 6,
                           "sam_continuation": "first", "sam_min_accept_prob": 0})
    prop = build_proposer(plugin)
    assert (prop.num_speculative_tokens, prop.continuation, prop.min_accept_prob) == (
        6, "first", 0.0)
    # the options act: "first" falls back to the first occurrence of a shorter
    # match ([1]) for more tokens; "frequent" continues the longest ([1, 3, 1]),
    # and where that walk reaches the end of the text, continues [1, 3, 1] again
    ctx = [1, 2, 1, 3, 1, 3, 1]
    prop.start("r", ctx)
    assert prop.propose("r", 6).tokens.tolist() == [2, 1, 3, 1, 3, 1]
    _, plugin = translate({"method": "sam", "num_speculative_tokens": 6})
    default = build_proposer(plugin)
    default.start("r", ctx)
    assert default.propose("r", 6).tokens.tolist() == [3, 1, 3, 1, 3, 1]


def test_is_plugin_method():
    assert config.is_plugin_method("sam")
    assert not config.is_plugin_method("ngram")
    assert not config.is_plugin_method(None)
    assert not config.is_plugin_method(["sam"])


# -------------------------------------------------------------- vLLM version
def test_unsupported_vllm_version():
    assert "0.32.0" in SUPPORTED_VLLM_VERSIONS
    with pytest.raises(UnsupportedVLLMVersion) as info:
        check_vllm_version("0.31.0")
    msg = str(info.value)
    assert "0.32.0" in msg
    assert "0.31.0" in msg
    assert isinstance(info.value, RuntimeError)


@pytest.mark.parametrize("version", ["0.32.1", "0.33.1", "0.34.1", "0.35.0", "0.32.0rc1",
                                     "unknown"])
def test_other_versions_rejected(version):
    with pytest.raises(UnsupportedVLLMVersion, match="0.32.0, 0.33.0, 0.34.0"):
        check_vllm_version(version)


@pytest.mark.parametrize("version, adapter", [
    ("0.32.0", "v1"), ("0.32.0+cpu", "v1"), ("0.32.0+cu128", "v1"), ("0.33.0", "v1"),
    ("0.34.0", "mrv2"), ("0.34.0+cu129", "mrv2")])
def test_supported_vllm_version(version, adapter):
    """Each supported release is served by its line's adapter package."""
    from vllm_specplug.vllm_adapter import adapter_name

    assert check_vllm_version(version) == version
    assert adapter_name(version) == adapter


def test_version_check_with_explicit_version_does_not_import_vllm():
    if "vllm" in sys.modules:
        pytest.skip("vllm already imported by another test")
    check_vllm_version("0.32.0+cpu")
    with pytest.raises(UnsupportedVLLMVersion):
        check_vllm_version("0.31.0")
    assert "vllm" not in sys.modules


@pytest.mark.parametrize("value,expect", [
    ("block", {"name": "block", "options": {}}),
    ({"name": "typical", "posterior_threshold": 0.05},
     {"name": "typical", "options": {"posterior_threshold": 0.05, "posterior_alpha": 0.3}}),
])
def test_acceptance_key_selects_a_scorer(value, expect):
    _, plugin = translate({"method": "sam", "acceptance": value})
    assert plugin["acceptance"] == expect
    _, plugin = translate({"method": "token_recycling"})
    assert "acceptance" not in plugin


@pytest.mark.parametrize("value,match", [
    ("nope", "unknown scorer 'nope'"),
    ("greedy", "always verified greedily"),
    ({"name": "typical", "threshold": 1}, "unknown key 'threshold'"),
    ({"name": "typical", "posterior_alpha": -1}, "posterior_alpha"),
    (3, "must be a scorer name"),
])
def test_bad_acceptance_values(value, match):
    with pytest.raises(SpecPlugConfigError, match=match):
        translate({"method": "sam", "acceptance": value})
