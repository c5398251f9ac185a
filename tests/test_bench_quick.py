"""End to end: `specplug bench --quick` on the real embedded model."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_specplug.cli import QUICK

pytestmark = pytest.mark.engine


def test_bench_quick_end_to_end(model_path, tmp_path):
    out = tmp_path / "quick"
    r = subprocess.run([sys.executable, "-m", "vllm_specplug", "bench", "--quick",
                        "--model", model_path, "--out", str(out), "--max-tokens", "24"],
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    res = json.loads((out / "results.json").read_text())
    for key in ("model", "settings", "environment", "notes", "methods"):
        assert key in res
    for key in ("cpu", "vllm", "torch", "vllm_specplug"):
        assert res["environment"][key]
    methods = res["methods"]
    # the demo's methods: vLLM's own suffix runs through our patched runner too
    assert list(methods) == ["plain", "suffix", "sam", "sam_tr"]
    plain = methods["plain"]
    assert plain["overall"]["tau"] == 1.0
    assert plain["overall"]["draft_tokens_per_step"] == 0.0
    for name, m in methods.items():
        for key in ("speculative_config", "overall", "categories", "per_prompt",
                    "outputs_differing_from_plain", "engine_start_seconds"):
            assert key in m, (name, key)
        # one engine per method ran every demo workload
        assert list(m["categories"]) == list(QUICK["recommends"])
        o = m["overall"]
        for key in ("tau", "tokens_per_second", "speedup", "draft_tokens_per_step",
                    "acceptance_rate", "acceptance_per_position"):
            assert key in o, (name, key)
        assert o["tokens_per_second"] > 0
        # engine stats on: first to last token is a part of each request's time
        assert 0 < o["decode_seconds"] < o["seconds"] and o["decode_tokens_per_second"] > 0
        # Every method here is lossless at temperature 0.
        assert m["outputs_differing_from_plain"] == 0, (name, m["differing_prompt_ids"])
    assert methods["sam"]["overall"]["tau"] > 1.0
    assert methods["sam"]["speculative_config"]["method"] == "sam"
    for png in ("speedup.png", "tau.png", "tau_vs_tps.png"):
        assert (out / png).stat().st_size > 1000
    assert "| sam |" in (out / "results.md").read_text()
    assert "| sam |" in r.stdout
    # a verdict line per workload, after the per-method ones
    verdicts = r.stdout.split("By workload")[1].splitlines()
    for workload in QUICK["recommends"]:
        assert sum(line.startswith(f"* {workload} (") for line in verdicts) == 1, r.stdout
