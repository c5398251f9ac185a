"""What the worker patches (``tree_runtime``, ``sample``) read from our drafter.

:class:`~.drafter.SpecPlugDrafter` derives from :class:`DrafterState`. The tree
runtime recognises our drafter with ``isinstance(runner.drafter,
DrafterState)`` through this small module, so it never imports ``drafter.py``
(which reads the tree runtime's counts for its stats): no import cycle.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from ...proposers.base import Draft, TargetTopK
from .step_state import StepTrees


class DrafterState:
    """The drafter's per-step state that vLLM's runner patches read."""

    #: req_id -> the tree drafted last (chains are not stored); a scheduled
    #: draft is verified as a tree only if its tokens are a prefix of it (a
    #: view of the drafter's request records: ``request_state.Trees``)
    trees: MutableMapping[str, Draft]
    #: whether chains are verified on the tree path too (a non-default
    #: acceptance rule: ``scorer`` is set)
    route_chains: bool
    #: the acceptance rule for temperature > 0 (None: lossless rejection sampling)
    scorer: Any
    #: how many of the target's top tokens per verified position the proposer
    #: wants (0: none); the ``_sample`` patch fills ``pending_topk``
    target_topk_k: int
    #: req_id -> TargetTopK of the step just verified, consumed by the next propose()
    pending_topk: dict[str, TargetTopK]
    #: this engine's tree step state (requests, attention arguments, accepted
    #: paths, counters), bound to the model's attention layers at load
    step: StepTrees
    #: the faults contained (``vllm_specplug.faults.Containment``)
    containment: Any

    def verify_fault(self, req_id: str, site: str, error: BaseException) -> None:
        """Verifying ``req_id``'s draft raised at ``site`` (``tree_logits``,
        ``tree_scorer``, ``seeded_replay``): contained as a proposer fault is
        (the drafter's ``_request_fault``: counted under ``site``, logged once
        with the traceback, the request decodes without drafts from now on and
        its proposer state is freed). The caller gives the row plain
        decoding's token for this step."""
        self._hook = site
        self._request_fault(req_id, error)
