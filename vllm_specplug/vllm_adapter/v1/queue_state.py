"""Whether requests wait in the scheduler's queue, told to the workers.

The batch budget values a row's accepted draft token as one more token of
output, which holds while a waiting request takes a finished row's slot.
In a fixed batch (one ``LLM.generate`` call, the tail of any offline run)
nothing waits, the batch takes as many steps as its slowest row, and drafts
on rows that finish earlier cost more than they save (``budget.pace_batch``).
vLLM 0.32's workers do not know the queue, so ``make_schedule`` (a patch of
``Scheduler.schedule``, applied in every process, effective in the engine
core's) sets ``specplug_num_waiting`` on each ``SchedulerOutput``: the
requests still waiting after the step was scheduled
(``Scheduler.get_request_counts``). The output reaches the workers as it is
(the same object in one process, pickled with its attributes to others).
"""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("vllm_specplug")

#: The attribute ``make_schedule`` adds to ``SchedulerOutput``.
WAITING_ATTR = "specplug_num_waiting"
#: The scheduler method read for the count (checked when the patch is applied).
COUNTS_METHOD = "get_request_counts"

_warned = False


def make_schedule(original):
    """``Scheduler.schedule`` that also records how many requests wait."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from ..patching import PatchTargetMissing
    from ..version import SUPPORTED_VLLM_VERSIONS

    if not callable(Scheduler.__dict__.get(COUNTS_METHOD)):
        raise PatchTargetMissing(
            f"vllm_specplug: vllm.v1.core.sched.scheduler.Scheduler.{COUNTS_METHOD} does not "
            f"exist in the installed vLLM (the Scheduler.schedule patch reads the queue "
            f"length with it); supported vLLM releases: {', '.join(SUPPORTED_VLLM_VERSIONS)}")

    def schedule(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        setattr(out, WAITING_ATTR, int(getattr(self, COUNTS_METHOD)()[1]))
        return out

    return schedule


def waiting_of(scheduler_output: Any) -> int | None:
    """Requests waiting after this step's scheduling; None when not known:
    no scheduler output (a drafter driven without vLLM, unit tests), or a
    scheduler whose ``schedule`` is not vLLM's (a custom ``scheduler_cls``):
    logged once, and batches are then budgeted as if requests were waiting."""
    global _warned
    if scheduler_output is None:
        return None
    if not hasattr(scheduler_output, WAITING_ATTR):
        if not _warned:
            _warned = True
            logger.warning(
                "vllm_specplug: the scheduler output carries no %s (the patch of "
                "vLLM's Scheduler.schedule did not run in the scheduler's process: a "
                "custom scheduler_cls?); draft budgets assume requests are waiting",
                WAITING_ATTR)
        return None
    return int(getattr(scheduler_output, WAITING_ATTR))
