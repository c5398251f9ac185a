"""vllm-specplug: speculative-decoding methods for vLLM, as a plugin.

Importing this package does not import vLLM; ``register`` (the
``vllm.general_plugins`` entry point) does.
"""
from __future__ import annotations

__version__ = "0.1.0"


def register() -> None:
    """Entry point run by vLLM in every process (idempotent)."""
    from .vllm_adapter import install

    install()
