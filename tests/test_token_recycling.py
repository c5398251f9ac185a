"""Token Recycling proposer and the draft-budget model (no vLLM, milliseconds)."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_specplug.budget import StepCostModel, best_node_count
from vllm_specplug.config import build_proposer, translate
from vllm_specplug.options import SpecPlugConfigError
from vllm_specplug.proposers.base import TargetTopK
from vllm_specplug.proposers.token_recycling import (PAPER_LEVEL_SIZES, TokenRecyclingProposer,
                                                     best_first_template, load_matrix,
                                                     load_template, paper_template)
from vllm_specplug.tree import ancestor_mask


def _tr(budget=8, **kw):
    kw.setdefault("tr_prompt_bigrams", False)
    return TokenRecyclingProposer(budget, **kw)


def _topk(inputs, rows):
    rows = np.asarray(rows, dtype=np.int32)
    return TargetTopK(np.asarray(inputs, dtype=np.int32), rows, np.zeros(rows.shape))


def test_update_replaces_whole_rows_and_later_positions_win():
    p = _tr(tr_topk=3)
    p.update(np.array([5, 7, 5]), np.array([[1, 2, 3], [4, 5, 6], [9, 8, 7]]))
    assert p.matrix[5].tolist() == [9, 8, 7]
    assert p.matrix[7].tolist() == [4, 5, 6]
    assert (p.matrix[6] == -1).all()
    p.update(np.array([5]), np.array([[2, 1, 0]]))
    assert p.matrix[5].tolist() == [2, 1, 0]


def test_bfs_fill_matches_a_hand_computed_tree(tmp_path):
    # template: root's 0th and 1st candidates, then the 0th candidate's 0th
    # and 1st candidates, then (0, 0)'s 0th candidate
    tpl = tmp_path / "t.json"
    tpl.write_text(json.dumps([[0], [1], [0, 0], [0, 1], [0, 0, 0]]))
    p = _tr(budget=5, tr_topk=2, tr_template=str(tpl))
    p.update(np.array([10, 11, 12, 13]),
             np.array([[11, 12],     # after 10: 11, then 12
                       [13, 14],     # after 11: 13, 14
                       [15, 16],
                       [17, 18]]))
    p.start("r", [3, 10])
    d = p.propose("r", 5)
    # nodes: (0)=11, (1)=12, (0,0)=13, (0,1)=14, (0,0,0)=17
    assert d.tokens.tolist() == [11, 12, 13, 14, 17]
    assert d.parents.tolist() == [-1, -1, 0, 0, 2]


def test_nodes_with_empty_rows_are_dropped_with_their_subtrees(tmp_path):
    tpl = tmp_path / "t.json"
    tpl.write_text(json.dumps([[0], [1], [0, 0], [1, 0], [1, 0, 0]]))
    p = _tr(budget=5, tr_topk=2, tr_template=str(tpl))
    p.update(np.array([10, 11]), np.array([[11, 12], [13, 14]]))  # row 12 empty
    p.start("r", [10])
    d = p.propose("r", 5)
    assert d.tokens.tolist() == [11, 12, 13]
    assert d.parents.tolist() == [-1, -1, 0]
    p.start("s", [99])  # nothing known after 99
    assert len(p.propose("s", 5)) == 0


def test_observe_feeds_the_matrix_and_the_rank_hit_rates():
    p = _tr(budget=4, tr_topk=2)
    p.start("r", [1])
    p.observe("r", [], _topk([1], [[2, 3]]))
    assert p.matrix[1].tolist() == [2, 3]
    # committed 3 after 1: rank 1 of row 1; 4 after 3: row 3 unknown -> miss
    p.observe("r", [3, 4], _topk([1, 3], [[2, 3], [4, 5]]))
    assert p.rank_hits.tolist() == [0, 1, 1]
    assert p.transitions == 2
    assert p.matrix[3].tolist() == [4, 5]


def test_prompt_bigrams_fill_only_empty_rows_of_the_requests_own_view():
    p = TokenRecyclingProposer(4, tr_topk=2, tr_prompt_bigrams=True)
    p.update(np.array([1]), np.array([[7, 8]]))
    p.start("r", [1, 2, 3, 1, 4, 2, 5])
    view = p._adj["r"][1]
    assert view.row(1).tolist() == [7, 8]      # already known: kept
    assert view.row(2).tolist() == [5, -1]     # most recent bigram wins
    assert view.row(3).tolist() == [1, -1]
    assert (view.row(9) == -1).all()           # not in the prompt
    # the shared matrix never holds them (issue 45: prompts stay out of it)
    assert p.matrix[1].tolist() == [7, 8] and (p.matrix[2:5] == -1).all()


def test_state_is_per_request_and_freed():
    p = _tr()
    p.start("a", [1, 2])
    p.start("b", [3])
    assert p.active_requests() == 2
    p.finish("a")
    p.finish("a")
    assert p.active_requests() == 1
    assert p.matrix_nbytes() == p.matrix.size * 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8), st.integers(1, 40))
def test_best_first_template_is_the_best_prefix_closed_set(rates, budget):
    rates = np.array(rates)
    paths = best_first_template(rates, budget, max_depth=4)
    assert len(set(paths)) == len(paths)
    for i, p in enumerate(paths):  # every prefix is a tree (parents earlier)
        assert len(p) == 1 or p[:-1] in paths[:i]
    # the budget is filled unless every path up to depth 4 is taken
    n = rates.size
    assert len(paths) == min(budget, n + n ** 2 + n ** 3 + n ** 4)
    value = {p: float(np.prod(rates[list(p)])) for p in paths}
    assert all(value[a] >= value[b] - 1e-12 for a, b in zip(paths, paths[1:]))  # best first
    # no path outside the set (children of members, or new roots) beats the
    # worst member: the selection is greedy-optimal for a product model
    worst = min(value.values())
    frontier = [p + (r,) for p in paths if len(p) < 4 for r in range(n)]
    frontier += [(r,) for r in range(n)]
    for f in frontier:
        if f not in value:
            assert float(np.prod(rates[list(f)])) <= worst + 1e-12


def test_paper_template_has_the_paper_shape():
    p = _tr(budget=80, tr_template="paper")
    ranks, parents, values = p.template(80)
    assert ranks.size == sum(PAPER_LEVEL_SIZES) == 80
    depth = np.zeros(80, dtype=int)
    for i, q in enumerate(parents):
        assert q < i
        depth[i] = 1 if q < 0 else depth[q] + 1
    assert [int((depth == d).sum()) for d in range(1, 7)] == list(PAPER_LEVEL_SIZES)
    assert (np.diff(values) <= 1e-12).all()  # best first
    # cut to a budget: still a tree (prefix of a topological order)
    r16, p16, _ = p.template(16)
    assert r16.size == 16 and (p16 < np.arange(16)).all()
    ancestor_mask(p16)


def test_template_file_validation(tmp_path):
    bad = {
        "notjson.json": "[[0], ",
        "empty.json": "[]",
        "noparent.json": "[[0], [1, 0]]",
        "rank.json": "[[0], [9]]",
        "dup.json": "[[0], [0]]",
        "type.json": "[[0], [\"a\"]]",
    }
    for name, text in bad.items():
        f = tmp_path / name
        f.write_text(text)
        with pytest.raises(SpecPlugConfigError, match="tr_template"):
            load_template(str(f), 8)
    good = tmp_path / "good.json"
    good.write_text("[[1, 0], [0], [1]]")
    assert load_template(str(good), 8) == [(0,), (1,), (1, 0)]


def test_matrix_file_round_trip_and_validation(tmp_path):
    p = _tr(tr_topk=4)
    p.update(np.array([3, 9]), np.array([[1, 2, 3, 4], [5, 6, 7, 8]]))
    path = tmp_path / "m.npy"
    p.save_matrix(str(path))
    q = _tr(tr_topk=4, tr_matrix=str(path))
    assert np.array_equal(q.matrix, p.matrix)
    assert load_matrix(str(path), 2).shape[1] == 2   # fewer columns: cut
    with pytest.raises(SpecPlugConfigError, match="candidates per row"):
        load_matrix(str(path), 8)
    np.save(tmp_path / "f.npy", np.zeros((4, 8), dtype=np.float32))
    with pytest.raises(SpecPlugConfigError, match="integer"):
        load_matrix(str(tmp_path / "f.npy"), 8)
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(SpecPlugConfigError, match="pickle"):
        load_matrix(str(tmp_path / "o.npy"), 8)
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    with pytest.raises(SpecPlugConfigError):
        load_matrix(str(tmp_path / "junk.npy"), 8)


def test_config_translation_and_errors(tmp_path):
    vllm_kw, plugin = translate({"method": "token_recycling"})
    assert plugin["auto_budget"] is True
    assert vllm_kw["num_speculative_tokens"] == TokenRecyclingProposer.auto_budget_max
    prop = build_proposer(plugin)
    assert prop.auto_budget and prop.k == 8
    _, plugin = translate({"method": "token_recycling", "num_speculative_tokens": 16,
                           "tr_topk": 4, "tr_template": "paper"})
    assert plugin["auto_budget"] is False and plugin["options"]["tr_topk"] == 4
    for spec, msg in [
        ({"tr_topk": 0}, "tr_topk"),
        ({"tr_topk": 64}, "tr_topk"),
        ({"tr_template": "nosuchfile.json"}, "no file"),
        ({"tr_matrix": str(tmp_path / "missing.npy")}, "no file"),
        ({"num_speculative_tokens": "many"}, "num_speculative_tokens"),
        ({"tr_widths": 3}, "unknown key"),
    ]:
        with pytest.raises(SpecPlugConfigError, match=msg):
            translate({"method": "token_recycling", **spec})
    bad = tmp_path / "bad.json"
    bad.write_text("[[0, 0]]")
    with pytest.raises(SpecPlugConfigError, match="no parent"):
        translate({"method": "token_recycling", "tr_template": str(bad)})
    with pytest.raises(SpecPlugConfigError, match="not supported by method 'sam'"):
        translate({"method": "sam", "num_speculative_tokens": "auto"})


def test_auto_budget_follows_the_verify_cost():
    p = TokenRecyclingProposer(64, tr_topk=8, auto_budget=True, tr_prompt_bigrams=False)
    p.update(np.arange(100), (np.arange(100)[:, None] + np.arange(1, 9)) % 100)
    p.start("r", [5])
    p.relative_token_cost = 0.0
    cheap = len(p.propose("r", 64))
    p.relative_token_cost = 0.2  # prior rank-0 rate 0.45: 1 node pays (1.45 > 1.2)
    dear = len(p.propose("r", 64))
    p.relative_token_cost = 100.0
    none = len(p.propose("r", 64))
    assert cheap == 64 > dear >= 1 and none == 0


# ------------------------------------------------------------------ budget

@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=20), st.floats(0.0, 2.0),
       st.integers(0, 25))
def test_best_node_count_matches_brute_force(values, cost, max_nodes):
    v = np.sort(np.array(values, dtype=float))[::-1]
    n = best_node_count(v, cost, max_nodes)
    m = min(max_nodes, v.size)
    rates = [(1 + v[:i].sum()) / (1 + cost * i) for i in range(m + 1)]
    assert 0 <= n <= m
    assert rates[n] >= max(rates) - 1e-12


def test_step_cost_model_recovers_a_linear_cost_and_ignores_stalls():
    rng = np.random.default_rng(0)
    m = StepCostModel()
    for _ in range(400):
        t = int(rng.choice([1, 3, 9, 17, 33]))
        m.add(t, 0.05 + 0.004 * t + rng.normal(0, 0.001))
    m.add(5, 30.0)  # a stall
    a, b = m.fit()
    assert abs(a - 0.05) < 0.005 and abs(b - 0.004) < 0.0005
    assert abs(m.relative_token_cost(1) - 0.004 / 0.054) < 0.01
    # more rows in the batch: one more token is relatively cheaper to the step
    assert m.relative_token_cost(16) < m.relative_token_cost(1)
    # and dearer to one row's share of it: b / ((a + 16 b) / 16)
    assert m.row_token_cost(1) == pytest.approx(m.relative_token_cost(1))
    a16, b16 = m.fit(16)
    assert b16 == b
    assert m.row_token_cost(16) == pytest.approx(16 * b / (a16 + 16 * b))
    assert m.row_token_cost(16) > m.row_token_cost(1)


def test_step_cost_model_prior_before_measurements():
    m = StepCostModel(prior_a=1.0, prior_b=0.1)
    assert abs(m.relative_token_cost(1) - 0.1 / 1.1) < 1e-9
    m.add(0, 1.0)
    m.add(3, float("nan"))
    assert m.samples == 0


def test_rank_rates_drive_the_auto_template():
    p = _tr(budget=6)
    # rank 1 always hits: the template must favour rank-1 chains
    p.update(np.arange(50), (np.arange(50)[:, None] + np.arange(1, 9)) % 50)
    p.start("r", [0])
    for step in range(300):
        prev = p._last["r"]
        p.observe("r", [int(p.matrix[prev, 1])])
    counts = Counter(p.rank_hits.astype(int).tolist())
    assert p.rank_hits[1] == 300 and counts
    paths = best_first_template(p.rates(), 6)
    assert paths[0] == (1,) and paths[1] == (1, 1)


def test_matrix_is_saved_when_the_last_request_finishes(tmp_path):
    path = tmp_path / "tr.npy"
    p = _tr(tr_topk=2, tr_save_matrix=str(path))
    p.start("a", [1])
    p.start("b", [2])
    p.observe("a", [3], _topk([1, 3], [[3, 4], [5, 6]]))
    p.finish("a")
    assert not path.exists()          # "b" still active
    p.finish("b")
    saved = np.load(path, allow_pickle=False)
    assert np.array_equal(saved, p.matrix) and saved[3].tolist() == [5, 6]
    assert not list(tmp_path.glob("*.tmp*"))
    q = _tr(tr_topk=2, tr_matrix=str(path))
    assert np.array_equal(q.matrix, p.matrix)


def test_save_path_is_checked_before_the_engine_starts(tmp_path):
    with pytest.raises(SpecPlugConfigError, match="does not exist"):
        translate({"method": "token_recycling",
                   "tr_save_matrix": str(tmp_path / "nope" / "m.npy")})
