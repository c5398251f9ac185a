"""scripts/device_gpu_checks.py runs: its ``--smoke`` mode (CPU, Triton's
interpreter, tiny sizes) in a subprocess where ``import vllm`` fails, as on
the device machine; and its helpers against the package's own."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "device_gpu_checks.py"


def _script():
    spec = importlib.util.spec_from_file_location("device_gpu_checks", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_smoke_run_without_vllm(tmp_path):
    blocker = tmp_path / "novllm" / "vllm"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(
        "raise ImportError('vllm is not installed on the device machine')\n")
    out = tmp_path / "smoke.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(blocker.parent), str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["ok"] and not s["errors"] and s["vllm_imported"] is False
    a = s["correctness"]
    assert a["all_ok"] and a["cases"] and a["chain_vs_sdpa"]
    assert {r["nodes"] for r in a["cases"]} >= {1, 4, 9}
    assert {r["dtype"] for r in a["cases"]} == {"bfloat16", "float16"}
    assert all(r["sdpa_tol_ratio"] <= 1 for r in a["chain_vs_sdpa"])
    assert s["cuda_kv"]["all_ok"] and s["cuda_kv"]["layout_of"] == {"cpu": "cpu_vec"}
    assert s["warm_up"]["bfloat16"]["warm_node_counts"] == [1, 9, 17]  # GQA 2: 3 variants
    rows = s["kernel_speed"]["rows"]
    assert rows and all(r["kernel_random_ms"] > 0 and r["sdpa_chain_ms"] > 0 for r in rows)
    c = s["verify_cost"]
    assert len(c["rows"]) == 2 * 2 * 3 and set(c["fits"]) == {"8/1", "8/2", "16/1", "16/2"}


def test_fit_line_recovers_a_line():
    mod = _script()
    xs = [1, 2, 4, 8, 16, 32, 64, 128]
    fit = mod.fit_line(xs, [3.0 + 0.25 * x for x in xs])
    assert fit["a_ms"] == pytest.approx(3.0) and fit["b_ms_per_token"] == pytest.approx(0.25)
    assert fit["b_over_a"] == pytest.approx(0.25 / 3.0, rel=1e-4) and fit["r2"] == 1.0
    noisy = [3.0 + 0.25 * x + (-1) ** i * 0.1 for i, x in enumerate(xs)]
    want = np.polyfit(xs, noisy, 1)
    fit = mod.fit_line(xs, noisy)
    assert fit["b_ms_per_token"] == pytest.approx(want[0], abs=1e-6)
    assert fit["a_ms"] == pytest.approx(want[1], abs=1e-4)


@pytest.mark.parametrize("n", [1, 5, 17, 63, 64])
def test_tree_helpers_match_the_package(n):
    from vllm_specplug.kernels.tree_attention_triton import ancestor_bits_from_parents
    from vllm_specplug.tree import ancestor_mask

    mod = _script()
    gen = torch.Generator().manual_seed(n)
    for kind in ("random", "chain"):
        parents = mod.random_parents(gen, n, kind)
        assert mod.ancestor_bits(parents) == ancestor_bits_from_parents(parents).tolist()
        assert np.array_equal(mod.masks_of([parents])[0].numpy(),
                              ancestor_mask(np.asarray(parents)))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_cpu_check_of_the_cuda_impl():
    """scripts/cpu_check_tree_attention_cuda.py: TreeFlashAttentionImpl's
    refusals at build, its forward (vLLM's FlashAttention stubbed, the kernel
    under Triton's interpreter, warm-up included) against the CPU path's SDPA.
    About 25 s here."""
    pytest.importorskip("vllm")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" /
                                               "cpu_check_tree_attention_cuda.py")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (
        proc.stdout[-3000:] + proc.stderr[-3000:])
