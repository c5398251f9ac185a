"""budget.py's building blocks against independent expectations (no engine):
the step-cost fit as a weighted least squares written out here, the cache
file, monotone values, calibration bookkeeping, subsets and option bounds.
Written to kill what mutation testing of budget.py found unchecked
(docs/testing.md)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from vllm_specplug import budget
from vllm_specplug.budget import (AcceptanceCalibration, StepCostModel, expected_accepted,
                                  load_prior, monotone_values, pop_batch_options, save_fit,
                                  subset)
from vllm_specplug.options import SpecPlugConfigError
from vllm_specplug.proposers.base import Draft


def _reference_fit(samples, a0=budget.PRIOR_A, b0=budget.PRIOR_B, w0=budget.PRIOR_WEIGHT,
                   decay=budget.DECAY):
    """Weighted least squares of seconds on tokens: sample i of n has weight
    decay^(n-1-i); the prior is two points on the line a0 + b0 * x at x = 1
    and x = 17 of weight w0 / 2 each, scaled by the weighted mean of
    seconds / (a0 + b0 * tokens) (1 without samples)."""
    n = len(samples)
    w = np.array([decay ** (n - 1 - i) for i in range(n)])
    x = np.array([t for t, _ in samples], dtype=float)
    y = np.array([s for _, s in samples], dtype=float)
    scale = float((w * y / (a0 + b0 * x)).sum() / w.sum()) if n else 1.0
    xs = np.concatenate([x, [1.0, 17.0]])
    ys = np.concatenate([y, [(a0 + b0) * scale, (a0 + 17 * b0) * scale]])
    ws = np.concatenate([w, [w0 / 2, w0 / 2]])
    xm, ym = np.average(xs, weights=ws), np.average(ys, weights=ws)
    b = (ws * (xs - xm) * (ys - ym)).sum() / (ws * (xs - xm) ** 2).sum()
    return ym - b * xm, b


def test_prior_alone_is_the_prior():
    assert StepCostModel().fit() == pytest.approx((budget.PRIOR_A, budget.PRIOR_B), rel=1e-12)
    assert StepCostModel(2.0, 0.5).fit() == pytest.approx((2.0, 0.5), rel=1e-12)


@pytest.mark.parametrize("samples", [
    [(1, 0.010), (1, 0.011), (9, 0.016), (17, 0.030), (4, 0.012)],
    [(1, 0.5)] * 3 + [(33, 0.9)] * 5,
    [(2, 0.02)],
])
def test_fit_is_weighted_least_squares_with_the_prior(samples):
    m = StepCostModel()
    for t, s in samples:
        m.add(t, s)
    assert m.samples == len(samples)
    assert m.fit() == pytest.approx(_reference_fit(samples), rel=1e-9)


def test_add_ignores_empty_steps_and_stalls_at_five_times_the_fit():
    m = StepCostModel()
    m.add(0, 1.0)
    m.add(4, 0.0)
    m.add(4, -1.0)
    assert m.samples == 0
    m.add(1, 0.01)
    a, b = m.fit()
    m.add(16, 5 * (a + b * 16))        # exactly at the bound: kept
    assert m.samples == 2
    a, b = m.fit()
    m.add(16, 5.5 * (a + b * 16))      # above it: a stall
    assert m.samples == 2
    a, b = m.fit()
    m.add(16, 4.9 * (a + b * 16))      # below it (the bound uses b * tokens)
    assert m.samples == 3


def test_saved_fit_file(tmp_path, monkeypatch):
    m = StepCostModel()
    for t, s in [(1, 0.01), (9, 0.02), (17, 0.03)]:
        m.add(t, s)
    a, b = m.fit()
    path = tmp_path / "deep" / "er" / "fit.json"
    replaced = []
    real_replace = budget.os.replace
    monkeypatch.setattr(budget.os, "replace",
                        lambda src, dst: (replaced.append(src), real_replace(src, dst)))
    save_fit(m, path)
    data = json.loads(path.read_text())
    assert data == {"format": 1, "a_s": a, "b_s": b, "ratio": b / a, "samples": 3}
    # written aside in the same folder (atomic), then renamed
    (src,) = replaced
    assert str(src).startswith(str(path.parent) + "/") and str(src).endswith(".tmp")
    assert sorted(p.name for p in path.parent.iterdir()) == ["fit.json"]
    loaded = load_prior(path)
    assert loaded.prior == (1.0, pytest.approx(b / a), budget.CACHED_PRIOR_WEIGHT)


@pytest.mark.parametrize("ratio, usable", [(0.0, True), (9.99, True), (10.0, False),
                                           (-0.01, False), (10.5, False)])
def test_load_prior_ratio_bounds(tmp_path, ratio, usable):
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({"format": 1, "ratio": ratio}))
    m = load_prior(path)
    assert (m is not None) == usable
    if usable:
        assert m.prior == (1.0, ratio, budget.CACHED_PRIOR_WEIGHT)


def test_monotone_values_clip_to_0_1_and_follow_parents():
    v = monotone_values(np.array([1.7, -0.2, 0.5, 0.9]), np.array([-1, 0, 0, 2]))
    assert v.tolist() == [1.0, 0.0, 0.5, 0.5]
    assert monotone_values(np.array([0.4, 0.6, 0.3]), None).tolist() == [0.4, 0.4, 0.3]


def test_expected_accepted():
    assert expected_accepted(Draft.empty()) == 0.0
    assert expected_accepted(Draft.chain([1, 2])) == 0.0               # no scores
    assert expected_accepted(Draft.chain([1], np.array([0.7]))) == pytest.approx(0.7)
    tree = Draft(np.array([1, 2, 3]), np.array([-1, 0, -1]), np.array([0.5, 0.9, 0.2]))
    assert expected_accepted(tree) == pytest.approx(0.5 + 0.5 + 0.2)  # child capped by parent
    # capped by its parent, not by the node before it
    tree = Draft(np.array([1, 2, 3]), np.array([-1, -1, 1]), np.array([0.2, 0.9, 0.8]))
    assert expected_accepted(tree) == pytest.approx(0.2 + 0.9 + 0.8)


def test_calibration_evicts_the_oldest_pending_draft(monkeypatch):
    monkeypatch.setattr(AcceptanceCalibration, "MAX_PENDING", 3)
    c = AcceptanceCalibration()
    c.expect("a", 1.0)
    c.expect("b", 1.0)
    c.expect("a", 1.0)                 # a new draft of "a" is the newest
    assert list(c.pending) == ["b", "a"]
    c = AcceptanceCalibration()
    for r in ("a", "b", "c"):
        c.expect(r, 1.0)
    c.expect("a", 2.0)                 # again: now the newest
    assert list(c.pending) == ["b", "c", "a"]
    c.expect("d", 1.0)                 # full: "b", the oldest, goes
    assert list(c.pending) == ["c", "a", "d"] and c.pending["a"] == 2.0


def test_calibration_stats_are_rounded():
    c = AcceptanceCalibration()
    c.expect("r", 1 / 3)
    c.settle("r", 1)
    ratio = (1 + c.PRIOR) / (1 / 3 + c.PRIOR)
    assert c.stats() == {"ratio": round(ratio, 4), "settled": 1, "accepted": 1.0,
                         "expected": 0.33}
    c.expect("s", 0.0)
    c.settle("s", 0)
    assert c.stats()["accepted"] == round(c.DECAY, 2)
    assert c.stats()["expected"] == round(c.DECAY / 3, 2)
    assert c.stats()["ratio"] == round(c.ratio, 4) != round(c.ratio, 5)


def test_subset_renumbers_keeps_scores_and_refuses_orphans():
    tree = Draft(np.array([5, 6, 7, 8]), np.array([-1, 0, 0, 2]),
                 np.array([0.9, 0.5, 0.4, 0.3]))
    s = subset(tree, np.array([True, False, True, True]))
    assert s.tokens.tolist() == [5, 7, 8] and s.parents.tolist() == [-1, 0, 1]
    assert s.scores.tolist() == pytest.approx([0.9, 0.4, 0.3])
    unscored = Draft(np.array([5, 6]), np.array([-1, 0]))
    assert subset(unscored, np.array([True, False])).scores is None
    with pytest.raises(ValueError, match="^subset: the kept nodes are not closed under parents$"):
        subset(tree, np.array([False, True, False, False]))   # node 1 without node 0


@pytest.mark.parametrize("limit, ok", [(1, True), (2, True), (0, False)])
def test_disable_by_batch_size_bounds(limit, ok):
    spec = {"disable_by_batch_size": limit}
    if ok:
        assert pop_batch_options(spec)["disable_by_batch_size"] == limit
    else:
        with pytest.raises(SpecPlugConfigError, match="disable_by_batch_size"):
            pop_batch_options(spec)


def test_bad_batch_budget_mode_lists_the_modes():
    with pytest.raises(SpecPlugConfigError,
                       match=r"must be one of 'auto', 'pace', 'off', got 'on'$"):
        pop_batch_options({"batch_budget": "on"})


def test_token_costs_default_to_one_row():
    m = StepCostModel(1.0, 0.25)
    assert m.relative_token_cost() == pytest.approx(0.25 / 1.25) == m.row_token_cost()
    assert m.row_token_cost(4) == pytest.approx(4 * 0.25 / 2.0)


def _chain(scores):
    return Draft.chain(list(range(len(scores))), np.array(scores))


@pytest.mark.parametrize("last, kept", [(0.2, 3), (0.18, 2)])
def test_unscored_drafts_count_their_tokens(last, kept):
    """rows 2 + an unscored draft of 4 tokens: bars 0.125, 0.171, 0.189 for the
    scored chain's nodes (a = 1, b = 0.1)."""
    unscored = Draft.chain([7, 7, 7, 7])
    out = budget.allocate_batch([unscored, _chain([0.9, 0.5, last])], 1.0, 0.1, rows=2)
    assert len(out[0]) == 4 and len(out[1]) == kept


def test_calibrated_values_are_capped_at_one():
    """scale 1.5: node 0's value is 1 (not 1.35), so node 1 (0.12 * 1.5 = 0.18)
    beats the bar 2 * 0.1 / 1.2 = 0.167 (a = 1, b = 0.1, one row)."""
    out = budget.allocate_batch([_chain([0.9, 0.12])], 1.0, 0.1, rows=1, scale=1.5)
    assert len(out[0]) == 2


def test_a_node_exactly_at_the_bar_is_not_taken_nor_explored_at_the_margin():
    # a = b = 1, one row: the bar is 1 / 2; the margin 0.5 of it is 0.25
    assert len(budget.allocate_batch([_chain([0.5])], 1.0, 1.0, rows=1)[0]) == 0
    assert len(budget.allocate_batch([_chain([0.51])], 1.0, 1.0, rows=1)[0]) == 1
    out, explored = budget.allocate_batch_exploring([_chain([0.25])], 1.0, 1.0, 1, explore=1)
    assert len(out[0]) == 0 and explored == 0
    out, explored = budget.allocate_batch_exploring([_chain([0.26])], 1.0, 1.0, 1, explore=1)
    assert len(out[0]) == 1 and explored == 1
