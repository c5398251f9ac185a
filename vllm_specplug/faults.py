"""Fault containment's bookkeeping, and fault injection to test it.

The adapter contains every exception a proposer raises (docs/architecture.md,
"Faults"): the request decodes without drafts from then on, the engine and
the other requests go on. This module lets tests (and operators checking a
deployment) make a hook raise on purpose, in every process that builds a
drafter, through the environment::

    VLLM_SPECPLUG_INJECT_FAULT="sam:propose:3,sam:store_add:1"

Each entry is ``METHOD:HOOK:N``: in a drafter of ``METHOD`` (``*``: any
method), the N-th call (from 1, counted per drafter) of ``HOOK`` raises
:class:`InjectedFault`, once. Hooks:

* proposer calls: ``start``, ``observe``, ``propose``, ``draft_cut``,
  ``complete``, ``finish``;
* inside a proposer: ``store_add`` (an insertion into ``sam``'s global store,
  any tenant's, also inside ``sam_tr``), ``corpus_match`` (advancing a
  request's match in a static ``sam_corpus`` automaton);
* steps shared by the batch: ``step_cost`` (the step timing and cost fit),
  ``budget`` (the batch-aware budget), ``target_begin_step`` (a target
  hook's per-step features: ``eagle2``, ``del``).

Unset (the default), nothing is wrapped. :class:`Containment` is what an
adapter keeps of the faults it contained (counts, the requests that lost
their drafts, the log lines). Plain Python, no vLLM import.
"""
from __future__ import annotations

import logging
import math
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from .options import SpecPlugConfigError

logger = logging.getLogger("vllm_specplug")

ENV = "VLLM_SPECPLUG_INJECT_FAULT"
PROPOSER_HOOKS = ("start", "observe", "propose", "draft_cut", "complete", "finish")
INNER_HOOKS = ("store_add", "corpus_match")
SHARED_HOOKS = ("step_cost", "budget", "target_begin_step")
HOOKS = PROPOSER_HOOKS + INNER_HOOKS + SHARED_HOOKS


class InjectedFault(RuntimeError):
    """Raised by a hook that ``VLLM_SPECPLUG_INJECT_FAULT`` armed."""


@dataclass(frozen=True)
class FaultSpec:
    method: str
    hook: str
    call: int


def parse(text: str) -> list[FaultSpec]:
    """The entries of a ``VLLM_SPECPLUG_INJECT_FAULT`` value; a bad entry
    raises ``SpecPlugConfigError`` saying what to change."""
    out = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        parts = entry.split(":")
        if len(parts) != 3 or parts[1] not in HOOKS or not parts[2].isdigit() \
                or int(parts[2]) < 1 or not parts[0]:
            raise SpecPlugConfigError(
                f"{ENV}: bad entry {entry!r}; write METHOD:HOOK:N (METHOD a method name or "
                f"'*', HOOK one of {', '.join(HOOKS)}, N the call that raises, from 1), "
                f"entries separated by commas, or unset {ENV}")
        out.append(FaultSpec(parts[0], parts[1], int(parts[2])))
    return out


def check_env() -> None:
    """Refuse a bad ``VLLM_SPECPLUG_INJECT_FAULT`` before the engine starts."""
    parse(os.environ.get(ENV, ""))


class Injector:
    """Counts each hook's calls and raises at the armed ones."""

    def __init__(self, specs: list[FaultSpec]) -> None:
        self.armed = {(s.hook, s.call) for s in specs}
        self.hooks = {s.hook for s in specs}
        self.calls: Counter = Counter()
        self.raised: Counter = Counter()

    def hit(self, hook: str) -> None:
        if hook not in self.hooks:
            return
        self.calls[hook] += 1
        if (hook, self.calls[hook]) in self.armed:
            self.raised[hook] += 1
            raise InjectedFault(f"injected fault: call {self.calls[hook]} of {hook} ({ENV})")

    def wrap(self, obj: Any, name: str, hook: str) -> None:
        """Make ``obj.name`` (a method) pass through ``hit(hook)`` first (an
        instance attribute: the class and other instances are untouched)."""
        if hook not in self.hooks:
            return
        original: Callable = getattr(obj, name)

        def wrapped(*args, **kwargs):
            self.hit(hook)
            return original(*args, **kwargs)

        setattr(obj, name, wrapped)

    def arm_proposer(self, proposer: Any) -> None:
        """The proposer's hooks, and the stores and corpora of it and of the
        proposers it holds (``sam_tr``'s SAM part)."""
        for hook in PROPOSER_HOOKS:
            self.wrap(proposer, hook, hook)
        from .proposers.tenants import TenantStores

        for part in _parts(proposer):
            stores = getattr(part, "stores", None)
            if isinstance(stores, TenantStores) and "store_add" in self.hooks:
                self.arm_stores(stores)
            corpora = getattr(part, "corpora", None)
            if corpora and "corpus_match" in self.hooks:
                # corpus automata are shared by every proposer of the process:
                # each is wrapped in a proxy, never patched
                part.corpora = [_CorpusProxy(c, self) for c in corpora]

    def arm_stores(self, stores: Any) -> None:
        """``store_add`` in every tenant's global store (``sam``'s
        ``tenants.TenantStores``): those held now and those made later (the
        partitions' factory wraps each new store), salted tenants' included."""
        for _, store in stores.items():
            self.wrap(store, "add", "store_add")
        factory = stores.factory

        def made():
            store = factory()
            self.wrap(store, "add", "store_add")
            return store

        stores.factory = made

    def arm_target_hook(self, hook: Any) -> None:
        self.wrap(hook, "begin_step", "target_begin_step")


def _parts(proposer: Any) -> list[Any]:
    """The proposer and the proposers among its attributes, recursively."""
    from .proposers.base import Proposer

    out, todo = [], [proposer]
    while todo:
        p = todo.pop()
        if any(p is q for q in out):
            continue
        out.append(p)
        todo += [v for v in vars(p).values() if isinstance(v, Proposer)]
    return out


class _CorpusProxy:
    """A static corpus automaton whose ``advance_many`` goes through the injector."""

    def __init__(self, corpus: Any, injector: Injector) -> None:
        self._corpus = corpus
        self._injector = injector

    def advance_many(self, *args, **kwargs):
        self._injector.hit("corpus_match")
        return self._corpus.advance_many(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._corpus, name)


# ------------------------------------------------------------- containment
#: Requests that faulted and decode without drafts, remembered until they
#: finish; past this many (requests never reported finished) the oldest go.
MAX_FAULTED_REQUESTS = 1 << 16


class Containment:
    """What an adapter keeps of the faults it contained (docs/architecture.md,
    "Faults"); the adapter frees the request's state itself. Counts:
    ``errors`` (every fault), ``requests`` (requests that lost their drafts),
    ``steps`` (shared steps that fell back to no drafts), ``hooks`` (faults
    by hook or site)."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.errors = self.requests = self.steps = 0
        self.hooks: Counter = Counter()
        # req_id -> None: requests decoding without drafts after a fault
        self.faulted: dict[str, None] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.faulted

    def request_fault(self, req_id: str, hook: str, error: BaseException,
                      finished: bool = False) -> None:
        """``hook`` raised for ``req_id``: counted, logged once with the
        traceback; the request draft nothing more (``finished``: it just
        finished, nothing to remember)."""
        self.errors += 1
        self.requests += 1
        self.hooks[hook] += 1
        logger.error("vllm_specplug: %s raised in %s for request %s; %s (its output is "
                     "unchanged)", self.method, hook, req_id,
                     "it had finished" if finished else
                     "the request decodes without drafts from now on", exc_info=error)
        if not finished:
            self.faulted[req_id] = None
            if len(self.faulted) > MAX_FAULTED_REQUESTS:
                del self.faulted[next(iter(self.faulted))]

    def finished(self, req_id: str) -> bool:
        """The request finished: forgotten; True when it had faulted."""
        return self.faulted.pop(req_id, 0) is None

    def shared_fault(self, site: str, error: BaseException) -> None:
        """A part of the step shared by the batch raised (no drafts this
        step): counted, logged with the traceback the first time, then at
        every power of ten of its count."""
        self.errors += 1
        self.steps += 1
        self.hooks[site] += 1
        n = self.hooks[site]
        if n == 1 or math.log10(n).is_integer():
            logger.error("vllm_specplug: %s's %s raised (%d times so far); no drafts this "
                         "step (outputs are unchanged)", self.method, site, n,
                         exc_info=error if n == 1 else None)

    def stats(self) -> dict:
        return {"requests": self.requests, "steps": self.steps, "hooks": dict(self.hooks),
                "requests_without_drafts": len(self.faulted)}
