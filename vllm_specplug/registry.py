"""Proposers by method name: built-ins plus the ``vllm_specplug.proposers`` entry points.

A broken third-party entry point is reported (name and error) and skipped;
it never stops the others from loading.
"""
from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points

from .proposers.base import Proposer

logger = logging.getLogger("vllm_specplug")

PROPOSER_GROUP = "vllm_specplug.proposers"

BUILTIN_PROPOSERS: dict[str, str] = {
    "sam": "vllm_specplug.proposers.sam:SamProposer",
    "token_recycling": "vllm_specplug.proposers.token_recycling:TokenRecyclingProposer",
    "sam_tr": "vllm_specplug.proposers.hybrid:SamTokenRecyclingProposer",
    # For tests of tree verification, not for speed:
    "debug_oracle_tree": "vllm_specplug.proposers.testing:OracleTreeProposer",
    "debug_random_tree": "vllm_specplug.proposers.testing:RandomTreeProposer",
}

_loaded: dict[str, type[Proposer]] | None = None
_errors: dict[str, str] = {}


def _import(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _load() -> dict[str, type[Proposer]]:
    global _loaded
    if _loaded is not None:
        return _loaded
    found: dict[str, type[Proposer]] = {}
    for name, path in BUILTIN_PROPOSERS.items():
        found[name] = _import(path)
    for ep in entry_points(group=PROPOSER_GROUP):
        if ep.name in found:
            _errors[ep.name] = (f"entry point {ep.value!r} ignored: the name is taken "
                                f"by a built-in proposer")
            continue
        try:
            cls = ep.load()
            if not (isinstance(cls, type) and issubclass(cls, Proposer)):
                raise TypeError(f"{ep.value} is not a vllm_specplug Proposer subclass")
            found[ep.name] = cls
        except Exception as e:  # noqa: BLE001 - report and keep the others
            _errors[ep.name] = f"{type(e).__name__}: {e}"
            logger.warning("vllm_specplug: proposer entry point %r failed to load: %s",
                           ep.name, _errors[ep.name])
    _loaded = found
    return found


def proposer_names() -> list[str]:
    return sorted(_load())


def get_proposer_class(method: str) -> type[Proposer]:
    return _load()[method]


def load_errors() -> dict[str, str]:
    _load()
    return dict(_errors)
