"""The vLLM 0.34 side environment for a test module (``tests/test_mrv2_*``,
``tests/test_vllm034_*``): skips the module elsewhere, naming the set-up
command, and sets the environment vLLM 0.34 needs on this CPU."""
from __future__ import annotations

import importlib.util
import os

import pytest

HAVE_VLLM034 = (importlib.util.find_spec("vllm") is not None and importlib.util.find_spec(
    "vllm.v1.worker.gpu.spec_decode.speculator_config") is not None)


def require(**env: str) -> None:
    """Skip the calling module unless vLLM 0.34's modules are importable;
    else set vLLM's CPU environment (and ``env``) where not set already."""
    if not HAVE_VLLM034:
        pytest.skip("needs vLLM 0.34's Python modules: build the side environment with "
                    "`bash scripts/setup-vllm034.sh` and run this file with its Python "
                    "(docs/compatibility.md)", allow_module_level=True)
    for key, value in {"VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "",
                       "TRITON_INTERPRET": "1", **env}.items():
        os.environ.setdefault(key, value)
