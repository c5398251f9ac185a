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
                   decay=budget.DECAY, rows_at=1):
    """Weighted least squares of seconds on (1, rows, draft tokens), written
    out: sample i of n, (tokens, seconds) or (tokens, seconds, rows), has
    weight decay^(n-1-i); the prior is four points (rows, drafts) in {1, 16}
    x {0, 4} on c0 + c_row rows + c_draft drafts = a0 + b0 (rows + drafts),
    weight w0 / 4 each, scaled by the weighted seconds over the prior's cost
    of the same steps (1 without samples). Returns (a, b) at ``rows_at`` rows:
    a + b (rows_at + d) is a step's cost."""
    n = len(samples)
    w = np.array([decay ** (n - 1 - i) for i in range(n)])
    rows = np.array([s[2] if len(s) > 2 else 1 for s in samples], dtype=float)
    d = np.array([s[0] for s in samples], dtype=float) - rows
    y = np.array([s[1] for s in samples], dtype=float)
    scale = float((w * y).sum() / (w * (a0 + b0 * (rows + d))).sum()) if n else 1.0
    pr = np.array([1.0, 1.0, 4.0, 4.0])
    pd = np.array([0.0, 4.0, 0.0, 4.0])
    X = np.column_stack([np.ones(n + 4), np.concatenate([rows, pr]), np.concatenate([d, pd])])
    Y = np.concatenate([y, (a0 + b0 * (pr + pd)) * scale])
    W = np.concatenate([w, [w0 / 4] * 4])
    # least squares with both slopes >= 0: the best of the column subsets
    # whose solution has no negative slope
    best = None
    for keep in ([0, 1, 2], [0, 1], [0, 2], [0]):
        Xk = X[:, keep]
        ck = np.linalg.solve(Xk.T @ (W[:, None] * Xk), Xk.T @ (W * Y))
        if (ck[1:] < 0).any():
            continue
        c = np.zeros(3)
        c[keep] = ck
        sse = float((W * (Y - X @ c) ** 2).sum())
        if best is None or sse < best[0]:
            best = (sse, c)
    c = best[1]
    return c[0] + c[1] * rows_at - c[2] * rows_at, c[2]


def test_prior_alone_is_the_prior():
    assert StepCostModel().fit() == pytest.approx((budget.PRIOR_A, budget.PRIOR_B), rel=1e-12)
    assert StepCostModel(2.0, 0.5).fit() == pytest.approx((2.0, 0.5), rel=1e-12)


@pytest.mark.parametrize("samples", [
    [(1, 0.010), (1, 0.011), (9, 0.016), (17, 0.030), (4, 0.012)],
    [(1, 0.5)] * 3 + [(33, 0.9)] * 5,
    [(2, 0.02)],
    [(4, 0.03, 4), (9, 0.05, 4), (16, 0.09, 16), (20, 0.10, 16), (1, 0.01, 1), (3, 0.012, 1)],
])
def test_fit_is_weighted_least_squares_with_the_prior(samples):
    m = StepCostModel()
    for t, s, *rows in samples:
        m.add(t, s, rows=rows[0] if rows else 1)
    assert m.samples == len(samples)
    for at in (1, 4, 16):
        assert m.fit(at) == pytest.approx(_reference_fit(samples, rows_at=at), rel=1e-9)


def test_add_ignores_empty_steps_and_stalls_at_five_times_the_fit():
    m = StepCostModel()
    m.add(0, 1.0)
    m.add(4, 0.0)
    m.add(4, -1.0)
    assert m.samples == 0
    m.add(1, 0.01)
    a, b = m.fit()
    m.add(16, 5 * (a + b * 16) * (1 - 1e-9))   # at the bound: kept
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
    c0, cr, cd = m.coefficients()
    assert data == {"format": 2, "c0_s": c0, "row_s": cr, "draft_s": cd,
                    "ratio": cd / (c0 + cr), "samples": 3}
    assert (c0 + cr - cd, cd) == pytest.approx((a, b))
    # written aside in the same folder (atomic), then renamed
    (src,) = replaced
    assert str(src).startswith(str(path.parent) + "/") and str(src).endswith(".tmp")
    assert sorted(p.name for p in path.parent.iterdir()) == ["fit.json"]
    loaded = load_prior(path)
    base = c0 + cr
    assert loaded.prior == pytest.approx((c0 / base, cr / base, cd / base,
                                          budget.CACHED_PRIOR_WEIGHT))
    # it reads a draft token dearer than the built-in prior does, so until
    # its check the built-in prior steers; once checked, before any
    # measurement, the cached fit is the whole estimate
    assert loaded.steering == "built-in (cache unchecked)"
    assert loaded.relative_token_cost(1) < m.relative_token_cost(1)
    loaded.prior_checked, loaded._coef = True, None
    assert loaded.steering == "cache"
    assert loaded.relative_token_cost(1) == pytest.approx(m.relative_token_cost(1))
    assert loaded.relative_token_cost(8) == pytest.approx(m.relative_token_cost(8))


@pytest.mark.parametrize("c0, row, draft, usable", [
    (0.9, 0.1, 0.0, True), (0.9, 0.1, 9.99, True), (0.9, 0.1, 10.0, False),
    (0.9, 0.1, -0.01, False), (-0.1, 1.1, 0.1, False), (0.0, 0.0, 0.1, False),
    (0.5, 0.1, float("nan"), False), (0.9, 0.1, 0.1, True)])
def test_load_prior_bounds(tmp_path, c0, row, draft, usable):
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({"format": 2, "c0_s": c0, "row_s": row, "draft_s": draft}))
    m = load_prior(path)
    assert (m is not None) == usable
    if usable:
        base = c0 + row
        assert m.prior == pytest.approx((c0 / base, row / base, draft / base,
                                         budget.CACHED_PRIOR_WEIGHT))


def test_a_format_1_cache_is_not_read(tmp_path):
    """Format 1 held one slope over all verified tokens, rows' costs in it."""
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({"format": 1, "a_s": 0.01, "b_s": 0.003, "ratio": 0.3}))
    assert load_prior(path) is None


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
                       match=r"must be one of 'auto', 'off', got 'on'$"):
        pop_batch_options({"batch_budget": "on"})


def test_removed_pace_budget_is_refused_with_the_valid_modes():
    """The "pace" mode (pacing fixed batches) was removed on 2026-12-07, measured no
    faster: refused before the engine starts, naming the valid modes."""
    with pytest.raises(SpecPlugConfigError,
                       match=r"must be one of 'auto', 'off', got 'pace' \(\"pace\" was removed"):
        pop_batch_options({"batch_budget": "pace"})


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


def _batch_steps(m, rng, n, c0=0.020, row=0.004, draft=0.001, noise=0.02, max_rows=16):
    """Steps of 1..max_rows rows drafting 0..2 tokens a row, timed by a
    synthetic clock: c0 + row * rows + draft * draft_tokens, +-noise."""
    for _ in range(n):
        rows = int(rng.integers(1, max_rows + 1))
        drafts = int(rng.integers(0, 2 * rows + 1))
        m.add(rows + drafts, (c0 + row * rows + draft * drafts) * rng.uniform(1 - noise, 1 + noise),
              rows=rows)


def test_a_large_per_row_cost_is_not_charged_to_drafts():
    """Sampling and output processing cost per row (here four times a draft
    token): the fitted draft-token cost stays the synthetic clock's. One
    slope over all verified tokens (rows' tokens and drafts alike, the
    format-1 model) reads 0.0021 s here, twice it."""
    m = StepCostModel()
    _batch_steps(m, np.random.default_rng(1), 600)
    c0, row, draft = m.coefficients()
    assert draft == pytest.approx(0.001, rel=0.1)
    assert row == pytest.approx(0.004, rel=0.1)
    assert m.relative_token_cost(1) == pytest.approx(0.001 / 0.024, rel=0.15)
    a, b = m.fit(8)
    assert a + b * 8 == pytest.approx(0.020 + 8 * 0.004, rel=0.05)


def test_the_fit_resists_slow_steps_that_come_with_long_drafts():
    """One step in ten takes 2.5 times as long (under the stall bound), and
    those happen to be long drafts: least squares reads them as a dearer
    draft token (0.0024 s here); the Huber weights keep it within 20% of the
    clock's 0.001."""
    rng = np.random.default_rng(2)
    m = StepCostModel()
    for i in range(800):
        drafts = int(rng.integers(0, 9))
        slow = 2.5 if (i % 10 == 0 and drafts >= 6) or (i % 10 == 5 and drafts >= 4) else 1.0
        m.add(1 + drafts, (0.024 + 0.001 * drafts) * slow * rng.uniform(0.98, 1.02))
    assert m.coefficients()[2] == pytest.approx(0.001, rel=0.2)


@pytest.mark.parametrize("cached_ratio, dropped", [(0.31, True), (0.045, False)])
def test_a_cached_fit_is_checked_against_the_engines_own_steps(tmp_path, cached_ratio, dropped):
    """The issue's case: a cache reading a draft token at 0.31 of a step, an
    engine whose draft token costs 0.042 of it (one row, drafts 0..8). Once
    CHECK_AFTER steps spread their drafts, the cache is dropped for the
    built-in prior and the fit follows the engine; a cache that agrees is
    kept."""
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({"format": 2, "c0_s": 0.9, "row_s": 0.1,
                                "draft_s": cached_ratio}))
    m = load_prior(path)
    # before its check the cache steers only where it is the cheaper one
    built_in = budget.PRIOR_B / (budget.PRIOR_A + budget.PRIOR_B)
    assert m.relative_token_cost(1) == pytest.approx(min(cached_ratio, built_in))
    assert m.steering == ("cache" if cached_ratio < built_in else "built-in (cache unchecked)")
    rng = np.random.default_rng(3)
    for i in range(budget.CHECK_AFTER - 1):
        m.add(1 + i % 9, 0.024 + 0.001 * (i % 9))
        assert not m.prior_checked
    for _ in range(40):
        drafts = int(rng.integers(0, 9))
        m.add(1 + drafts, (0.024 + 0.001 * drafts) * rng.uniform(0.98, 1.02))
    assert m.prior_checked and m.prior_dropped == dropped
    assert m.prior[3] == (budget.PRIOR_WEIGHT if dropped else budget.CACHED_PRIOR_WEIGHT)
    assert m.relative_token_cost(1) == pytest.approx(0.001 / 0.024, rel=0.25)


def test_a_cached_fit_waits_for_draft_spread_before_its_check():
    """Steps that all verify the same tokens cannot tell a draft token's
    cost: the check waits (the cached prior stays) until they spread."""
    m = StepCostModel(prior_a=0.9, prior_b=0.31, prior_row=0.1,
                      prior_weight=budget.CACHED_PRIOR_WEIGHT, cached=True)
    for _ in range(3 * budget.CHECK_AFTER):
        m.add(2, 0.025)
    assert not m.prior_checked and not m.prior_dropped
    for i in range(40):
        m.add(1 + i % 9, 0.024 + 0.001 * (i % 9))
    assert m.prior_checked and m.prior_dropped


def test_an_unchecked_dear_cache_does_not_starve_the_engine_of_its_check():
    """The regime case (the CI run of a9d01ec): a cache written by a batch of
    24 rows drafting 9 tokens each, read by an engine of one row, cut its
    drafts so short that its steps never spread their drafts, so the cache
    was never checked and steered the whole engine. Here the cache reads a
    draft token at 0.8 of a step; the engine drafts what its current fit
    allows (chains accepted with a probability varying step to step, cut
    where one more token no longer pays) against a clock where a draft
    token costs 0.042 of a step. Steering from that cache it would draft
    0.3 tokens a step and never check it; it must draft as with no cache,
    check the cache, drop it and end near the clock's cost."""
    m = StepCostModel(prior_a=0.9, prior_b=0.8, prior_row=0.1,
                      prior_weight=budget.CACHED_PRIOR_WEIGHT, cached=True)
    assert m.steering == "built-in (cache unchecked)"
    rng = np.random.default_rng(5)
    drafted = []
    for _ in range(4 * budget.CHECK_AFTER):
        p = rng.uniform(0.2, 0.95)
        n = budget.best_node_count(p ** np.arange(1, 9), m.relative_token_cost(1), 8)
        drafted.append(n)
        m.add(1 + n, (0.024 + 0.001 * n) * rng.uniform(0.98, 1.02))
    assert np.mean(drafted[: budget.CHECK_AFTER]) > 3, drafted
    assert m.prior_checked and m.prior_dropped and m.steering == "built-in"
    assert m.relative_token_cost(1) == pytest.approx(0.001 / 0.024, rel=0.25)


def test_an_unchecked_cheap_cache_steers_from_the_first_step():
    """A cache cheaper than the built-in prior (a GPU's) steers at once:
    that is what the cache is for (no cold start)."""
    m = StepCostModel(prior_a=0.95, prior_b=0.01, prior_row=0.05,
                      prior_weight=budget.CACHED_PRIOR_WEIGHT, cached=True)
    assert m.steering == "cache"
    assert m.relative_token_cost(1) == pytest.approx(0.01)
