"""The proposer interface: context in, draft (chain or tree) out.

Proposers are plain algorithms. They never import vLLM; the adapter
(``vllm_specplug.vllm_adapter``) feeds them committed tokens and, where the
runner provides them, the target's top-k at each verified position.

Life cycle of one request, as the adapter drives it::

    start(req_id, prompt_and_committed_ids, info)   # also after a preemption
    loop:
        draft = propose(req_id, budget)       # chain or tree, <= budget nodes
        ... target verifies ...
        observe(req_id, committed_ids, target_topk)
    finish(req_id)                            # finished, aborted or preempted
"""
from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Hashable, Sequence

import numpy as np

from ..draft import Draft  # noqa: F401 - re-exported: part of the proposer contract
from ..options import Option


@dataclass(frozen=True)
class OutputEnd:
    """Where vLLM ends a request's output, as far as a worker can tell: the
    tokens past it were committed by a verify step (accepted draft tokens
    after the stop) but never reached the user, so nothing past it may enter
    cross-request memory. The output ends after the first of
    ``stop_token_ids`` (the EOS token unless ignored, and the request's stop
    tokens: vLLM's scheduler stops there and drops the rest of the step) and
    at ``max_tokens``. ``unknown``: the request has stop strings (vLLM's
    front end matches them in the detokenized text, cuts the output there
    and aborts the request a step or more later; the worker never learns
    where) or a rule the worker does not replay (repetition detection):
    none of its output is known to have reached the user."""

    stop_token_ids: frozenset = frozenset()
    max_tokens: int | None = None
    unknown: bool = False

    @classmethod
    def of(cls, sampling_params) -> "OutputEnd | None":
        """The end of a request with vLLM's ``sampling_params`` (read by
        attribute, no vLLM import); None without them (a pooling request)."""
        if sampling_params is None:
            return None
        get = lambda name: getattr(sampling_params, name, None)  # noqa: E731
        if get("stop") or get("repetition_detection") is not None:
            return cls(unknown=True)
        ids = set(get("stop_token_ids") or ())
        if get("eos_token_id") is not None:   # None when ignore_eos
            ids.add(int(get("eos_token_id")))
        max_tokens = get("max_tokens")
        return cls(frozenset(int(t) for t in ids),
                   None if max_tokens is None else int(max_tokens))

    def received(self, output: Sequence[int]) -> int:
        """How many of ``output`` (the request's output tokens, in order)
        reached the user."""
        if self.unknown:
            return 0
        n = len(output) if self.max_tokens is None else min(len(output), self.max_tokens)
        if self.stop_token_ids and n:
            hits = np.flatnonzero(np.isin(np.asarray(output[:n]), list(self.stop_token_ids)))
            if hits.size:
                return int(hits[0]) + 1
        return n


@dataclass(frozen=True)
class RequestInfo:
    """What the adapter knows of a request besides its tokens, given to
    ``Proposer.start`` (docs/security.md).

    ``tenant`` says which cross-request memory (``sam``'s global store,
    Token Recycling's adjacency) the request may read and feed: requests with
    equal keys share one partition; None: the request shares nothing (it
    drafts from its own tokens and the operator's static files only). The
    adapter makes it from the request's ``cache_salt`` and LoRA adapter
    (``isolation``: "salt"), or () for all (``isolation``: "none"), or None
    (``isolation``: "request", or the request's own opt-out). () is the
    partition of requests without a salt or adapter, and of proposers driven
    without the adapter. ``num_prompt_tokens``: how many of ``start``'s
    tokens are the prompt (None: unknown). ``output_end``: where the output
    the user receives ends (None: unknown, all of it)."""

    tenant: Hashable | None = ()
    num_prompt_tokens: int | None = None
    output_end: OutputEnd | None = None


#: The default ``start`` info: the shared partition, prompt length unknown.
SHARED = RequestInfo()


@functools.lru_cache(maxsize=256)
def _takes_info(start) -> bool:
    return "info" in inspect.signature(start).parameters


def start_request(proposer: "Proposer", req_id: str, token_ids: Sequence[int],
                  info: RequestInfo = SHARED) -> None:
    """``proposer.start`` with ``info`` when its ``start`` takes it (proposers
    written before ``info`` existed take two arguments and keep working)."""
    start = proposer.start
    if _takes_info(getattr(start, "__func__", start)):
        proposer.start(req_id, token_ids, info=info)
    else:
        proposer.start(req_id, token_ids)


@dataclass(frozen=True)
class TargetTopK:
    """The target's top-k next tokens at each position it scored in one step.

    ``input_ids[i]`` is the token fed at position i (so row i predicts what
    follows it); ``token_ids``/``logprobs`` are ``[n, k]`` sorted by logprob.
    """

    input_ids: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray


class Proposer(ABC):
    """One speculative method. Subclasses are registered by name."""

    #: The ``method`` name users put in ``--speculative-config``.
    name: ClassVar[str]
    #: Plugin keys this proposer accepts (passed to ``__init__`` as keywords,
    #: with ``num_speculative_tokens``).
    options: ClassVar[tuple[Option, ...]] = ()
    #: Whether drafts may be trees (needs tree verification in the runner).
    drafts_trees: ClassVar[bool] = False
    #: Whether ``observe`` wants the target's per-position top-k.
    wants_target_topk: ClassVar[bool] = False
    #: Most nodes when ``num_speculative_tokens`` is ``"auto"`` (0: "auto" is
    #: not supported); the proposer then gets ``auto_budget=True`` and sizes
    #: each draft from ``relative_token_cost``.
    auto_budget_max: ClassVar[int] = 0
    #: Whether the method may run with tensor parallelism (verified there);
    #: False: refused at engine config when tensor_parallel_size > 1.
    supports_tensor_parallel: ClassVar[bool] = True
    #: ``num_speculative_tokens`` when the user gives none.
    default_num_speculative_tokens: ClassVar[int | str] = 8
    #: Cost of verifying one more token relative to the current step's cost,
    #: measured on this engine and set by the adapter before each step
    #: (``vllm_specplug.budget``).
    relative_token_cost: float = 0.08
    #: How many of the target's top tokens per position ``observe`` wants
    #: (read by the adapter once, after ``__init__``, when
    #: ``wants_target_topk``; 0: none). Set it in ``__init__``.
    target_topk_k: int = 0
    #: Whether the method drafts with a model of its own whose folder the user
    #: gives as ``speculative_config["model"]`` (vLLM's draft-model key),
    #: passed to ``__init__`` as the option ``model`` (e.g. eagle2's head).
    takes_model_path: ClassVar[bool] = False
    #: ``"module:function"`` of an adapter factory, for methods that draft
    #: through the target model itself (del: its first layers; eagle2: its
    #: hidden states). None: the proposer never sees the target. When set,
    #: the adapter calls ``function(drafter, target_model)`` once the target
    #: is loaded and hands the returned :class:`TargetHook` to ``bind_target``.
    target_hook: ClassVar[str | None] = None

    @classmethod
    def check_options(cls, num_speculative_tokens: int, options: dict) -> None:
        """Validate the options together (files they name included) before the
        engine starts; raise ``SpecPlugConfigError`` saying what to change."""

    @classmethod
    def check_model(cls, options: dict, tokenizer: str) -> None:
        """Validate the options against the target model before the engine
        starts (e.g. files built with its tokenizer); ``tokenizer`` is the
        model's tokenizer folder or name. Raise ``SpecPlugConfigError``."""

    @abstractmethod
    def start(self, req_id: str, token_ids: Sequence[int],
              info: RequestInfo = SHARED) -> None:
        """Begin (or rebuild) a request's state from all its tokens so far.
        ``info`` (optional in subclasses: the adapter passes it only to a
        ``start`` that takes it) says which cross-request memory the request
        may use; a proposer that keeps text across requests must keep it
        apart by ``info.tenant`` (docs/security.md)."""

    @abstractmethod
    def observe(self, req_id: str, committed_ids: Sequence[int],
                target_topk: TargetTopK | None = None) -> None:
        """Tokens committed in the last step (accepted drafts, then the bonus)."""

    @abstractmethod
    def propose(self, req_id: str, budget: int) -> Draft:
        """A draft of at most ``budget`` nodes (empty: no speculation)."""

    def draft_cut(self, req_id: str, kept: Draft) -> None:
        """Only ``kept`` (a prefix of a chain, an ancestor-closed subset of a
        tree) of the last draft is verified: the adapter's batch-aware budget
        cut the rest. Proposers that learn from their drafts' acceptance must
        not count the dropped nodes as rejected."""

    def complete(self, req_id: str) -> None:
        """The request finished or was aborted (not preempted): what it committed
        is final. Called once, just before ``finish``; a proposer that learns
        across requests (``sam``'s global store) takes its tokens here. Also
        called, with no ``finish`` after it, for a request aborted while
        preempted (its state already freed): drop anything kept for it."""

    @abstractmethod
    def finish(self, req_id: str) -> None:
        """Free a request's state (finished, aborted or preempted)."""

    @abstractmethod
    def active_requests(self) -> int:
        """Number of requests with state held."""

    def state_nbytes(self) -> int:
        """Approximate bytes of per-request state held (0 if unknown)."""
        return 0

    def structure_sizes(self) -> dict[str, int]:
        """Entries held by each structure that grows with traffic (each has a
        bound: docs/architecture.md, "Bounds"), reported as
        ``SpecPlugDrafter.stats()["sizes"]``; empty by default."""
        return {}

    def bind_target(self, hook: "TargetHook") -> None:
        """Receive the object built by ``target_hook`` (called once, at engine
        start, only when ``target_hook`` is set)."""
        raise NotImplementedError(
            f"{type(self).__name__} sets target_hook = {self.target_hook!r} but does not "
            f"implement bind_target")

    def debug_stats(self) -> dict:
        """Counters for tests and benchmarks (JSON-serialisable), reported as
        ``SpecPlugDrafter.stats()["proposer"]``; empty by default."""
        return {}


class TargetHook:
    """What a ``Proposer.target_hook`` factory returns: the adapter-side
    object through which a proposer drafts with the target (implemented in
    ``vllm_specplug.vllm_adapter``; each method's own interface, e.g.
    ``proposers.eagle2.EagleDraftHook``, adds the drafting calls). The adapter
    itself reads only what is declared here."""

    #: Target layers whose hidden states the hook needs besides the final
    #: ones (an EAGLE-3 head's fused layers); None: none. The adapter makes
    #: the target return them when the hook is bound.
    aux_layers: tuple[int, ...] | None = None

    def begin_step(self, runner, hidden_states, sampled_token_ids, req_ids,
                   scheduler_output, aux_hidden_states=None) -> None:
        """Called before each step's drafts with the target's outputs of the
        step just verified (``runner`` is vLLM's model runner; tensors stay
        opaque here). Default: nothing to keep."""
