"""The goodput controller and the per-request backoff (vllm_specplug.goodput)
against synthetic engines whose step times and acceptance are known, so the
best draft scale is known exactly (no engine)."""
from __future__ import annotations

import numpy as np
import pytest

from vllm_specplug import goodput
from vllm_specplug.goodput import LEVELS, GoodputController, RequestBackoff


def run(ctl, steps, accept, token_cost, rows=8, k=8, seed=0):
    """Drive ``ctl`` with a synthetic engine: each row drafts the controller's
    cap of k tokens, each accepted with probability ``accept`` in turn; a
    step costs 1 + token_cost * draft tokens (a step without drafts: 1).
    Returns the level run at each step."""
    rng = np.random.default_rng(seed)
    levels = []
    for _ in range(steps):
        scale = ctl.scale
        levels.append(scale)
        n = ctl.cap(k, scale)
        committed = 0
        for _ in range(rows):
            accepted = 0
            while accepted < n and rng.random() < accept:
                accepted += 1
            committed += 1 + accepted
        seconds = (1.0 + token_cost * n * rows) * rng.uniform(0.97, 1.03)
        ctl.record(committed / rows * 1.0 / seconds, seconds)
    return np.array(levels)


def test_speculation_that_costs_more_than_it_gains_is_turned_off():
    """Acceptance 0.1 and a draft token at 0.05 of a step: every scale above
    0 is slower than no drafts (at scale 1: 1.11 tokens a step for 4.2 steps'
    time). Within 400 steps the controller runs without drafts and stays."""
    ctl = GoodputController()
    levels = run(ctl, 400, accept=0.1, token_cost=0.05)
    assert ctl.level == len(LEVELS) - 1 and LEVELS[ctl.level] == 0.0
    assert (levels[-100:] == 0.0).mean() > 0.8
    assert ctl.moves == 3


def test_speculation_that_pays_keeps_its_drafts_and_probes_little():
    """Acceptance 0.8 at 0.005 of a step a token: all drafts is best; the
    controller stays there, and its probes (half and quarter drafts) take
    under 15% of the steps."""
    ctl = GoodputController()
    levels = run(ctl, 1200, accept=0.8, token_cost=0.005)
    assert ctl.level == 0 and ctl.moves == 0
    assert (levels < 1.0).mean() < 0.15
    # a probe that loses clearly is tried less and less often
    assert (levels[600:] < 1.0).mean() < (levels[:600] < 1.0).mean()


def test_the_controller_finds_an_intermediate_scale():
    """Acceptance 0.7 and 0.02 of a step a token: scale 0.5 (4 tokens) gives
    speedup 1.69, 0.25 (2 tokens) 1.66, 1 (8 tokens) 1.42, none 1. The
    controller settles below full drafts, not at none."""
    ctl = GoodputController()
    levels = run(ctl, 1500, accept=0.7, token_cost=0.02)
    assert LEVELS[ctl.level] in (0.25, 0.5)
    assert ((levels[-400:] == 0.25) | (levels[-400:] == 0.5)).mean() > 0.7


def test_disabled_controller_never_cuts():
    ctl = GoodputController(enabled=False)
    levels = run(ctl, 200, accept=0.0, token_cost=0.2)
    assert (levels == 1.0).all() and ctl.windows == 0


@pytest.mark.parametrize("n, scale, kept", [(8, 1.0, 8), (8, 0.5, 4), (7, 0.5, 4),
                                             (8, 0.25, 2), (1, 0.25, 1), (8, 0.0, 0)])
def test_cap(n, scale, kept):
    assert GoodputController.cap(n, scale) == kept


def test_backoff_mutes_a_failing_request_and_probes_it_cheaply():
    b = RequestBackoff()
    caps = []
    for step in range(60):
        cap = b.cap("r", 8)
        caps.append(cap)
        b.drafted("r", cap)
        b.settle("r", 0)                 # every draft fails
    # three failures, then 4 steps muted, a 2-token probe, 8 muted, a probe, 16...
    assert caps[:3] == [8, 8, 8]
    assert caps[3:7] == [0] * 4 and caps[7] == goodput.PROBE_TOKENS
    assert caps[8:16] == [0] * 8 and caps[16] == goodput.PROBE_TOKENS
    assert caps[17:33] == [0] * 16 and caps[33] == goodput.PROBE_TOKENS
    assert b.mutes == 4 and b.stats()["muted_steps"] == sum(c == 0 for c in caps)


def test_an_accepted_probe_restores_the_request():
    b = RequestBackoff()
    for _ in range(3):
        b.drafted("r", b.cap("r", 8))
        b.settle("r", 0)
    assert [b.cap("r", 8) for _ in range(4)] == [0] * 4
    probe = b.cap("r", 8)
    assert probe == goodput.PROBE_TOKENS
    b.drafted("r", probe)
    b.settle("r", 1)
    assert b.restored == 1 and b.cap("r", 8) == 8
    # a failure or two after that does not mute (the streak restarted)
    for _ in range(2):
        b.drafted("r", 8)
        b.settle("r", 0)
    assert b.cap("r", 8) == 8


def test_a_step_without_a_draft_is_not_a_failure_and_requests_are_forgotten():
    b = RequestBackoff()
    for _ in range(10):
        b.cap("r", 8)
        b.drafted("r", 0)                # nothing drafted (no match)
        b.settle("r", 0)
    assert b.cap("r", 8) == 8 and b.mutes == 0
    b.cap("q", 8)
    assert len(b) == 2
    b.forget("r")
    b.forget("q")
    b.forget("never")
    assert len(b) == 0


def test_disabled_backoff_never_cuts():
    b = RequestBackoff(enabled=False)
    for _ in range(20):
        assert b.cap("r", 8) == 8
        b.drafted("r", 8)
        b.settle("r", 0)
    assert len(b) == 0
