"""Warm-up: compile (or load from numba's cache) every kernel a method's
requests will call, while the engine starts, so no request pays for it.

The drafter calls :func:`warm_up` when vLLM builds it (worker start, before
the model loads). It builds a throwaway twin of the configured proposer (the
same options, except that it writes no file and keeps a small global store)
and drives it through a few short fake requests, as the adapter drives the
real one: start, propose, observe, complete, finish. The twin's requests
reach the same code with arguments of the same types as real requests, so
numba compiles the same specializations: the global store's insertion (a
finished request's output, added when the next request starts), its
matching and continuation, and the static corpus automaton's matching. The
real proposer's state (store, acceptance tables, Token Recycling matrix) is
untouched. A proposer that drives the target (``target_hook``: eagle2,
sam_eagle2, del) cannot run without the engine's model; only its SAM part is
driven (sam_eagle2).

Measured with an empty numba cache (docs/architecture.md, "Cold start"):
compiling the global store's kernels takes a few seconds on a CPU core,
which without this landed on the second request a fresh engine served. No
vLLM, no torch.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Mapping

import numpy as np

logger = logging.getLogger("vllm_specplug")

# Fake requests: a prompt that repeats itself (the request's own automaton
# matches), then outputs that the next request's prompt continues (the
# global store matches, and drafts from it).
_PROMPT = [11, 12, 13, 14, 11, 12, 13, 15, 11, 12]
_OUTPUT = [21, 22, 23, 24, 25, 26]
_STEPS = 4
_REQUESTS = 3
_TOPK_ROWS = 8

# Options the twin must not share with the real proposer: it writes no file,
# reads no warm-start matrix, and keeps the smallest global store.
_NO_FILES = ("tr_save_matrix", "tr_matrix")


def enabled() -> bool:
    """False when ``VLLM_SPECPLUG_WARMUP=0`` turns the engine-start warm-ups
    off (this one and the adapter's, e.g. ``vllm_adapter.v1.cpu_warmup``)."""
    return os.environ.get("VLLM_SPECPLUG_WARMUP", "1") != "0"


def twin_plugin(plugin: Mapping[str, Any]) -> dict:
    """The plugin config of the throwaway twin (``config.translate``'s form)."""
    from .proposers.sam import MIN_GLOBAL_TOKENS

    options = dict(plugin["options"])
    for key in _NO_FILES:
        if key in options:
            options[key] = ""
    if options.get("sam_global_tokens"):
        options["sam_global_tokens"] = MIN_GLOBAL_TOKENS
    return {**plugin, "options": options}


def driven_part(proposer):
    """What of ``proposer`` can be driven without the engine: itself, or the
    SAM part of a proposer that drives the target (None: nothing)."""
    from .proposers.sam import SamProposer

    if not type(proposer).target_hook:
        return proposer
    sam = getattr(proposer, "sam", None)   # our own hybrids (sam_eagle2)
    return sam if isinstance(sam, SamProposer) else None


def exercise(proposer, budget: int) -> None:
    """Drive ``proposer`` through ``_REQUESTS`` short fake requests, one after
    another, each ``_STEPS`` steps (every draft's first token accepted)."""
    from .proposers.base import TargetTopK

    for r in range(_REQUESTS):
        req_id = f"specplug-warmup-{r}"
        context = _PROMPT + _OUTPUT[: 2 + r]
        proposer.start(req_id, context)
        for step in range(_STEPS):
            draft = proposer.propose(req_id, budget)
            nxt = _OUTPUT[(2 + r + step) % len(_OUTPUT)]
            committed = [int(t) for t in draft.tokens[:1]] + [nxt]
            topk = None
            if proposer.wants_target_topk:
                rows = [context[-1]] + committed[:-1]
                k = max(int(proposer.target_topk_k), 1)
                ids = np.array([[(t + j) % 64 + 1 for j in range(k)] for t in rows],
                               dtype=np.int64)
                topk = TargetTopK(np.asarray(rows, dtype=np.int64), ids,
                                  np.zeros(ids.shape, dtype=np.float32))
            proposer.observe(req_id, committed, topk)
            context += committed
        proposer.complete(req_id)
        proposer.finish(req_id)


def warm_up(plugin: Mapping[str, Any]) -> float | None:
    """Drive a twin of the proposer ``plugin`` describes (see the module
    doc); returns the seconds it took, or None when nothing was driven (or
    ``VLLM_SPECPLUG_WARMUP=0`` turned the warm-up off). A failure is logged, never raised: it costs the first requests' latency,
    not the engine."""
    from .config import build_proposer

    if not enabled():
        return None
    started = time.perf_counter()
    try:
        part = driven_part(build_proposer(twin_plugin(plugin)))
        if part is None:
            return None
        exercise(part, int(plugin["num_speculative_tokens"]))
    except Exception:  # noqa: BLE001 - a warm-up failure must not stop the engine
        logger.warning("vllm_specplug: warm-up of %s failed; its first requests may compile "
                       "kernels", plugin["method"], exc_info=True)
        return None
    seconds = time.perf_counter() - started
    logger.info("vllm_specplug: %s warmed up in %.2f s", plugin["method"], seconds)
    return seconds
