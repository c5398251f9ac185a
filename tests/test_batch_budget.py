"""Batch-aware draft budgets (``budget.allocate_batch``) against brute force,
and the drafter's use of them (cut drafts, ``disable_by_batch_size``)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from helpers import make_vllm_config, step
from vllm_specplug.budget import allocate_batch, best_node_count, monotone_values, subset
from vllm_specplug.config import translate
from vllm_specplug.options import SpecPlugConfigError
from vllm_specplug.proposers.base import Draft

probs = st.floats(0.0, 1.0, allow_nan=False)


def chain(values):
    return Draft.chain(np.arange(len(values)) + 100, values)


def rate(drafts_kept, a, b, rows):
    expected = rows + sum(float(np.sum(d.scores)) for d in drafts_kept if len(d))
    tokens = rows + sum(len(d) for d in drafts_kept)
    return expected / (a + b * tokens)


@settings(max_examples=200, deadline=None)
@given(st.lists(probs, min_size=1, max_size=12), st.floats(0.001, 0.5))
def test_one_request_matches_best_node_count(values, ratio):
    """For one request, the greedy batch rule keeps what ``best_node_count``
    (the single-request optimum) keeps."""
    # the draft holds float32 scores: compare on the same rounded values, and
    # skip exact ties with the threshold (either answer is optimal there)
    v = np.sort(np.asarray(values, dtype=np.float32).astype(np.float64))[::-1]
    cost = ratio / (1.0 + ratio)
    assume(not np.any(np.abs(v - cost) < 1e-9))
    [kept] = allocate_batch([chain(v)], 1.0, ratio, rows=1)
    assert len(kept) == best_node_count(v, cost, v.size)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(probs, min_size=0, max_size=4), min_size=1, max_size=3),
       st.floats(0.01, 0.3), st.integers(0, 3))
def test_chains_reach_the_brute_force_optimum(rows_values, ratio, idle_rows):
    """Over every combination of chain prefixes, none has a higher expected
    tokens per second than the greedy choice (values made monotone first)."""
    drafts = [chain(monotone_values(np.asarray(v), None)) for v in rows_values]
    rows = len(drafts) + idle_rows
    got = allocate_batch(drafts, 1.0, ratio, rows)
    for d, g in zip(drafts, got):
        assert g.tokens.tolist() == d.tokens[: len(g)].tolist()  # a prefix
    best = max(rate([_prefix(d, n) for d, n in zip(drafts, ns)], 1.0, ratio, rows)
               for ns in itertools.product(*[range(len(d) + 1) for d in drafts]))
    assert rate(got, 1.0, ratio, rows) >= best - 1e-12


def _prefix(d: Draft, n: int) -> Draft:
    return subset(d, np.arange(len(d)) < n) if n else Draft.empty()


def test_large_batches_turn_speculation_off_and_sure_nodes_stay():
    """Mediocre drafts pay at batch 1 but not at batch 32; certain ones always do."""
    a, b = 0.070, 0.007  # seconds: this CPU's step and per-token cost
    weak = [chain([0.5, 0.3, 0.2]) for _ in range(32)]
    assert len(allocate_batch(weak[:1], a, b, 1)[0]) >= 2
    assert sum(len(d) for d in allocate_batch(weak, a, b, 32)) == 0
    sure = [chain([1.0, 1.0]) for _ in range(32)]
    assert sum(len(d) for d in allocate_batch(sure, a, b, 32)) == 64


def test_tree_cut_is_ancestor_closed_and_renumbered():
    #       0 (0.9)
    #      /       \
    #  1 (0.5)    2 (0.6)
    #     |
    #  3 (0.8 -> made 0.5)
    tree = Draft(np.array([10, 11, 12, 13]), np.array([-1, 0, 0, 1]),
                 np.array([0.9, 0.5, 0.6, 0.8]))
    assert monotone_values(tree.scores, tree.parents).tolist() == pytest.approx(
        [0.9, 0.5, 0.6, 0.5])
    # expensive tokens: keep what is worth it only
    [kept] = allocate_batch([tree], 1.0, 0.6, rows=1)
    assert kept.tokens.tolist() == [10, 12] and kept.parents.tolist() == [-1, 0]
    [all_kept] = allocate_batch([tree], 1.0, 0.0001, rows=1)
    assert all_kept is tree
    with pytest.raises(ValueError, match="closed"):
        subset(tree, np.array([True, False, False, True]))


def test_unscored_drafts_are_kept_and_counted():
    unscored = Draft.chain([1, 2, 3, 4, 5, 6, 7, 8])
    scored = chain([0.3])
    out = allocate_batch([unscored, scored], 1.0, 0.1, rows=2)
    assert out[0] is unscored
    # 10 tokens already verified: 0.3 < 2 * 0.1 / (1 + 0.1 * 10) = 0.1 ... kept
    assert len(out[1]) == 1
    out = allocate_batch([unscored, chain([0.05])], 1.0, 0.1, rows=2)
    assert len(out[1]) == 0


def test_batch_keys_are_validated():
    plugin = translate({"method": "sam", "batch_budget": "off",
                        "disable_by_batch_size": 16})[1]
    assert plugin["batch_budget"] == "off" and plugin["disable_by_batch_size"] == 16
    assert translate({"method": "sam"})[1]["batch_budget"] == "auto"
    with pytest.raises(SpecPlugConfigError, match="batch_budget"):
        translate({"method": "sam", "batch_budget": "always"})
    for bad in (0, -3, "8", True, 2.5):
        with pytest.raises(SpecPlugConfigError, match="disable_by_batch_size"):
            translate({"method": "sam", "disable_by_batch_size": bad})


# ------------------------------------------------------------------ drafter
def _drafter(spec):
    from vllm_specplug.vllm_adapter.v1.drafter import SpecPlugDrafter

    return SpecPlugDrafter(make_vllm_config(spec))


def test_drafter_disables_speculation_at_the_batch_size_limit(patch_calls):
    d = _drafter({"method": "sam", "num_speculative_tokens": 4, "disable_by_batch_size": 3,
                  "sam_min_accept_prob": 0.0})
    hists = [[1, 2, 3, 1, 2], [7, 8, 7, 8], [5, 6, 5, 6]]
    assert all(step(d, ["a", "b"], hists[:2], [[2], [8]]))
    before = d.stats()["batch_budget"]["nodes_proposed"]
    drafts = step(d, ["a", "b", "c"], [h + [s] for h, s in zip(hists, [3, 7, 5])],
                  [[3], [7], [5]])
    assert drafts == [[], [], []]
    assert d.stats()["batch_budget"]["disabled_steps"] == 1
    # nothing was proposed at the limit, so nothing is counted as tried
    assert not d.proposer._pending
    assert d.stats()["batch_budget"]["nodes_proposed"] == before
    # ... but the proposer followed the committed tokens: with "c" gone, "a"
    # drafts from its automaton, which holds the disabled step's token 3
    hists = [h + [s] for h, s in zip(hists, [3, 7, 5])]
    drafts = step(d, ["a", "b"], [hists[0] + [1], hists[1] + [8]], [[1], [8]])
    assert d.proposer._automata["a"].tokens.tolist() == hists[0] + [1]
    assert drafts[0][:3] == [2, 3, 1]


def test_drafter_cuts_weak_drafts_in_a_batch_and_tells_the_proposer(patch_calls):
    # sam_min_accept_prob 0: sam drafts whole (sized by a row's share of the
    # step cost it would draft nothing here itself), so the batch budget cuts
    d = _drafter({"method": "sam", "num_speculative_tokens": 4, "sam_min_accept_prob": 0.0})
    # a step costs 1, each extra token 10: no draft node can pay for itself
    d.step_cost = type(d.step_cost)(prior_a=1.0, prior_b=10.0, prior_weight=1e9)
    hists = [[1, 2, 3, 1, 2], [7, 8, 7, 8]]
    drafts = step(d, ["a", "b"], hists, [[2], [8]])
    assert drafts == [[], []]
    s = d.stats()["batch_budget"]
    assert s["steps"] == 1 and s["nodes_proposed"] > 0 and s["nodes_kept"] == 0
    assert not d.proposer._pending


def test_drafter_explores_within_its_share_of_step_time(patch_calls):
    """Cut drafts still get nodes verified, paid from EXPLORE_SHARE of each
    step's time: a fresh engine whose estimates start below the bar still
    learns, and a batch never spends more than that share on nodes that do
    not pay."""
    from vllm_specplug.vllm_adapter.v1.drafter import EXPLORE_SHARE

    d = _drafter({"method": "sam", "num_speculative_tokens": 4,
                  "sam_min_accept_prob": 0.0})
    # a step of 2 rows costs 1 + 10 * 2 = 21, a node 10: no node pays (bar 0.95),
    # a node with the prior's 0.5 is within the exploration margin
    d.step_cost = type(d.step_cost)(prior_a=1.0, prior_b=10.0, prior_weight=1e9)
    hist = {"a": [1, 2, 3, 1, 2, 3, 1, 2], "b": [7, 8, 9, 7, 8, 9, 7, 8]}
    steps = 64
    lengths = []
    for _ in range(steps):
        drafts = step(d, ["a", "b"], [hist["a"], hist["b"]], [[hist["a"][-1]],
                                                              [hist["b"][-1]]])
        lengths.append([len(x) for x in drafts])
        for rid in ("a", "b"):  # nothing verified: same history
            d._seen.pop(rid, None)
            d.proposer.finish(rid)
    explored = sum(map(sum, lengths))
    budget = steps * EXPLORE_SHARE * 21.0 / 10.0  # 6.7 nodes
    assert int(budget) - 1 <= explored <= budget, lengths
    assert all(sum(row) <= 1 for row in lengths)
    assert d.stats()["batch_budget"]["nodes_explored"] == explored


def test_exploration_takes_the_likeliest_cut_nodes_within_the_margin():
    from vllm_specplug.budget import allocate_batch_exploring

    a, b = 1.0, 10.0  # bar for a first node among 2 rows: 2 * 10 / 21 = 0.95
    drafts = [chain([0.3, 0.3]), chain([0.6, 0.55]), chain([0.6])]
    out, n = allocate_batch_exploring(drafts, a, b, 2, explore=0)
    assert n == 0 and sum(map(len, out)) == 0
    out, n = allocate_batch_exploring(drafts, a, b, 2, explore=1)
    assert n == 1 and [len(x) for x in out] == [0, 1, 0]
    # equal values: shallow nodes of other rows before a row's deeper ones
    out, n = allocate_batch_exploring(drafts, a, b, 2, explore=2)
    assert n == 2 and [len(x) for x in out] == [0, 1, 1]
    # 0.3 is below half the bar: never explored, whatever the budget
    out, n = allocate_batch_exploring(drafts, a, b, 2, explore=10)
    assert [len(x) for x in out] == [0, 2, 1] and n == 3
    # a calibration at its floor (scale 1/4) does not stop exploration: the
    # margin reads the proposer's estimates, so verified drafts can lift it
    out, n = allocate_batch_exploring(drafts, a, b, 2, scale=0.25, explore=3)
    assert [len(x) for x in out] == [0, 2, 1] and n == 3


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(probs, min_size=0, max_size=5), min_size=1, max_size=4),
       st.floats(0.01, 2.0), st.integers(0, 6))
def test_exploration_adds_to_the_optimum_and_keeps_prefixes(rows_values, ratio, explore):
    """Exploring keeps every node the plain allocation keeps, adds at most
    ``explore`` nodes, each at least half the bar, and still cuts prefixes."""
    from vllm_specplug.budget import allocate_batch_exploring

    drafts = [chain(monotone_values(np.asarray(v), None)) for v in rows_values]
    rows = len(drafts)
    plain = allocate_batch(drafts, 1.0, ratio, rows)
    got, n = allocate_batch_exploring(drafts, 1.0, ratio, rows, explore=explore)
    assert 0 <= n <= explore
    for d, p, g in zip(drafts, plain, got):
        assert g.tokens.tolist() == d.tokens[: len(g)].tolist()
        assert len(g) >= len(p)
    # every node past the plain allocation was explored, and counted: none
    # taken without being reported
    values = [monotone_values(d.scores, None) for d in drafts]
    extra = [(float(values[i][j]), j, i) for i, (p, g) in enumerate(zip(plain, got))
             for j in range(len(p), len(g))]
    assert len(extra) == n, (extra, n)
    # each, in the order taken (most likely first), was at least half the
    # bar it had to beat: expected tokens * b / (a + b * tokens) so far
    expected = rows + sum(float(v[: len(p)].sum()) for v, p in zip(values, plain))
    tokens = rows + sum(map(len, plain))
    for v, _, _ in sorted(extra, key=lambda e: (-e[0], e[1], e[2])):
        bar = expected * ratio / (1.0 + ratio * tokens)
        assert v > 0.5 * bar, (v, bar, extra)
        expected += v
        tokens += 1
    if explore == 0:
        assert [len(g) for g in got] == [len(p) for p in plain]


# ------------------------------------------------------------ calibration
def test_calibration_ratio_tracks_accepted_over_expected():
    from vllm_specplug.budget import AcceptanceCalibration

    c = AcceptanceCalibration()
    assert c.ratio == 1.0
    for i in range(400):  # estimates twice what verification accepts
        c.expect(f"r{i % 4}", 2.0)
        c.settle(f"r{i % 4}", 1)
    assert c.ratio == pytest.approx(0.5, abs=0.03)
    c.settle("unknown", 5)  # nothing expected from it: ignored
    c.expect("gone", 3.0)
    c.forget("gone")
    c.settle("gone", 3)
    assert c.settled == 400 and not c.pending
    for _ in range(4000):  # far below: kept at MIN
        c.expect("r", 4.0)
        c.settle("r", 0)
    assert c.ratio == c.MIN


def test_allocate_batch_scales_estimates():
    a, b = 0.070, 0.007
    drafts = [chain([0.9, 0.8, 0.7]) for _ in range(8)]
    full = sum(len(d) for d in allocate_batch(drafts, a, b, 8))
    halved = sum(len(d) for d in allocate_batch(drafts, a, b, 8, scale=0.5))
    assert full == 24 and halved < full
    # scaling never lifts an estimate above 1
    assert sum(len(d) for d in allocate_batch([chain([1.0])] * 32, a, b, 32, scale=1.5)) == 32


def test_drafter_calibrates_from_what_verification_accepted(patch_calls):
    """In batch steps the drafter records the kept drafts' expected accepted
    tokens and, next step, what was committed; estimates that promised more
    than was accepted lower the ratio."""
    d = _drafter({"method": "sam", "num_speculative_tokens": 4, "sam_min_accept_prob": 0.0})
    d.step_cost = type(d.step_cost)(prior_a=1.0, prior_b=1e-6, prior_weight=1e9)  # cheap
    hist = {"a": [1, 2, 3, 1, 2, 3, 1, 2], "b": [7, 8, 9, 7, 8, 9, 7, 8]}
    drafts = step(d, ["a", "b"], [hist["a"], hist["b"]], [[2], [8]])
    assert all(drafts) and set(d.calibration.pending) == {"a", "b"}
    # verification rejects every draft token: one token committed per request
    hist = {"a": hist["a"] + [9], "b": hist["b"] + [1]}
    step(d, ["a", "b"], [hist["a"], hist["b"]], [[9], [1]])
    cal = d.stats()["calibration"]
    assert cal["settled"] == 2 and cal["accepted"] == 0 and cal["expected"] > 0
    assert cal["ratio"] < 1.0
    # finished requests leave nothing behind
    for r in ("a", "b"):
        d.finish_request(r)
    assert not d.calibration.pending


# ------------------------------------------------------- fixed batches: pacing
def _paced_rate(kept, eligible, a, b, rows):
    """The critical rows' expected tokens per second: their own tokens (one
    each plus accepted nodes) over the whole step's cost."""
    out = sum(1 + float(np.sum(d.scores)) if len(d) else 1
              for d, e in zip(kept, eligible) if e)
    tokens = rows + sum(len(d) for d in kept)
    return out / (a + b * tokens)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.floats(0.5, 9.0)), min_size=1, max_size=6),
       st.integers(0, 8))
def test_must_draft_names_the_rows_that_would_finish_after_the_batch(rows, margin):
    """A row need not draft when, without drafts (one token a step), it
    finishes within ``margin`` of the batch's last row at their paces."""
    from vllm_specplug.budget import must_draft

    remaining = [None if r == 0 else r for r, _ in rows]
    pace = [p for _, p in rows]
    got = must_draft(remaining, pace, margin)
    live = [(r, max(p, 1.0)) for r, p in zip(remaining, pace) if r is not None]
    if not live:
        assert got is None
        return
    finish = max(r / p for r, p in live)
    for i, (r, p) in enumerate(zip(remaining, pace)):
        last = r is not None and r / max(p, 1.0) == finish
        assert got[i] == (r is not None and (r + margin > finish or last)), (i, r, finish)
    # the row that finishes last always drafts
    last = max((r / max(p, 1.0), i) for i, (r, p) in enumerate(zip(remaining, pace))
               if r is not None)[1]
    assert got[last]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(probs, min_size=0, max_size=4), min_size=2, max_size=4),
       st.lists(st.integers(1, 12), min_size=4, max_size=4),
       st.lists(st.floats(1.0, 3.0), min_size=4, max_size=4), st.floats(0.01, 0.3))
def test_pace_batch_drafts_only_rows_that_must_and_is_optimal_for_them(rows_values, left,
                                                                       pace, ratio):
    """Rows that finish in time without drafts keep nothing; over every
    combination of the other rows' chain prefixes, none has higher expected
    tokens per second for those rows than ``pace_batch``'s choice."""
    from vllm_specplug.budget import must_draft, pace_batch

    drafts = [chain(monotone_values(np.asarray(v), None)) for v in rows_values]
    remaining, pace = left[: len(drafts)], pace[: len(drafts)]
    eligible = must_draft(remaining, pace, 0.0).tolist()
    rows = len(drafts)
    got, explored, dropped, mask = pace_batch(drafts, remaining, pace, 1.0, ratio, rows)
    assert mask.tolist() == eligible
    assert explored == 0
    assert dropped == sum(len(d) for d, e in zip(drafts, eligible) if not e)
    for d, g, e in zip(drafts, got, eligible):
        if not e:
            assert len(g) == 0
        assert g.tokens.tolist() == d.tokens[: len(g)].tolist()
    best = max(_paced_rate([_prefix(d, n) if e else Draft.empty()
                            for d, n, e in zip(drafts, ns, eligible)], eligible, 1.0, ratio, rows)
               for ns in itertools.product(*[range(len(d) + 1) for d in drafts]))
    assert _paced_rate(got, eligible, 1.0, ratio, rows) >= best - 1e-12


def test_must_draft_at_the_margin_and_with_no_row_decoding():
    """A row exactly ``margin`` tokens short of the batch's end finishes in
    time without drafts (the rule is strict); with no row decoding nothing
    is paced, explored or dropped."""
    from vllm_specplug.budget import must_draft, pace_batch

    assert must_draft([10, 8, 9], [1.0, 1.0, 1.0], 2.0).tolist() == [True, False, True]
    assert must_draft([None, None], [1.0, 1.0], 2.0) is None
    drafts = [chain([0.9, 0.9])] * 2
    got, explored, dropped, mask = pace_batch(drafts, [None, None], [1.0, 1.0], 1.0, 0.1, 2,
                                              explore=4)
    assert (got, explored, dropped, mask) == (drafts, 0, 0, None)


def test_pace_batch_explores_on_the_rows_that_must_draft():
    """``explore`` reaches the allocation: nodes below the bar (0.15 against
    1 / (0.1 + 4) ~ 0.24 for the one eligible row of four, a = 0.1, b = 1)
    but above half of it are taken on the row that must draft, up to
    ``explore`` of them."""
    from vllm_specplug.budget import pace_batch

    drafts = [chain([0.15, 0.15, 0.15])] * 4
    remaining, pace = [5, 5, 5, 40], [1.0] * 4
    got, explored, dropped, _ = pace_batch(drafts, remaining, pace, 0.1, 1.0, 4)
    assert [len(d) for d in got] == [0] * 4 and explored == 0 and dropped == 9
    got, explored, dropped, _ = pace_batch(drafts, remaining, pace, 0.1, 1.0, 4, explore=2)
    assert [len(d) for d in got] == [0, 0, 0, 2] and explored == 2 and dropped == 9


def test_a_lone_slowest_row_drafts_as_a_batch_of_one_would():
    """In a batch of 8 where one row would finish last (41 tokens at 1.1 a
    step, 37 steps; the others finish in 20 at 2 a step, or in 30 without
    drafting), that row keeps a node worth 0.3 (a batch of one would: bar
    b / (a + b T) ~ 0.1), which the throughput rule, counting every row's
    token as output, cuts (bar ~ 0.6); the rows ahead keep nothing, even a
    node worth 0.9."""
    from vllm_specplug.budget import pace_batch

    a, b, rows = 1.0, 0.1, 8
    drafts = [chain([0.9])] * 7 + [chain([0.3])]
    remaining, pace = [30] * 7 + [41], [2.0] * 7 + [1.1]
    thr = allocate_batch(drafts, a, b, rows)
    assert [len(d) for d in thr] == [1] * 7 + [0]
    paced, _, dropped, _ = pace_batch(drafts, remaining, pace, a, b, rows, margin=4)
    assert [len(d) for d in paced] == [0] * 7 + [1]
    assert dropped == 7


def test_rows_that_would_overtake_the_slowest_keep_drafting():
    """Leapfrogging: when every row drafts well (9 tokens a step), a row a
    few tokens ahead of the last must still draft, or the last one overtakes
    it and it finishes last at one token a step."""
    from vllm_specplug.budget import pace_batch

    drafts = [chain([0.9] * 8)] * 4
    paced, _, dropped, _ = pace_batch(drafts, [64, 60, 56, 40], [9.0] * 4, 1.0, 0.01, 4)
    assert [len(d) for d in paced] == [8] * 4 and dropped == 0


def test_row_paces_count_only_steps_allowed_to_draft():
    from vllm_specplug.budget import RowPaces

    p = RowPaces()
    assert p.pace("a") == RowPaces.PRIOR
    p.committed("a", 1)                  # not allowed to draft (paced off): not counted
    assert p.pace("a") == RowPaces.PRIOR
    p.allow("a", True)
    p.committed("a", 5)
    assert p.pace("a") == pytest.approx(2.0 * 0.75 + 5 * 0.25)
    assert p.overall == pytest.approx(2.0 * 0.98 + 5 * 0.02)
    p.committed("a", 1)                  # the allowed step was counted once
    assert p.pace("a") == pytest.approx(2.75)
    p.allow("a", True)                   # allowed, nothing to draft: one token counts
    p.committed("a", 1)
    assert p.pace("a") == pytest.approx(2.75 * 0.75 + 0.25)
    p.allow("a", False)
    p.committed("a", 9)
    assert p.pace("a") == pytest.approx(2.75 * 0.75 + 0.25)
    p.allow("a", True)                   # allowed, then paced off in the same step
    p.allow("a", False)
    p.committed("a", 9)
    assert p.pace("a") == pytest.approx(2.75 * 0.75 + 0.25)
    p.allow("b", True)
    assert len(p) == 2
    p.forget("a")
    p.forget("b")
    assert len(p) == 0 and p.pace("a") == p.overall


def test_length_endings_turn_pacing_off_and_on():
    from vllm_specplug.budget import LengthEndings

    e = LengthEndings()
    assert e.binding                     # a fresh engine paces its first fixed batch
    for _ in range(2):
        e.record(False)
    assert e.binding
    e.record(False)                      # three early endings in a row: off
    assert not e.binding
    for _ in range(20):
        e.record(False)
    for n in range(3):
        assert not e.binding, n
        e.record(True)
    assert e.binding and e.finished == 26


def _fake_runner(specs):
    """A runner holding requests {req_id: (prompt tokens, max_tokens)}."""
    from types import SimpleNamespace as NS

    return NS(requests={rid: NS(sampling_params=NS(max_tokens=m, extra_args=None),
                                num_prompt_tokens=p, lora_request=None)
                        for rid, (p, m) in specs.items()})


def _scheduler_output(req_ids, waiting):
    from types import SimpleNamespace as NS

    from vllm_specplug.vllm_adapter.v1.queue_state import WAITING_ATTR

    out = NS(scheduled_new_reqs=[NS(req_id=r, specplug_cache_salt=None) for r in req_ids],
             total_num_scheduled_tokens=len(req_ids))
    if waiting is not None:
        setattr(out, WAITING_ATTR, waiting)
    return out


@pytest.mark.parametrize("mode, waiting, paced", [
    ("pace", 0, True), ("pace", 1, False), ("pace", None, False), ("auto", 0, False)])
def test_drafter_paces_fixed_batches(patch_calls, mode, waiting, paced):
    """With nothing waiting in the scheduler's queue, the row with more
    tokens still to generate drafts and the row ahead of it does not; with a
    request waiting, an unknown queue or the default "auto", both draft."""
    d = _drafter({"method": "sam", "num_speculative_tokens": 4, "sam_min_accept_prob": 0.0,
                  "batch_budget": mode})
    # verified tokens nearly free: the throughput rule keeps both drafts
    d.step_cost = type(d.step_cost)(prior_a=1.0, prior_b=1e-4, prior_weight=1e9)
    hists = [[1, 2, 3, 1, 2], [7, 8, 7, 8]]
    # "a": 3 generated of 20, 16 left after this step; "b": 2 generated of
    # 50, 47 left: at the prior pace (2 a step) "b" finishes in 23.5 steps,
    # "a" in 16 without drafting
    d.runner = _fake_runner({"a": (2, 20), "b": (2, 50)})
    d.note_scheduler_output(_scheduler_output(["a", "b"], waiting))
    drafts = step(d, ["a", "b"], hists, [[2], [8]])
    assert len(drafts[1]) > 0
    assert (len(drafts[0]) == 0) == paced, drafts
    s = d.stats()
    assert s["batch_budget"]["paced_steps"] == int(paced)
    assert (s["batch_budget"]["nodes_paced_off"] > 0) == paced
    assert s["pacing"]["waiting"] == waiting
    assert s["sizes"]["drafter_remaining"] == 2
    assert s["sizes"]["drafter_paces"] == 2 - int(paced)   # rows allowed to draft


def test_drafter_counts_paces_only_for_rows_allowed_to_draft(patch_calls):
    """Over two paced steps: the row that drafted gets its pace from the
    tokens its next step committed, the paced-off row none; each row's own
    pace decides which rows draft; the batch counters add up over steps."""
    d = _drafter({"method": "sam", "num_speculative_tokens": 4, "sam_min_accept_prob": 0.0,
                  "batch_budget": "pace"})
    d.step_cost = type(d.step_cost)(prior_a=1.0, prior_b=1e-4, prior_weight=1e9)
    d.runner = _fake_runner({"a": (2, 20), "b": (2, 50)})
    d.note_scheduler_output(_scheduler_output(["a", "b"], 0))
    hists = [[1, 2, 3, 1, 2], [7, 8, 7, 8]]
    first = step(d, ["a", "b"], hists, [[2], [8]])
    assert len(first[0]) == 0 and len(first[1]) > 0
    s1 = dict(d.stats()["batch_budget"])
    # "b" committed 3 tokens (two drafts accepted, then its bonus), "a" one
    hists = [hists[0] + [3], hists[1] + [7, 8, 7]]
    step(d, ["a", "b"], hists, [[3], [7, 8, 7]])
    assert d.paces.rows == {"b": pytest.approx(2.0 * 0.75 + 3 * 0.25)}
    s2 = d.stats()["batch_budget"]
    assert s2["steps"] == s1["steps"] + 1 == 2 and s2["paced_steps"] == 2
    assert s2["nodes_proposed"] > s1["nodes_proposed"] > 0
    assert s2["nodes_kept"] > s1["nodes_kept"] > 0
    assert s2["nodes_paced_off"] > s1["nodes_paced_off"] > 0
    assert d.stats()["propose_time"]["calls"] == 2 and d.stats()["propose_time"]["rows"] == 4
    assert d.stats()["propose_time"]["seconds"] > 0
    # each row's own pace, and the margin: "b" (43 tokens left) at 3.5 a
    # step, then 2.875 after its 1 token this step, ends the batch in 15
    # steps; "a" (14 left, at the engine's overall pace of about 2) ends in
    # 14 without drafts, within the margin of 2 tokens of the end, so it
    # drafts too (at the overall pace for "b", 21 steps, or without the
    # margin, it would not)
    d.paces.rows["b"] = 3.5
    hists = [hists[0] + [1], hists[1] + [8]]
    third = step(d, ["a", "b"], hists, [[1], [8]])
    assert len(third[0]) > 0 and len(third[1]) > 0


def test_a_faulted_row_still_sets_the_end_of_a_paced_batch(patch_calls):
    """A request whose drafting faulted keeps decoding without drafts, one
    token a step: its tokens still to generate still count, at that pace,
    so when it is the slowest row the other rows, which would finish before
    it, need not draft ("a": 39 tokens left at the prior pace of 2, "c"
    60 at 1; with "c" counted at the prior pace, 30 steps, "a" would have
    to draft)."""
    d = _drafter({"method": "sam", "num_speculative_tokens": 4, "sam_min_accept_prob": 0.0,
                  "batch_budget": "pace"})
    d.step_cost = type(d.step_cost)(prior_a=1.0, prior_b=1e-4, prior_weight=1e9)
    # "a" 30 tokens of 40 left, "b" 10; "c" 60 left, faulted
    d.runner = _fake_runner({"a": (2, 43), "b": (2, 13), "c": (2, 63)})
    d.note_scheduler_output(_scheduler_output(["a", "b", "c"], 0))
    d._request_fault("c", RuntimeError("injected"))
    hists = [[1, 2, 3, 1, 2], [7, 8, 7, 8], [5, 6, 5, 6]]
    drafts = step(d, ["a", "b", "c"], hists, [[2], [8], [5]])
    assert drafts == [[], [], []]
    assert d.stats()["batch_budget"]["nodes_paced_off"] > 0


def test_drafter_stops_pacing_when_requests_end_before_max_tokens(patch_calls):
    """Requests that finish far from their max_tokens (an end-of-sequence
    token) turn pacing off; requests run to it turn it back on."""
    d = _drafter({"method": "sam", "num_speculative_tokens": 4, "sam_min_accept_prob": 0.0,
                  "batch_budget": "pace"})
    d.step_cost = type(d.step_cost)(prior_a=1.0, prior_b=1e-4, prior_weight=1e9)
    hists = [[1, 2, 3, 1, 2], [7, 8, 7, 8]]

    def batch(ids, max_tokens):
        d.runner = _fake_runner({r: (2, m) for r, m in zip(ids, max_tokens)})
        d.note_scheduler_output(_scheduler_output(ids, 0))
        drafts = step(d, ids, hists, [[2], [8]])
        for r in ids:
            d.finish_request(r)
        return drafts

    for n in range(2):  # 2 x 2 requests ending 20+ tokens before their bound
        assert len(batch([f"a{n}", f"b{n}"], (20, 50))[0]) == 0
    assert not d.length_endings.binding
    assert len(batch(["a2", "b2"], (20, 50))[0]) > 0     # not paced: both draft
    # requests ending at their bound: 3 generated of max_tokens 4 -> 0 left
    batch(["a3", "b3"], (4, 4))
    batch(["a4", "b4"], (4, 4))
    assert d.length_endings.binding
    assert d.stats()["sizes"]["drafter_remaining"] == 0
    assert d.stats()["sizes"]["drafter_paces"] == 0


def test_schedule_patch_sets_the_waiting_count():
    from types import SimpleNamespace as NS

    from vllm_specplug.vllm_adapter.v1.queue_state import (WAITING_ATTR, make_schedule,
                                                           waiting_of)

    class FakeScheduler:
        def get_request_counts(self):
            return 5, 3

    schedule = make_schedule(lambda self, *a, **k: NS(scheduled_new_reqs=[]))
    out = schedule(FakeScheduler())
    assert getattr(out, WAITING_ATTR) == 3 and waiting_of(out) == 3
    assert waiting_of(NS()) is None and waiting_of(None) is None
