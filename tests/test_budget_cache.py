"""The step-cost fit is cached per machine/model/layout and used as the next
engine's prior."""
from __future__ import annotations

import time

import numpy as np
import pytest

import vllm_specplug.vllm_adapter.v1 as adapter
from helpers import make_vllm_config
from vllm_specplug.budget import (CACHED_PRIOR_WEIGHT, SAVE_EVERY, StepCostModel, load_prior,
                                  save_fit)
from vllm_specplug.vllm_adapter.v1.drafter import SpecPlugDrafter, step_cost_cache_path


def fitted(a=0.07, b=0.007, n=300, seed=0):
    rng = np.random.default_rng(seed)
    m = StepCostModel()
    for _ in range(n):
        t = int(rng.integers(1, 40))
        m.add(t, (a + b * t) * rng.uniform(0.97, 1.03))
    return m


def test_fit_recovers_the_cost_line_and_round_trips(tmp_path):
    m = fitted()
    a, b = m.fit()
    assert a == pytest.approx(0.07, rel=0.1) and b == pytest.approx(0.007, rel=0.1)
    save_fit(m, tmp_path / "c.json")
    prior = load_prior(tmp_path / "c.json")
    assert prior.prior[3] == CACHED_PRIOR_WEIGHT
    # before any measurement the cached ratio is the whole estimate, once
    # checked (unchecked, it reads drafts dearer than the built-in prior
    # does, so that one steers: StepCostModel.coefficients)
    assert prior.steering == "built-in (cache unchecked)"
    prior.prior_checked, prior._coef = True, None
    assert prior.relative_token_cost(1) == pytest.approx(m.relative_token_cost(1), rel=1e-6)


@pytest.mark.parametrize("text", ["", "{", '{"format": 1}', '{"format": 1, "ratio": -1}',
                                  '{"format": 2, "ratio": 0.1}', '{"format": 1, "ratio": "x"}'])
def test_unusable_cache_is_ignored(tmp_path, text):
    (tmp_path / "c.json").write_text(text)
    assert load_prior(tmp_path / "c.json") is None
    assert load_prior(tmp_path / "missing.json") is None


def config(model="m", tp=1):
    return make_vllm_config(model=model, tensor_parallel_size=tp)


def test_drafter_saves_and_next_drafter_starts_from_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SPECPLUG_CACHE", str(tmp_path))
    monkeypatch.delenv("VLLM_SPECPLUG_STEP_COST_CACHE")   # the default place
    monkeypatch.setattr(adapter, "install_worker_patches", lambda: None)
    path = step_cost_cache_path(config())
    assert path.parent == tmp_path / "step_cost"
    assert path != step_cost_cache_path(config(model="other"))
    assert path != step_cost_cache_path(config(tp=2))
    # tree verification's tokens cost more: its fit never primes a chain engine
    assert path != step_cost_cache_path(config(), tree=True)
    assert step_cost_cache_path(config(), tree=False) == path
    d = SpecPlugDrafter(config())
    assert not d.step_cost_from_cache
    d.step_cost = fitted(n=SAVE_EVERY - 1)
    d.budget.last = (("r",), 3, time.perf_counter() - 0.09)
    d._time_step(["r"], [[1]])  # the SAVE_EVERY-th sample
    assert path.is_file()
    d2 = SpecPlugDrafter(config())
    assert d2.step_cost_from_cache
    assert d2.stats()["step_cost"]["from_cache"]


def test_tests_never_use_the_users_step_cost_cache(monkeypatch):
    """conftest points the cache at a folder of the test session (engines
    inherit it), so no test reads or writes what this machine's earlier runs
    measured."""
    import os
    from pathlib import Path

    from vllm_specplug.models import cache_root

    path = step_cost_cache_path(config())
    assert path.parent == Path(os.environ["VLLM_SPECPLUG_STEP_COST_CACHE"])
    assert cache_root() not in path.parents
    monkeypatch.setenv("VLLM_SPECPLUG_STEP_COST_CACHE", "/some/folder")
    assert step_cost_cache_path(config()).parent == Path("/some/folder")


def test_cache_can_be_disabled(monkeypatch):
    monkeypatch.setenv("VLLM_SPECPLUG_STEP_COST_CACHE", "0")
    assert step_cost_cache_path(config()) is None


def test_a_slow_first_step_does_not_inflate_the_token_cost_for_good():
    """Regression: the prior was scaled to the first measured step only. A slow
    first step (warm-up, a busy machine) then gave the prior's 17-token
    point a huge time while all later steps verified one token, so the fit's
    slope stayed several times the step cost, and "auto" budgets drafted
    nothing for the rest of the engine's life (seen in a benchmark: a
    relative token cost of 0.62 and tau 1.00). With only one-token steps the
    slope must keep the prior's ratio to the measured step time."""
    from vllm_specplug.budget import StepCostModel

    m = StepCostModel(prior_a=1.0, prior_b=0.068, prior_weight=32.0)
    m.add(1, 0.9)                       # a slow first step
    for _ in range(1500):
        m.add(1, 0.070)                 # then plain 70 ms steps, no drafts
    a, b = m.fit()
    assert a + b == pytest.approx(0.070, rel=0.05)
    assert b / a == pytest.approx(0.068, rel=0.1)
    assert m.relative_token_cost(1) < 0.1
