"""Warm-up: compile (or load from numba's cache) every kernel a method's
requests will call, while the engine starts, so no request pays for it.

The drafter calls :func:`warm_up` when vLLM builds it (worker start, before
the model loads). The plugin's numba kernels belong to SAM (the global
store, the static corpus automaton), so for ``sam`` and the hybrids with a
SAM part (``sam_tr``, ``sam_eagle2``) it builds a throwaway ``SamProposer``
with the method's SAM options (and the smallest global store) and drives it
through a few short fake requests, as the drafter drives the real one:
start, propose, observe, complete, finish. The twin's requests reach the
same code with arguments of the same types as real requests, so numba
compiles the same specializations: the global store's insertion (a finished
request's output, added when the next request starts), its matching and
continuation, and the static corpus automaton's matching. The real
proposer's state (store, acceptance tables) is untouched; other methods
(and third-party proposers) are not driven. The adapter warms what is its
own at ``load_model`` (``vllm_adapter.v1.cpu_warmup``: vLLM's CPU GEMM
primitives; on CUDA the Triton tree kernel, ``tree_attention_cuda``).

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

logger = logging.getLogger("vllm_specplug")

# Fake requests: a prompt that repeats itself (the request's own automaton
# matches), then outputs that the next request's prompt continues (the
# global store matches, and drafts from it).
_PROMPT = [11, 12, 13, 14, 11, 12, 13, 15, 11, 12]
_OUTPUT = [21, 22, 23, 24, 25, 26]
_STEPS = 4
_REQUESTS = 3


def enabled() -> bool:
    """False when ``VLLM_SPECPLUG_WARMUP=0`` turns the engine-start warm-ups
    off (this one and the adapter's, e.g. ``vllm_adapter.v1.cpu_warmup``)."""
    return os.environ.get("VLLM_SPECPLUG_WARMUP", "1") != "0"


def sam_twin(plugin: Mapping[str, Any]):
    """A throwaway ``SamProposer`` with the SAM options of ``plugin`` (the
    method ``sam`` or a hybrid with a SAM part: sam_tr, sam_eagle2) and the
    smallest global store; None for a method without numba kernels."""
    from .proposers.hybrid import SamHybridProposer
    from .proposers.sam import MIN_GLOBAL_TOKENS, SamProposer
    from .registry import get_proposer_class

    cls = get_proposer_class(plugin["method"])
    if not issubclass(cls, (SamProposer, SamHybridProposer)):
        return None
    names = {o.name for o in SamProposer.options}
    options = {k: v for k, v in plugin["options"].items() if k in names}
    if options.get("sam_global_tokens"):
        options["sam_global_tokens"] = MIN_GLOBAL_TOKENS
    return SamProposer(int(plugin["num_speculative_tokens"]), **options)


def exercise(proposer, budget: int) -> None:
    """Drive ``proposer`` through ``_REQUESTS`` short fake requests, one after
    another, each ``_STEPS`` steps (every draft's first token accepted), as
    the drafter drives a real one."""
    for r in range(_REQUESTS):
        req_id = f"specplug-warmup-{r}"
        context = _PROMPT + _OUTPUT[: 2 + r]
        proposer.start(req_id, context)
        for step in range(_STEPS):
            draft = proposer.propose(req_id, budget)
            committed = [int(t) for t in draft.tokens[:1]] + [
                _OUTPUT[(2 + r + step) % len(_OUTPUT)]]
            proposer.observe(req_id, committed, None)
            context += committed
        proposer.complete(req_id)
        proposer.finish(req_id)


def warm_up(plugin: Mapping[str, Any]) -> float | None:
    """Drive a twin of the proposer ``plugin`` describes (see the module
    doc); returns the seconds it took, or None when nothing was driven (or
    ``VLLM_SPECPLUG_WARMUP=0`` turned the warm-up off). A failure is logged, never raised: it costs the first requests' latency,
    not the engine."""
    if not enabled():
        return None
    started = time.perf_counter()
    try:
        twin = sam_twin(plugin)
        if twin is None:
            return None
        exercise(twin, twin.num_speculative_tokens)
    except Exception:  # noqa: BLE001 - a warm-up failure must not stop the engine
        logger.warning("vllm_specplug: warm-up of %s failed; its first requests may compile "
                       "kernels", plugin["method"], exc_info=True)
        return None
    seconds = time.perf_counter() - started
    logger.info("vllm_specplug: %s warmed up in %.2f s", plugin["method"], seconds)
    return seconds
