"""The scheduler's queue, sent to the workers.

The batch budget values an accepted token differently when the batch drains
(nothing waits to take a finished request's place; ``budget.DrainValuation``)
and when it does not. Only the scheduler knows whether requests wait, and it
runs in the engine-core process, not in the workers. ``make_schedule`` (a
patch of ``Scheduler.schedule``, applied in every process, used where the
scheduler runs) writes the queue's length after the step onto the step's
``SchedulerOutput`` (attribute ``WAITING_ATTR``), which vLLM sends to every
worker; ``waiting_of`` reads it there (None where the patch did not run: the
budget then keeps its usual rule, never the draining one).
"""
from __future__ import annotations

from typing import Any

#: The attribute ``make_schedule`` adds to ``SchedulerOutput``.
WAITING_ATTR = "specplug_waiting"
#: What the patch reads on the scheduler (checked when it is applied).
COUNTS_METHOD = "get_request_counts"


def make_schedule(original):
    """``Scheduler.schedule`` that also records, on its output, how many
    requests wait (``Scheduler.get_request_counts()[1]``: the waiting queue
    and the requests holding KV while they wait)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if not callable(getattr(Scheduler, COUNTS_METHOD, None)):
        from ..patching import PatchTargetMissing
        from ..version import SUPPORTED_VLLM_VERSIONS, vllm_version

        raise PatchTargetMissing(
            f"vllm_specplug patch 'Scheduler.schedule': Scheduler.{COUNTS_METHOD} is missing "
            f"in the installed vLLM {vllm_version()}; this vllm-specplug supports vLLM "
            f"{', '.join(SUPPORTED_VLLM_VERSIONS)} (the patch sends the waiting queue's "
            f"length to the workers for the batch budget)")

    def schedule(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        _, waiting = self.get_request_counts()
        setattr(out, WAITING_ATTR, int(waiting))
        return out

    return schedule


def waiting_of(scheduler_output: Any) -> int | None:
    """The queue's length sent with this step (None: not sent)."""
    value = getattr(scheduler_output, WAITING_ATTR, None)
    return None if value is None else int(value)
