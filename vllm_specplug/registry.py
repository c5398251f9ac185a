"""Plugins by name: built-ins plus third-party entry points.

Two groups use this: proposers (``vllm_specplug.proposers``, the
``method`` of a speculative config) and acceptance scorers
(``vllm_specplug.scorers``, see ``vllm_specplug.scorers.registry``). A
broken third-party entry point is reported (name and error) and skipped; it
never stops the others from loading.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import logging

from .proposers.base import Proposer

logger = logging.getLogger("vllm_specplug")

PROPOSER_GROUP = "vllm_specplug.proposers"

BUILTIN_PROPOSERS: dict[str, str] = {
    "sam": "vllm_specplug.proposers.sam:SamProposer",
    "token_recycling": "vllm_specplug.proposers.token_recycling:TokenRecyclingProposer",
    "sam_tr": "vllm_specplug.proposers.hybrid:SamTokenRecyclingProposer",
    "del": "vllm_specplug.proposers.early_exit:DelProposer",
    "eagle2": "vllm_specplug.proposers.eagle2:Eagle2Proposer",
    "sam_eagle2": "vllm_specplug.proposers.hybrid:SamEagle2Proposer",
    # For tests of tree verification, not for speed:
    "debug_oracle_tree": "vllm_specplug.proposers.testing:OracleTreeProposer",
    "debug_random_tree": "vllm_specplug.proposers.testing:RandomTreeProposer",
}


def _import(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


class PluginRegistry:
    """Classes of one kind by name, loaded once on first use.

    ``builtins`` maps names to ``"module:attr"``; entry points of ``group``
    add the rest. Entry points are looked up through
    ``importlib.metadata.entry_points`` at load time (tests may monkeypatch
    it, then call ``reset``)."""

    def __init__(self, group: str, kind: str, base: type, builtins: dict[str, str]) -> None:
        self.group = group
        self.kind = kind          # "proposer", "scorer": for messages
        self.base = base
        self.builtins = builtins
        self._loaded: dict[str, type] | None = None
        self._errors: dict[str, str] = {}

    def reset(self) -> None:
        """Forget what was loaded (the next use looks the entry points up again)."""
        self._loaded = None
        self._errors = {}

    def _load(self) -> dict[str, type]:
        if self._loaded is not None:
            return self._loaded
        found: dict[str, type] = {name: _import(path) for name, path in self.builtins.items()}
        errors: dict[str, str] = {}
        for ep in importlib.metadata.entry_points(group=self.group):
            if ep.name in found:
                errors[ep.name] = (f"entry point {ep.value!r} ignored: the name is taken "
                                   f"by a built-in {self.kind}")
                continue
            try:
                cls = ep.load()
                if not (isinstance(cls, type) and issubclass(cls, self.base)):
                    raise TypeError(f"{ep.value} is not a vllm_specplug "
                                    f"{self.base.__name__} subclass")
                found[ep.name] = cls
            except Exception as e:  # noqa: BLE001 - report and keep the others
                errors[ep.name] = f"{type(e).__name__}: {e}"
                logger.warning("vllm_specplug: %s entry point %r failed to load: %s",
                               self.kind, ep.name, errors[ep.name])
        self._loaded, self._errors = found, errors
        return found

    def names(self) -> list[str]:
        return sorted(self._load())

    def get(self, name: str) -> type:
        return self._load()[name]

    def errors(self) -> dict[str, str]:
        """Entry points that failed to load (or were ignored), by name."""
        self._load()
        return dict(self._errors)


PROPOSERS = PluginRegistry(PROPOSER_GROUP, "proposer", Proposer, BUILTIN_PROPOSERS)


def proposer_names() -> list[str]:
    return PROPOSERS.names()


def get_proposer_class(method: str) -> type[Proposer]:
    return PROPOSERS.get(method)


def load_errors() -> dict[str, str]:
    return PROPOSERS.errors()
