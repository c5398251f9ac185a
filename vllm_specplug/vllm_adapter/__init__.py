"""Everything that touches vLLM internals. Nothing else in the package may.

One adapter per vLLM line, chosen at plugin load from the installed vLLM's
release (``ADAPTERS``):

* ``v1``   (vLLM 0.32, 0.33): Model Runner V1 and the ``custom_class``
  speculative method; a table of monkey-patches (``v1.PATCHES``), every
  method, tree verification.
* ``mrv2`` (vLLM 0.34): Model Runner V2's experimental speculator plug-in API
  (``register_speculative_method``); a table of registrations
  (``mrv2.REGISTRATIONS``), chain methods only.

Each adapter package exposes ``install()`` (run by the
``vllm.general_plugins`` entry point in every vLLM process: checks that every
target exists, naming a missing one, and applies or registers what it must)
and ``check_targets()``. ``version.py`` and ``patching.py`` are shared.
"""
from __future__ import annotations

import importlib

from .patching import APPLIED, PatchTargetMissing, applied_names
from .version import (ADAPTERS, SUPPORTED_VLLM_VERSIONS, UnsupportedVLLMVersion,
                      adapter_name, check_vllm_version)


def adapter_for(version: str | None = None):
    """The adapter package (``vllm_specplug.vllm_adapter.v1`` or ``.mrv2``) for
    ``version`` (default: the installed vLLM); ``UnsupportedVLLMVersion`` for
    any other release."""
    name = adapter_name(check_vllm_version(version))
    return importlib.import_module(f"{__name__}.{name}")


def install() -> None:
    """The plugin entry point's work: the installed vLLM's adapter, installed."""
    adapter_for().install()


__all__ = ["ADAPTERS", "APPLIED", "PatchTargetMissing", "SUPPORTED_VLLM_VERSIONS",
           "UnsupportedVLLMVersion", "adapter_for", "adapter_name", "applied_names",
           "check_vllm_version", "install"]
