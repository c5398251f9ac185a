"""Every monkeypatch of vLLM, declared in one place and recorded.

A patch is named after the vLLM class it changes. ``apply`` is idempotent
(every vLLM process loads the plugin, some more than once) and keeps the
original attribute so tests can inspect or undo it.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger("vllm_specplug")


@dataclass(frozen=True)
class Patch:
    name: str            # e.g. "EngineArgs.create_speculative_config"
    module: str          # where the class lives
    cls: str | None      # the vLLM class changed (None: a module-level function)
    attr: str            # the attribute replaced
    make: Callable[[Any], Any]  # original -> replacement
    why: str


#: name -> (patch, original attribute) for every patch applied in this process.
APPLIED: dict[str, tuple[Patch, Any]] = {}


def apply(patch: Patch) -> None:
    if patch.name in APPLIED:
        return
    owner = importlib.import_module(patch.module)
    if patch.cls is not None:
        owner = getattr(owner, patch.cls)
    original = owner.__dict__.get(patch.attr, getattr(owner, patch.attr, None))
    replacement = patch.make(original)
    setattr(replacement, "__specplug_patch__", patch.name)
    setattr(owner, patch.attr, replacement)
    APPLIED[patch.name] = (patch, original)
    logger.debug("vllm_specplug: patched %s (%s)", patch.name, patch.why)


def applied_names() -> list[str]:
    return sorted(APPLIED)
