"""The warm-up at drafter construction compiles every numba specialization
the real request path uses: after it, real requests driven through the
drafter (starts, drafts, finished outputs entering the global store, drafts
from the store and from a static corpus) add no signature to any of the
plugin's numba dispatchers. Without the warm-up the same requests do (the
check can fail).

Each case runs in a fresh process: numba's dispatchers keep the signatures
earlier tests compiled in this one."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

SCRIPT = r"""
import json, sys
import numba
import numpy as np
from helpers import make_vllm_config, step
import vllm_specplug.vllm_adapter.v1 as adapter
from vllm_specplug.vllm_adapter.v1 import drafter as drafter_module

spec, warm = json.loads(sys.argv[1]), sys.argv[2] == "1"
adapter.install_worker_patches = lambda: None
adapter.install_tree_patches = lambda cfg: None
if not warm:
    drafter_module.warm_up = lambda plugin: None

def signatures():
    from vllm_specplug.proposers import corpus_automaton, global_store, stop_kernels
    return {f"{m.__name__}.{n}": len(f.signatures)
            for m in (global_store, corpus_automaton, stop_kernels)
            for n, f in vars(m).items() if isinstance(f, numba.core.dispatcher.Dispatcher)}

d = drafter_module.SpecPlugDrafter(make_vllm_config(spec))
before = signatures()
rng = np.random.default_rng(0)
body = rng.integers(100, 49000, size=40).tolist()
outputs = {}
for r in range(4):
    rid = f"real-{r}"
    # each prompt repeats part of itself and quotes the previous output
    hist = body[r:r + 20] + body[r:r + 10] + outputs.get(r - 1, body[:8])[:6]
    start = len(hist)
    for _ in range(6):
        drafts = step(d, [rid], [hist], [[hist[-1]]])
        hist = hist + (drafts[0][:2] or []) + [int(rng.integers(100, 49000))]
    outputs[r] = hist[start:]
    d.finish_request(rid)
after = signatures()
print("@@" + json.dumps({"before": before, "after": after,
                         "warmup_seconds": getattr(d, "warmup_seconds", None)}))
"""


def _run(spec: dict, warm: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get(
        "PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(spec), "1" if warm else "0"],
                          capture_output=True, text=True, env=env, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("@@")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[2:])


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    from vllm_specplug.proposers.corpus_automaton import build_corpus_automaton

    path = tmp_path_factory.mktemp("corpus") / "c.sam"
    build_corpus_automaton([[5, 6, 7, 8, 9] * 4, [300, 301, 302, 303]], 2,
                           {"name": "t", "vocab_sha256": "0" * 64}, path, progress=False)
    return str(path)


@pytest.mark.parametrize("method", ["sam", "sam_tr", "sam_corpus"])
def test_no_compile_after_warm_up(method, corpus_file):
    spec = {"method": method, "num_speculative_tokens": 8}
    if method == "sam_corpus":
        spec = {"method": "sam", "num_speculative_tokens": 8, "sam_corpus": corpus_file}
    warm = _run(spec, warm=True)
    assert warm["after"] == warm["before"], {
        k: (warm["before"][k], v) for k, v in warm["after"].items() if warm["before"][k] != v}
    assert warm["warmup_seconds"] is not None
    # the store's insertion, matching and continuation, and (with a corpus)
    # the corpus matching were compiled by the warm-up
    compiled = {k for k, v in warm["before"].items() if v}
    assert {"vllm_specplug.proposers.global_store._add_document",
            "vllm_specplug.proposers.global_store._advance",
            "vllm_specplug.proposers.global_store._frequent",
            # the learned stopping rule's scoring and calibration update
            "vllm_specplug.proposers.stop_kernels.score_kernel",
            "vllm_specplug.proposers.stop_kernels.calibrate_kernel"} <= compiled, compiled
    if method == "sam_corpus":
        assert "vllm_specplug.proposers.corpus_automaton._advance_many" in compiled
    if method != "sam":
        return
    # without the warm-up the same requests compile: the check can fail
    cold = _run(spec, warm=False)
    assert cold["after"] != cold["before"]
    # (a subset: kernels called only from other kernels get signatures of
    # their own when compiled, not when their caller loads from the cache)
    assert {k for k, v in cold["after"].items() if v} <= compiled


def test_warm_up_leaves_the_real_proposer_alone(tmp_path):
    """The twin is a separate SamProposer with the method's SAM options and the
    smallest store; the real proposer's state is untouched."""
    from vllm_specplug.config import build_proposer, translate
    from vllm_specplug.warmup import sam_twin, warm_up

    _, plugin = translate({"method": "sam_tr", "sam_min_match_len": 2,
                           "tr_save_matrix": str(tmp_path / "tr.npy")})
    twin = sam_twin(plugin)
    assert twin.min_match_len == 2 and twin.global_store.max_tokens == 1024
    assert plugin["options"]["sam_global_tokens"] == 500_000   # the real config unchanged
    real = build_proposer(plugin)
    assert warm_up(plugin) is not None
    assert not (tmp_path / "tr.npy").exists()
    assert real.sam.global_store.num_tokens == 0 and real.active_requests() == 0


def test_only_methods_with_a_sam_part_are_driven():
    from vllm_specplug.config import translate
    from vllm_specplug.warmup import sam_twin

    for method in ("token_recycling", "del", "debug_random_tree"):
        assert sam_twin(translate({"method": method})[1]) is None
    plugin = {"method": "sam_eagle2", "num_speculative_tokens": 16,
              "options": {"sam_global_tokens": 0, "depth": 6}}
    twin = sam_twin(plugin)
    assert twin.global_store is None and twin.num_speculative_tokens == 16


def test_warm_up_can_be_turned_off(monkeypatch):
    from vllm_specplug import warmup
    from vllm_specplug.config import translate

    monkeypatch.setattr(warmup, "exercise", lambda proposer, budget: 1 / 0)
    monkeypatch.setenv("VLLM_SPECPLUG_WARMUP", "0")
    assert warmup.warm_up(translate({"method": "sam"})[1]) is None


def test_warm_up_failure_is_logged_not_raised(caplog, monkeypatch):
    from vllm_specplug import warmup
    from vllm_specplug.config import translate

    def boom(proposer, budget):
        raise RuntimeError("boom")

    monkeypatch.setattr(warmup, "exercise", boom)
    _, plugin = translate({"method": "sam"})
    with caplog.at_level("WARNING", logger="vllm_specplug"):
        assert warmup.warm_up(plugin) is None
    assert "warm-up of sam failed" in caplog.text


def test_cpu_gemm_warm_up_runs_every_dispatched_layer_for_every_row_count(monkeypatch):
    """vLLM's CPU GEMM dispatch (oneDNN) builds a primitive per layer and row
    count on first use; the drafter runs each dispatched layer (``cpu_linear``
    set) through its own ``quant_method.apply`` for every count a verify
    step can have, capped at the 32 primitives vLLM keeps per layer."""
    import torch
    from vllm.model_executor.layers import linear, vocab_parallel_embedding

    from vllm_specplug.vllm_adapter.v1 import cpu_warmup

    calls = []

    class Method:
        def apply(self, layer, x, bias=None):
            calls.append((layer.name, tuple(x.shape), x.dtype, bias is not None))

    class FakeLinear(torch.nn.Module):
        def __init__(self, name, k, bias, skip_bias_add=False):
            super().__init__()
            self.name, self.input_size_per_partition = name, k
            self.bias = torch.nn.Parameter(torch.zeros(3)) if bias else None
            self.skip_bias_add, self.quant_method = skip_bias_add, Method()
            self.cpu_linear = object()

    class FakeHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.name, self.embedding_dim, self.quant_method = "head", 16, Method()
            self.cpu_linear = object()

    monkeypatch.setattr(linear, "LinearBase", FakeLinear)
    monkeypatch.setattr(vocab_parallel_embedding, "VocabParallelEmbedding", FakeHead)
    model = torch.nn.Sequential(FakeLinear("qkv", 8, bias=True), FakeLinear("o", 4, bias=False),
                                FakeLinear("skip", 4, bias=True, skip_bias_add=True),
                                torch.nn.Linear(2, 2), FakeHead())
    assert list(cpu_warmup.token_counts(4)) == [1, 2, 3, 4, 5]
    assert list(cpu_warmup.token_counts(64)) == list(range(1, 33))
    layers, _ = cpu_warmup.warm_cpu_gemms(model, torch.float32, cpu_warmup.token_counts(4))
    assert layers == 4   # torch.nn.Linear has no cpu_linear: not vLLM's dispatch
    assert calls[:5] == [("qkv", (m, 8), torch.float32, True) for m in range(1, 6)]
    assert {c for c in calls if c[0] == "skip"} == {("skip", (m, 4), torch.float32, False)
                                                   for m in range(1, 6)}
    assert [c[1] for c in calls if c[0] == "head"] == [(m, 16) for m in range(1, 6)]


def test_drafter_warms_the_cpu_gemms_at_load_model(patch_calls, monkeypatch):
    from helpers import make_vllm_config
    from vllm_specplug.vllm_adapter.v1 import cpu_warmup
    from vllm_specplug.vllm_adapter.v1.drafter import SpecPlugDrafter

    seen = []
    monkeypatch.setattr(cpu_warmup, "warm_cpu_gemms",
                        lambda model, dtype, counts: seen.append((model, list(counts))) or (0, 0.0))
    d = SpecPlugDrafter(make_vllm_config({"method": "sam", "num_speculative_tokens": 6}))
    d.load_model("model")
    assert seen == [("model", list(range(1, 8)))]
    monkeypatch.setenv("VLLM_SPECPLUG_WARMUP", "0")
    d.load_model("model")
    assert len(seen) == 1
