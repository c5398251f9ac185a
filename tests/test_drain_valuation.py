"""A draining batch's valuation of drafts (``budget.DrainValuation``) and the
scheduler's queue length sent to the workers (``queue_state``): no engine."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import make_vllm_config, step
from vllm_specplug.budget import (DrainValuation, allocate_batch_exploring, monotone_values,
                                  subset)
from vllm_specplug.proposers.base import Draft

C0, C_ROW, B = 0.056, 0.0034, 0.0024   # seconds: a step, a row, a draft token (measured)


def chain(values):
    return Draft.chain(np.arange(len(values)) + 100, values)


def test_values_charge_rows_ahead_only_their_own_cost():
    v = DrainValuation().values(C0, C_ROW, [48.0, 30.0, 47.0, 20.0])
    # rows 0 and 2 finish last (within 1 + 5% of 48 steps): they share c0
    assert v == pytest.approx([C_ROW + C0 / 2, C_ROW, C_ROW + C0 / 2, C_ROW])
    # rows without a bound finish last of all
    v = DrainValuation().values(C0, C_ROW, [float("inf"), 30.0])
    assert v == pytest.approx([C_ROW + C0, C_ROW])
    # every row tied: each is worth its share of the step, as in the usual rule
    v = DrainValuation().values(C0, C_ROW, [40.0] * 4)
    assert v == pytest.approx([C_ROW + C0 / 4] * 4)


def test_a_draining_batch_cuts_mediocre_drafts_of_rows_ahead_only():
    rows = 13
    a = C0 + C_ROW * rows - B * rows
    drafts = [chain([0.4, 0.3]), chain([0.4, 0.3])] + [Draft.empty()] * (rows - 2)
    usual, _ = allocate_batch_exploring(drafts, a, B, rows)
    assert [len(d) for d in usual[:2]] == [1, 1]   # 0.4 beats the share's bar (0.31)
    values = DrainValuation().values(C0, C_ROW, [20.0, 48.0] + [30.0] * (rows - 2))
    drain, _ = allocate_batch_exploring(drafts, a, B, rows, row_values=values)
    # row 0 is ahead: a token saves 3.4 ms, a 0.4 node is worth 1.4 ms < 2.4 ms;
    # row 1 finishes last: both nodes pay
    assert [len(d) for d in drain[:2]] == [0, 2]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=4), min_size=1, max_size=3),
       st.lists(st.floats(0.0005, 0.06), min_size=3, max_size=3), st.floats(0.001, 0.01))
def test_drain_allocation_reaches_the_brute_force_optimum(rows_values, worth, b):
    """With row values, the kept prefixes maximise the seconds saved minus
    the verification's cost, over every combination of prefixes."""
    drafts = [chain(monotone_values(np.asarray(v), None)) for v in rows_values]
    worth = worth[: len(drafts)]
    got, _ = allocate_batch_exploring(drafts, 1.0, b, len(drafts), row_values=worth)

    def saved(kept):
        return sum(w * float(np.sum(d.scores)) - b * len(d)
                   for d, w in zip(kept, worth) if len(d))

    for d, g in zip(drafts, got):
        assert g.tokens.tolist() == d.tokens[: len(g)].tolist()
    best = max(saved([subset(d, np.arange(len(d)) < n) if n else Draft.empty()
                      for d, n in zip(drafts, ns)])
               for ns in itertools.product(*[range(len(d) + 1) for d in drafts]))
    assert saved(got) >= best - 1e-9


def test_a_fixed_batch_drains_and_a_refilled_one_does_not():
    fixed = DrainValuation()
    fixed.note_step(0, 4, 0, 0)                 # four requests into an empty engine
    assert fixed.draining                       # nothing waits, no refill seen yet
    fixed.note_step(0, 0, 1, 3)                 # one finishes, three run on
    for _ in range(DrainValuation.WINDOW + 1):
        fixed.note_step(0, 0, 0, 3)
    assert fixed.expired == 1 and fixed.refills == 0 and fixed.draining
    fixed.note_step(0, 0, 1, 2)                 # one more finishes, two run on
    assert len(fixed.open) == 1
    fixed.note_step(0, 0, 2, 0)                 # the rest finish: the engine is empty
    assert fixed.expired == 2 and not fixed.open    # that finish was not refilled
    # the next batch, submitted one request at a time: its first request
    # starts alone and the rest join a step later; no refill
    fixed.note_step(0, 1, 0, 0)
    fixed.note_step(0, 3, 0, 1)
    assert fixed.refills == 0 and fixed.draining

    served = DrainValuation()
    served.note_step(0, 2, 0, 0)
    served.note_step(0, 0, 1, 1)                # a client's request finishes
    served.note_step(0, 0, 0, 1)
    served.note_step(0, 1, 0, 1)                # and its next one arrives
    assert served.refills == 1 and served.refill > 0.5 and not served.draining
    assert served.stats()["refills"] == 1


def test_a_queue_or_an_unknown_queue_never_drains():
    v = DrainValuation()
    v.note_step(3, 4, 0, 0)
    assert not v.draining                       # requests wait for a slot
    v.note_step(None, 0, 0, 4)
    assert not v.draining                       # the scheduler did not say
    # arrivals from the queue (it was not empty) are no refill from outside
    q = DrainValuation()
    q.note_step(2, 4, 0, 0)
    q.note_step(1, 1, 1, 3)
    q.note_step(0, 1, 1, 3)
    assert q.refills == 0


def test_schedule_patch_sends_the_queue_length():
    from vllm_specplug.vllm_adapter.v1.queue_state import (WAITING_ATTR, make_schedule,
                                                           waiting_of)

    out = SimpleNamespace()
    patched = make_schedule(lambda self, *a, **k: out)
    sched = SimpleNamespace(get_request_counts=lambda: (5, 7))
    assert patched(sched) is out and getattr(out, WAITING_ATTR) == 7
    assert waiting_of(out) == 7 and waiting_of(SimpleNamespace()) is None


def _scheduler_output(new=(), finished=(), waiting=0):
    from vllm_specplug.vllm_adapter.v1.queue_state import WAITING_ATTR

    out = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new],
                          finished_req_ids=set(finished), total_num_scheduled_tokens=1)
    setattr(out, WAITING_ATTR, waiting)
    return out


def test_batch_drain_key_is_validated():
    from vllm_specplug.config import translate
    from vllm_specplug.options import SpecPlugConfigError

    assert translate({"method": "sam"})[1]["batch_drain"] == "auto"
    assert translate({"method": "sam", "batch_drain": "off"})[1]["batch_drain"] == "off"
    with pytest.raises(SpecPlugConfigError, match="batch_drain"):
        translate({"method": "sam", "batch_drain": "on"})


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_drafter_values_rows_by_their_steps_left_when_the_batch_drains(patch_calls,
                                                                       monkeypatch, mode):
    """The drafter reads the queue from the scheduler output and, in a
    draining batch, keeps the mediocre draft of the row that finishes last
    and cuts the same draft of a row far ahead."""
    from vllm_specplug.vllm_adapter.v1 import drafter as drafter_module
    from vllm_specplug.vllm_adapter.v1.drafter import SpecPlugDrafter

    d = SpecPlugDrafter(make_vllm_config({"method": "sam", "num_speculative_tokens": 4,
                                          "sam_min_accept_prob": 0.0, "batch_drain": mode}))
    d.step_cost = type(d.step_cost)(prior_a=C0, prior_row=C_ROW, prior_b=B, prior_weight=1e9)
    # no exploration: only the valuation decides what is kept
    monkeypatch.setattr(drafter_module, "EXPLORE_SHARE", 0.0)
    left = {"a": 2, "b": 40}
    monkeypatch.setattr(d, "_tokens_left", lambda req_id, n: left[req_id])
    # both rows draft the same (an order of two tokens repeated)
    monkeypatch.setattr(d.proposer, "propose", lambda req_id, k: chain([0.45, 0.4]))
    monkeypatch.setattr(d.proposer, "draft_cut", lambda req_id, kept: None)
    d.note_scheduler_output(_scheduler_output(new=["a", "b"]))
    hists = [[1, 2, 3, 1, 2], [7, 8, 7, 8]]
    drafts = step(d, ["a", "b"], hists, [[2], [8]])
    assert d.drain.draining
    if mode == "off":   # the usual rule: both rows keep their drafts
        assert d.stats()["drain"]["drain_steps"] == 0 and drafts == [[100, 101], [100, 101]]
        return
    assert d.stats()["drain"]["drain_steps"] == 1
    assert drafts[0] == [] and len(drafts[1]) == 2
    # the same batch with a queue: the usual rule keeps both
    d.note_scheduler_output(_scheduler_output(waiting=3))
    drafts = step(d, ["a", "b"], [hists[0] + [3], hists[1] + [7]], [[3], [7]])
    assert not d.drain.draining and len(drafts[0]) == len(drafts[1]) == 2
