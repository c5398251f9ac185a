"""Shared fixtures. Engines are expensive (~45 s to start): one per config,
shared by every test of the session."""
from __future__ import annotations

import os
import sys
import time

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Engines started by the tests (and their worker processes, which inherit the
# environment) cache their step-cost fit in a folder of this session, never in
# the user's cache: a test must not depend on, nor change, what earlier runs
# on this machine measured. (An explicit setting, e.g. 0, is kept.)
if "VLLM_SPECPLUG_STEP_COST_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _step_cost_dir = tempfile.mkdtemp(prefix="specplug-test-step-cost-")
    os.environ["VLLM_SPECPLUG_STEP_COST_CACHE"] = _step_cost_dir
    atexit.register(shutil.rmtree, _step_cost_dir, ignore_errors=True)
# Tests read the drafter's stats from the worker with collective_rpc(function).
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

_ENGINES: dict = {}

# Two tiers. The default run (CI, `bash scripts/test.sh`) keeps every unit and
# property test and one real-engine check of each method and of each path
# through vLLM (greedy identity, one tree and one chain sampling-distribution
# test, runtime edge cases, TP=2, serving, soak). Tests marked ``slow`` repeat
# those checks for further methods, options and executors (more sampling
# distributions, more TP=2 methods, Ray, EAGLE-3 against vLLM, more servers);
# they run with SPECPLUG_SLOW_TESTS=1 (both tiers: over 90 minutes on 2 cores).
from helpers import RUN_SLOW  # noqa: E402

# The fast tier (`bash scripts/test.sh --fast`, SPECPLUG_FAST_TESTS=1): unit
# and property tests only, each property test with a fifth of its hypothesis
# examples (at least 10). CI's tier runs every example.
FAST = os.environ.get("SPECPLUG_FAST_TESTS") == "1"
FAST_EXAMPLES_DIVISOR = 5

# CI draws hypothesis's examples from a fixed seed: a verdict must not depend
# on the draw (a guard that catches a bug in 4 runs of 5 is luck). Local runs
# keep drawing new examples.
if os.environ.get("CI"):
    from hypothesis import settings as _settings

    _settings.register_profile("ci", derandomize=True, database=None)
    _settings.load_profile("ci")


def _fewer_examples(items) -> None:
    from hypothesis import settings

    done = set()
    for item in items:
        test = getattr(item, "obj", None)
        # hypothesis keeps a @given test's settings (its @settings included)
        # here and reads them at each call; other tests have none
        current = getattr(test, "_hypothesis_internal_use_settings", None)
        if current is None or id(test) in done:
            continue
        done.add(id(test))
        test._hypothesis_internal_use_settings = settings(
            current, max_examples=max(10, current.max_examples // FAST_EXAMPLES_DIVISOR))


def pytest_collection_modifyitems(config, items):
    if FAST:
        _fewer_examples(items)
    if RUN_SLOW:
        return
    skip = pytest.mark.skip(reason="second tier: run with SPECPLUG_SLOW_TESTS=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_path() -> str:
    from vllm_specplug.models import default_model_path

    return default_model_path()


# At most this many engines stay alive (each holds ~3 GB here); the least
# recently used one is shut down to make room, except the plain engine:
# most test modules compare against it, and each restart costs ~40 s.
MAX_LIVE_ENGINES = 3
PINNED_ENGINES = ("plain",)


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass


@pytest.fixture(scope="session")
def get_llm(model_path):
    """``get_llm(name, speculative_config)`` -> a shared vLLM ``LLM``."""
    from vllm_specplug.bench.engine import build_llm

    def get(name: str, speculative_config: dict | None = None, **overrides):
        if name in _ENGINES:
            _ENGINES[name] = _ENGINES.pop(name)  # most recently used last
            return _ENGINES[name]
        while len(_ENGINES) >= MAX_LIVE_ENGINES:
            victim = next((k for k in _ENGINES if k not in PINNED_ENGINES), None)
            if victim is None:
                break
            _shutdown(_ENGINES.pop(victim))
        overrides.setdefault("max_model_len", 2048)
        model = overrides.pop("model", model_path)
        t0 = time.time()
        _ENGINES[name] = build_llm(model, speculative_config, **overrides)
        print(f"\n[engine {name!r} started in {time.time() - t0:.0f} s]", file=sys.stderr)
        return _ENGINES[name]

    yield get
    for llm in _ENGINES.values():
        _shutdown(llm)
    _ENGINES.clear()


@pytest.fixture(scope="session")
def plain_samples(get_llm):
    """Plain sampling's first three tokens (helpers.first_three), shared by
    every sampling-distribution test of the session."""
    from helpers import first_three

    return first_three(get_llm("plain"), max_tokens=3)  # see first_three


@pytest.fixture
def patch_calls(monkeypatch):
    """SpecPlugDrafter without vLLM: the worker patches (which import vLLM's
    GPU model runner) replaced by a call counter."""
    import vllm_specplug.vllm_adapter.v1 as adapter

    calls = []
    monkeypatch.setattr(adapter, "install_worker_patches", lambda: calls.append(1))
    return calls


@pytest.fixture(scope="session")
def spec_bench_prompts():
    from vllm_specplug.bench.prompts import load_prompts

    return load_prompts()


# ---------------------------------------------------------------- EAGLE heads
@pytest.fixture(scope="session")
def eagle_random_head(model_path, tmp_path_factory):
    import json

    import torch

    from vllm_specplug.eagle.head import EagleHead, EagleHeadConfig, save_head

    with open(f"{model_path}/config.json") as f:
        config = EagleHeadConfig.from_dict(json.load(f))
    torch.manual_seed(0)
    head = EagleHead(config)
    out = tmp_path_factory.mktemp("eagle_random_head")
    save_head(head, config, out)
    return str(out)


@pytest.fixture(scope="session")
def eagle_trained_head(model_path, tmp_path_factory):
    """A head trained for a minute on the model's own answers to a few
    built-in (non-Spec-Bench) prompts."""
    from vllm_specplug.cli import main

    out = tmp_path_factory.mktemp("eagle_trained")
    assert main(["train-eagle", "--num-prompts", "48", "--max-tokens", "64", "--epochs", "3",
                 "--out", str(out)]) == 0
    return str(out / "head")
