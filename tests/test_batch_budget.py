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
            d.requests[rid].seen = None
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


def _rejected_steps(d, steps: int) -> list[int]:
    """``steps`` batch steps of two rows whose drafts (a chain worth 0.6, 0.55:
    below the bar, within the exploration margin) are never accepted (every
    step commits token 7); the explored nodes per step."""
    d.step_cost = type(d.step_cost)(prior_a=1.0, prior_b=10.0, prior_weight=1e9)
    d._cost_cache = None   # 300 steps would save this made-up cost for later drafters
    d.proposer.propose = lambda req_id, k: Draft.chain(np.array([999, 998]),
                                                       np.array([0.6, 0.55]))
    hist = {"a": [1, 2, 3, 1, 2], "b": [4, 5, 6, 4, 5]}
    out = []
    for _ in range(steps):
        before = d.stats()["batch_budget"]["nodes_explored"]
        step(d, ["a", "b"], [hist["a"], hist["b"]], [[hist["a"][-1]], [hist["b"][-1]]])
        out.append(d.stats()["batch_budget"]["nodes_explored"] - before)
        for rid in ("a", "b"):
            hist[rid] = hist[rid] + [7]
    return out


def test_exploration_that_never_pays_shrinks(patch_calls, monkeypatch):
    """Explored nodes that are never accepted cut the share of step time spent
    exploring (``ExplorationYield``): over 300 steps, well under what the full
    EXPLORE_SHARE buys (the same run with the factor held at 1), and never
    nothing (an estimate can still recover)."""
    from vllm_specplug.budget import ExplorationYield

    spec = {"method": "sam", "num_speculative_tokens": 4, "sam_min_accept_prob": 0.0}
    shrinking = _rejected_steps(_drafter(spec), 300)
    d = _drafter(spec)
    monkeypatch.setattr(ExplorationYield, "factor", lambda self, bar: 1.0)
    full = _rejected_steps(d, 300)
    assert sum(full) >= 25, full                  # 300 * 0.05 * 2.1 = 31.5 nodes
    assert 0 < sum(shrinking) <= 0.6 * sum(full), (sum(shrinking), sum(full))
    # the second half explores less than the first
    assert sum(shrinking[150:]) < sum(shrinking[:150])


def test_exploration_yield_settles_what_explored_nodes_got_accepted():
    from vllm_specplug.budget import ExplorationYield

    y = ExplorationYield()
    assert y.factor(0.5) == 1.0                   # the prior: at the bar
    y.expect("r", merit_depth=2, explored_depth=4, nodes=2)
    y.settle("r", 3)                              # one explored token accepted
    assert (y.hits, y.tries, y.settled) == (1.0, 2.0, 1)
    y.expect("r", merit_depth=2, explored_depth=4, nodes=2)
    y.settle("r", 1)                              # a merit node failed: explored got none
    assert y.hits == pytest.approx(0.99) and y.tries == pytest.approx(3.98)
    y.expect("r", 0, 3, 3)
    y.settle("r", 9)                              # at most the explored depth counts
    assert y.hits == pytest.approx(0.99 * 0.99 + 3)
    y.settle("r", 5)                              # nothing pending: no effect
    assert y.settled == 3 and not y.pending
    # explored nodes accepted above the bar keep the full share
    y2 = ExplorationYield()
    for _ in range(50):
        y2.expect("r", 0, 1, 1)
        y2.settle("r", 1)
    assert y2.factor(0.5) == 1.0
    # never accepted: down to MIN_FACTOR, not below
    y3 = ExplorationYield()
    for _ in range(500):
        y3.expect("r", 0, 1, 1)
        y3.settle("r", 0)
    assert y3.factor(0.5) == ExplorationYield.MIN_FACTOR


def test_explored_masks_mark_exactly_the_explored_nodes():
    from vllm_specplug.budget import allocate_batch_exploring

    a, b = 1.0, 10.0
    drafts = [chain([0.99, 0.6, 0.55]), chain([0.3]), chain([0.98, 0.97])]
    masks: list = []
    out, n = allocate_batch_exploring(drafts, a, b, 3, explore=2, explored_masks=masks)
    assert [len(m) for m in masks] == [len(d) for d in out]
    assert sum(int(m.sum()) for m in masks) == n == 2
    # bar 0.97: 0.99 and 0.98 kept on merit; explored: the likeliest two of
    # the cut nodes within half the bar (0.97, 0.6); 0.3 is below the margin
    assert [m.tolist() for m in masks] == [[False, True], [], [False, True]]
