"""Expose the drafter's per-request state size while serving.

Set ``VLLM_SPECPLUG_STATS_FILE=/path/stats.json`` in the environment of
``vllm serve`` (or of any process that starts an engine). The process that
hosts our drafter (vLLM's engine core or its worker) then writes the
drafter's ``stats()`` there as one JSON object:

* at most once per ``VLLM_SPECPLUG_STATS_INTERVAL`` seconds (default 1) after
  a drafting step, and
* whenever a request's state is freed and no request holds state any more,
  so an idle server always shows its final state (``active_requests`` 0,
  ``state_bytes`` 0 when nothing leaks).

Besides ``stats()`` (``active_requests``, ``state_bytes``, ``errors``,
``faults`` (proposer faults contained: docs/architecture.md, "Faults"),
``trees_held``, step-cost fit, proposer counters) the object has ``pid``
(the process holding the drafter: watch its memory), ``rank`` (tensor-parallel
rank), ``time`` (Unix seconds) and ``writes`` (a counter). The file is
replaced atomically (written aside, then renamed), so a reader never sees a
partial object. Under tensor parallelism each rank writes: rank 0 to the path
as given, rank N to ``PATH.rankN``; ``{pid}`` in the path is replaced by the
process id. Unset (the default), this costs one attribute lookup per step.

Nothing here may break serving: a failed write is logged once and exporting
stops for that process.
"""
from __future__ import annotations

import json
import logging
import os
import time
import weakref
from typing import Any

from ...stats_files import read  # noqa: F401 - re-exported (readers: stats_files)

logger = logging.getLogger("vllm_specplug")

ENV_FILE = "VLLM_SPECPLUG_STATS_FILE"
ENV_INTERVAL = "VLLM_SPECPLUG_STATS_INTERVAL"


class _Exporter:
    def __init__(self, path: str, interval: float) -> None:
        self.path = path.replace("{pid}", str(os.getpid()))
        self.interval = interval
        self.last = float("-inf")  # the first step always writes (monotonic time can be small)
        self.writes = 0
        self.rank = 0
        self.rank_resolved = False

    def _resolve_rank(self, drafter: Any) -> None:
        # the drafter's _tp: None (one rank), True (tensor parallel, group not
        # looked up yet: write as rank 0 for now) or the group
        tp = drafter._tp
        if tp is True:
            return
        self.rank_resolved = True
        self.rank = int(tp.rank_in_group) if tp is not None else 0
        if self.rank > 0:
            self.path = f"{self.path}.rank{self.rank}"

    def write(self, drafter: Any) -> None:
        if not self.rank_resolved:
            self._resolve_rank(drafter)
        self.writes += 1
        obj = {"pid": os.getpid(), "rank": self.rank, "time": time.time(),
               "writes": self.writes, "method": drafter.method,
               **drafter.stats()}
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(obj, f, default=str)
        os.replace(tmp, self.path)


# drafter -> its exporter, or None when exporting is off for it
_EXPORTERS: "weakref.WeakKeyDictionary[Any, _Exporter | None]" = weakref.WeakKeyDictionary()


def _exporter(drafter: Any) -> "_Exporter | None":
    try:
        return _EXPORTERS[drafter]
    except KeyError:
        pass
    path = os.environ.get(ENV_FILE)
    exp = None
    if path:
        try:
            interval = float(os.environ.get(ENV_INTERVAL, "1"))
        except ValueError:
            logger.warning("vllm_specplug: %s=%r is not a number; using 1 s", ENV_INTERVAL,
                           os.environ.get(ENV_INTERVAL))
            interval = 1.0
        exp = _Exporter(path, max(0.0, interval))
    _EXPORTERS[drafter] = exp
    return exp


def maybe_write(drafter: Any, freed: bool = False) -> None:
    """Drafter hook: after a step (``freed=False``) or after freeing a
    request's state (``freed=True``). Writes when the interval has passed, or
    on a free that leaves no request with state."""
    exp = _exporter(drafter)
    if exp is None:
        return
    try:
        now = time.monotonic()
        if now - exp.last >= exp.interval or (
                freed and drafter.proposer.active_requests() == 0):
            exp.last = now
            exp.write(drafter)
    except Exception as e:  # noqa: BLE001 - never let stats break serving
        logger.warning("vllm_specplug: cannot write the drafter stats to %s (%s); "
                       "stats export stops", exp.path, e)
        _EXPORTERS[drafter] = None
