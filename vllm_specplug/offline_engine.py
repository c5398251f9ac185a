"""An in-process vLLM engine (``vllm.LLM``) with this package's settings.

Used by every command that decodes offline: the benchmark
(``vllm_specplug.bench``, which re-exports these from ``bench.engine``), the
EAGLE trainer (``vllm_specplug.eagle.train``), ``specplug build-tr`` and
``answers``, the tests. vLLM is imported only when an engine is built.
"""
from __future__ import annotations

import os
from typing import Any


def cpu_defaults() -> None:
    """Environment a CPU engine needs here (only where the user set nothing)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def engine_kwargs(model: str, speculative_config: dict | None, **overrides: Any) -> dict:
    kw: dict[str, Any] = dict(model=model, dtype="float32", enforce_eager=True,
                              max_model_len=4096, seed=0, disable_log_stats=False)
    if speculative_config is not None:
        kw["speculative_config"] = dict(speculative_config)
    kw.update(overrides)
    return kw


def build_llm(model: str, speculative_config: dict | None, **overrides: Any):
    cpu_defaults()
    from vllm import LLM

    return LLM(**engine_kwargs(model, speculative_config, **overrides))
