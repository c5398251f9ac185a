"""The V1 drafter's state: one record per request (``SpecPlugDrafter.requests``),
and what it carries from step to step (``StepBudget``).

Everything the drafter keeps for a request lives in one
:class:`RequestRecord`, held in one map (:class:`RequestRecords`), so a
request's state is freed by one operation (``requests.pop(req_id)``) and its
bound follows from the map's: one record per request vLLM has not finished.
The batch budgets' per-request entries (``budget.AcceptanceCalibration``,
``goodput.RequestBackoff``) are fields of the record too: those objects keep
only their aggregates and reach the entries through views of one field
(:class:`FieldView`),
as the tree runtime reads ``drafter.trees``. ``stats()["sizes"]`` counts the
records' fields, under the keys it always had.

Not in the record: the proposer's own per-request state (``proposers/``,
freed by its ``finish`` hook, called with the record's ``leave``), and
``pending_topk``, the target's top-k of the step just verified, handed from
the ``_sample`` patch to the next ``propose`` as a whole (one step's batch,
replaced every step).
"""
from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, Iterator, Sequence


from ...proposers.base import Draft
from .tenancy import NOT_RECORDED


@dataclass(eq=False)
class RequestRecord:
    """What the drafter keeps for one request.

    Created at the first of: the scheduler output that brings the request
    (``note_scheduler_output`` records its ``salt``), its first row in
    ``propose``. Freed, whole, when vLLM finishes or aborts it
    (``finish_request`` pops it; then the proposer completes it). In between:

    * while it runs (in the batch): the fields from ``seen`` on;
    * when it leaves the batch unfinished (preempted) or its proposer
      faults, those are dropped (``leave``, with the proposer's ``finish``)
      and the record keeps ``salt`` (used again if it resumes) and
      ``preempted`` (so its finish completes it in the proposer); a
      preempted request that resumes is started again.
    """

    #: its ``cache_salt`` as recorded from the scheduler output
    #: (``tenancy.new_request_salts``; ``NOT_RECORDED``: none seen)
    salt: Any = NOT_RECORDED
    #: it left the batch unfinished (preempted) and was freed then; at most
    #: ``MAX_PREEMPTED`` records keep it (the oldest preemption dropped first)
    preempted: bool = False
    #: (number of tokens observed, last token observed); None: not started
    seen: tuple[int, int] | None = None
    #: its own limit on draft tokens a step (``extra_args``; None: none)
    cap: int | None = None
    #: the tree drafted last (chains are not stored); a scheduled draft is
    #: verified as a tree only if its tokens are a prefix of it
    tree: Draft | None = None
    #: expected accepted tokens of its kept draft (``AcceptanceCalibration.pending``)
    expected: float | None = None
    #: its failures and mutes (``RequestBackoff``'s record)
    backoff: Any = None
    #: how deep its kept draft reached on merit and with explored nodes, and
    #: how many were explored (``budget.ExplorationYield.pending``)
    explored: tuple[int, int, int] | None = None
    #: tokens committed and decode steps since it started (its pace, for a
    #: draining batch's valuation: ``budget.DrainValuation``)
    committed: int = 0
    steps: int = 0

    def leave(self) -> None:
        """It left the batch or faulted: its running state is dropped."""
        self.seen = self.cap = self.tree = None
        self.expected = self.backoff = self.explored = None


def _holds(rec: RequestRecord, name: str) -> bool:
    if name == "salt":
        return rec.salt is not NOT_RECORDED
    value = getattr(rec, name)
    return value is True if isinstance(value, bool) else value is not None


class RequestRecords(dict):
    """req_id -> :class:`RequestRecord`, in the order requests last started
    (``started``) or were preempted (``preempt``): oldest first."""

    def record(self, req_id: str) -> RequestRecord:
        """The request's record, created if it has none."""
        rec = self.get(req_id)
        if rec is None:
            rec = self[req_id] = RequestRecord()
        return rec

    def _to_end(self, req_id: str) -> RequestRecord:
        rec = self.pop(req_id, None) or RequestRecord()
        self[req_id] = rec
        return rec

    def started(self, req_id: str, seen: tuple[int, int]) -> None:
        """``seen`` after a (re)start or an observe; a request not running
        before moves to the end (the order requests leave the batch in)."""
        rec = self.get(req_id)
        if rec is None or rec.seen is None:
            rec = self._to_end(req_id)
        rec.seen = seen

    def preempt(self, req_id: str, limit: int) -> None:
        """It left the batch unfinished; beyond ``limit`` preempted records,
        the oldest preemption is forgotten (its finish then only skips
        ``Proposer.complete``)."""
        self._to_end(req_id).preempted = True
        if self.count("preempted") > limit:
            next(r for r in self.values() if r.preempted).preempted = False

    def leave(self, req_id: str) -> None:
        """``RequestRecord.leave`` of its record, if it has one."""
        rec = self.get(req_id)
        if rec is not None:
            rec.leave()

    def running(self) -> list[str]:
        """The requests started and not freed, oldest first."""
        return self.holding("seen")

    def holding(self, name: str) -> list[str]:
        """The requests whose records hold field ``name`` (set, or True)."""
        return [r for r, rec in self.items() if _holds(rec, name)]

    def count(self, name: str) -> int:
        """How many records hold field ``name``."""
        return sum(1 for rec in self.values() if _holds(rec, name))

    def any(self, name: str) -> bool:
        return any(_holds(rec, name) for rec in self.values())


class FieldView(MutableMapping):
    """req_id -> one field of the records (None: absent); setting it creates
    the request's record. ``drafter.trees`` (``tree``, what the tree runtime
    reads), and the budgets' per-request entries."""

    __slots__ = ("_records", "_name")

    def __init__(self, records: RequestRecords, name: str) -> None:
        self._records = records
        self._name = name

    def get(self, req_id: str, default: Any = None) -> Any:
        rec = self._records.get(req_id)
        value = None if rec is None else getattr(rec, self._name)
        return default if value is None else value

    def __getitem__(self, req_id: str) -> Any:
        value = self.get(req_id)
        if value is None:
            raise KeyError(req_id)
        return value

    def __contains__(self, req_id: object) -> bool:
        return self.get(req_id) is not None

    def pop(self, req_id: str, *default: Any) -> Any:
        value = self.get(req_id)
        if value is None:
            if default:
                return default[0]
            raise KeyError(req_id)
        setattr(self._records[req_id], self._name, None)
        return value

    def __setitem__(self, req_id: str, value: Any) -> None:
        setattr(self._records.record(req_id), self._name, value)

    def __delitem__(self, req_id: str) -> None:
        self.pop(req_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self._records.holding(self._name))

    def __len__(self) -> int:
        return self._records.count(self._name)

    def __bool__(self) -> bool:
        return self._records.any(self._name)


@dataclass
class StepBudget:
    """What the drafter carries from one call to the next within a step, or
    to the next step: the batch's rows, the budgets' per-step state, and a
    shared step's fault (per request: ``RequestRecord``)."""

    #: the batch's request ids by row, from ``begin_step`` to ``propose``
    row_req_ids: Sequence[str] | None = None
    #: ``propose``'s rows, for the budgets (``_fit_to_batch``)
    req_ids: Sequence[str] = ()
    #: a shared part of this step faulted in ``begin_step``: no drafts
    fault: bool = False
    #: this step schedules nothing (``note_scheduler_output``): malloc_trim
    idle: bool = False
    #: draft nodes that may still be explored (the drafter's EXPLORE_SHARE
    #: of step time)
    explore_nodes: float = 0.0
    #: the last batch step's bar: the least a draft node had to be worth
    explore_bar: float | None = None
    #: the last all-decoding call's (request ids, drafts proposed, time),
    #: for the step cost model (``_time_step``)
    last: tuple[tuple[str, ...], int, float] | None = None
