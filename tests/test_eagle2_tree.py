"""EAGLE-2 dynamic tree (proposers/eagle2.py) and the sam_eagle2 hybrid, with
fake heads: a hand-worked tree, properties against a brute-force EAGLE-2,
config validation. No vLLM."""
from __future__ import annotations

import json
import math
import zlib
from collections import Counter

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from vllm_specplug.budget import best_node_count
from vllm_specplug.config import build_proposer, translate
from vllm_specplug.options import SpecPlugConfigError
from vllm_specplug import folders
from vllm_specplug.proposers.base import Draft
from vllm_specplug.proposers.eagle2 import (
    Eagle2Proposer, build_dynamic_tree, clean_children, path_length, rerank)
from vllm_specplug.proposers.hybrid import SamEagle2Proposer
from vllm_specplug.registry import get_proposer_class, proposer_names

VOCAB = 64


# ---------------------------------------------------------------------- fake heads
class FakeHead:
    """An EAGLE head whose next-token distribution after each draft path (the
    tokens from the last committed one) is ``children(path)``: a table, else
    ``default(path)``. Records every call and checks the feeding protocol."""

    vocab_size = VOCAB

    def __init__(self, table=None, default=None, call_cost=None):
        self.table = {tuple(k): v for k, v in (table or {}).items()}
        self.default = default
        if call_cost is not None:
            self.call_cost = call_cost
        self.calls: list[tuple[str, list, list, int]] = []
        self.released: list[str] = []
        self.roots = 0
        self._fed: list[tuple[int, ...]] = []   # paths of the nodes fed since root()

    def children(self, path):
        path = tuple(path)
        if path in self.table:
            return self.table[path]
        return self.default(path) if self.default else []

    def _arrays(self, kids, k):
        kids = sorted(kids, key=lambda c: -c[1])[:k]
        ids = np.array([t for t, _ in kids], dtype=np.int32)
        lps = np.array([math.log(p) if p > 0 else -np.inf for _, p in kids], dtype=np.float32)
        return ids, lps

    def root(self, req_id, k):
        self.roots += 1
        self._fed = []
        return self._arrays(self.children(()), k)

    def expand(self, req_id, tokens, parents, k):
        tokens, parents = np.asarray(tokens), np.asarray(parents)
        assert tokens.dtype == np.int32 and tokens.shape == parents.shape
        self.calls.append(("expand", tokens.tolist(), parents.tolist(), k))
        rows = []
        for t, p in zip(tokens.tolist(), parents.tolist()):
            assert -1 <= p < len(self._fed), "parent must be a node fed earlier"
            path = (self._fed[p] if p >= 0 else ()) + (t,)
            # the node must be a child the head proposed for its parent
            assert t in [c for c, _ in self.children(path[:-1])]
            self._fed.append(path)
            rows.append(self._arrays(self.children(path), k))
        # rows with fewer children are padded with invalid entries (-1, -inf)
        ids = np.full((len(rows), k), -1, dtype=np.int32)
        lps = np.full((len(rows), k), -np.inf, dtype=np.float32)
        for i, (a, b) in enumerate(rows):
            ids[i, :a.size], lps[i, :b.size] = a, b
        return ids, lps

    def release(self, req_id):
        self.released.append(req_id)


def random_head(seed, vocab=VOCAB, ties=False):
    """Children of a path: a seeded random distribution over ``vocab`` tokens
    (``ties``: probabilities from a few powers of two, so scores tie exactly,
    and sometimes a certain child, log-prob 0)."""
    def default(path):
        rng = np.random.default_rng([seed, zlib.crc32(repr(path).encode())])
        n = int(rng.integers(1, 12))
        toks = rng.choice(vocab, size=n, replace=False)
        if ties:
            if rng.random() < 0.1:
                return [(int(toks[0]), 1.0)]
            p = rng.choice([0.5, 0.25, 0.125, 0.0625], size=n)
            p = p / max(1.0, p.sum())
        else:
            p = rng.dirichlet(np.ones(n)) * rng.uniform(0.5, 1.0)
        return [(int(t), float(x)) for t, x in zip(toks, p)]

    return FakeHead(default=default)


def run(head, depth, topk, max_nodes, **kw):
    counters = Counter()
    ids, lps = head.root("r", min(topk, max_nodes))

    def expand(tokens, parents, k):
        return head.expand("r", tokens, parents, k)

    draft = build_dynamic_tree(ids, lps, expand, depth, topk, max_nodes,
                               vocab_size=head.vocab_size, counters=counters, **kw)
    return draft, counters


def paths(draft):
    """Root-to-node token path of every node, in node order."""
    parents, out = draft.parent_array(), []
    for i in range(len(draft)):
        p = int(parents[i])
        out.append((out[p] if p >= 0 else ()) + (int(draft.tokens[i]),))
    return out


def reference(head, depth, topk):
    """Plain EAGLE-2, no pruning: every candidate as (score, depth, gen, path)."""
    def kids(path):
        # the log-probs the head hands out (float32), summed as the tree does,
        # so that exact ties are the same ties
        k = sorted(head.children(path), key=lambda c: -c[1])[:topk]
        return [(t, float(np.float32(math.log(p)))) for t, p in k if p > 0]

    level = [(lp, (t,)) for t, lp in kids(())]
    out = [(s, 1, i, p) for i, (s, p) in enumerate(level)]
    frontier = sorted(level, key=lambda c: -c[0])[:topk]
    for d in range(2, depth + 1):
        level = [(s + lp, p + (t,)) for s, p in frontier for t, lp in kids(p)]
        out += [(s, d, len(out) + i, p) for i, (s, p) in enumerate(level)]
        frontier = sorted(level, key=lambda c: -c[0])[:topk]
    return sorted(out, key=lambda c: (-c[0], c[1], c[2]))


# ---------------------------------------------------------------------- hand-worked
HAND = {
    (): [(10, 0.6), (11, 0.35)],
    (10,): [(20, 0.5), (21, 0.4)],
    (11,): [(22, 0.9), (23, 0.05)],
    (10, 20): [(30, 0.7), (31, 0.2)],
    (11, 22): [(32, 0.8), (33, 0.1)],
}


def test_hand_worked_tree():
    """topk 2, depth 3, 5 nodes. Depth 1: 10 (.6), 11 (.35). Depth 2 (both
    fed): 20 (.30), 21 (.24), 22 (.315), 23 (.0175); frontier 22, 20. Depth 3
    (22, 20 fed): 32 (.252), 33 (.0315), 30 (.21), 31 (.06). The best five:
    10 .6, 11 .35, 22 .315, 20 .30, 32 .252 -- 21 (.24) and 30 (.21) miss."""
    head = FakeHead(HAND)
    draft, c = run(head, depth=3, topk=2, max_nodes=5)
    assert draft.tokens.tolist() == [10, 11, 22, 20, 32]
    assert draft.parents.tolist() == [-1, -1, 1, 0, 2]
    np.testing.assert_allclose(draft.scores, [0.6, 0.35, 0.315, 0.30, 0.252], rtol=1e-6)
    # feeding: depth 1 as the root gave it, then depth 2's frontier best first,
    # parents by feeding index (10 -> 0, 11 -> 1)
    assert head.calls == [("expand", [10, 11], [-1, -1], 2),
                          ("expand", [22, 20], [1, 0], 2)]
    assert c["expand_calls"] == 2 and c["nodes_fed"] == 4 and c["candidates"] == 10


def test_hand_worked_tree_smaller_budgets_prune_exactly():
    # 3 nodes: 10, 11, 22. After depth 1 there are fewer than 3 candidates,
    # so both are fed; after depth 2 the 3rd best score is .315 (22), which
    # no depth-2 frontier node (22 .315, 20 .30) beats: nothing below them
    # can be drafted, so depth 3 is never expanded.
    head = FakeHead(HAND)
    draft, c = run(head, depth=3, topk=2, max_nodes=3)
    assert draft.tokens.tolist() == [10, 11, 22] and draft.parents.tolist() == [-1, -1, 1]
    assert c["expand_calls"] == 1
    # 1 node: the root's best, no head call beyond the root
    head = FakeHead(HAND)
    draft, c = run(head, depth=3, topk=2, max_nodes=1)
    assert draft.tokens.tolist() == [10] and c["expand_calls"] == 0
    # depth 1: the root's top-k only
    head = FakeHead(HAND)
    draft, c = run(head, depth=1, topk=2, max_nodes=8)
    assert draft.tokens.tolist() == [10, 11] and c["expand_calls"] == 0


def test_hand_worked_auto_budget():
    """"auto": best_node_count over the scores; with a relative token cost of
    0.25, nodes worth <= .25 never pay (and are not fed)."""
    head = FakeHead(HAND)
    draft, c = run(head, depth=3, topk=2, max_nodes=64, token_cost=0.25)
    values = np.array([0.6, 0.35, 0.315, 0.30, 0.252])
    n = best_node_count(values, 0.25, 5)
    assert draft.tokens.tolist() == [10, 11, 22, 20, 32][:n]
    assert c["expand_calls"] == 2
    # a cost the best node cannot pay: no draft, and the head is never expanded
    head = FakeHead(HAND)
    draft, c = run(head, depth=3, topk=2, max_nodes=64, token_cost=0.7)
    assert len(draft) == 0 and c["expand_calls"] == 0


def test_call_cost_stops_expanding_when_a_depth_cannot_pay():
    head = FakeHead(HAND)
    draft, c = run(head, depth=3, topk=2, max_nodes=64, token_cost=0.01, call_cost=100.0)
    assert c["expand_calls"] == 0 and draft.tokens.tolist() == [10, 11]
    free, _ = run(FakeHead(HAND), depth=3, topk=2, max_nodes=64, token_cost=0.01)
    cheap, c = run(FakeHead(HAND), depth=3, topk=2, max_nodes=64, token_cost=0.01,
                   call_cost=1e-6)
    assert c["expand_calls"] == 2 and paths(cheap) == paths(free)


# ---------------------------------------------------------------------- properties
@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10**6), depth=st.integers(1, 6), topk=st.integers(1, 6),
       max_nodes=st.integers(1, 40), ties=st.booleans())
def test_properties_against_brute_force(seed, depth, topk, max_nodes, ties):
    head = random_head(seed, ties=ties)
    draft, c = run(head, depth, topk, max_nodes)
    ref = reference(head, depth, topk)
    best = ref[:max_nodes]
    n = len(draft)
    assert n == len(best) <= max_nodes
    # the kept scores are the best-N of all candidates EAGLE-2 generates
    np.testing.assert_allclose(np.sort(np.log(draft.scores.astype(np.float64)))[::-1],
                               [s for s, *_ in best], rtol=1e-5, atol=1e-5)
    if len(ref) == len(best) or ref[len(best)][0] < best[-1][0] - 1e-9:
        if not ties:
            assert set(paths(draft)) == {p for *_, p in best}
    # scores are exp(cumulative log-prob) along each path
    for path, s in zip(paths(draft), draft.scores):
        lp = 0.0
        for i, t in enumerate(path):
            lp += math.log(dict(head.children(path[:i]))[t])
        assert s == pytest.approx(math.exp(lp), rel=1e-4)
    # parents first (Draft checks it), ancestor-closed, best first, depth <= depth
    parents = draft.parent_array()
    assert all(parents[i] < i for i in range(n))
    assert np.all(np.diff(draft.scores) <= 1e-6)
    if n:
        assert draft.depths().max() <= depth
    # siblings never repeat a token
    assert len(set(zip(parents.tolist(), draft.tokens.tolist()))) == n
    # head work: at most depth - 1 expand calls, at most topk nodes each
    assert c["expand_calls"] <= max(depth - 1, 0)
    assert all(len(call[1]) <= topk for call in head.calls)
    assert c["closure_repairs"] == 0


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10**6), depth=st.integers(1, 6), topk=st.integers(1, 6),
       cost=st.floats(0.0, 0.6))
def test_auto_budget_matches_brute_force(seed, depth, topk, cost):
    cap = 64
    head = random_head(seed)
    draft, c = run(head, depth, topk, cap, token_cost=cost)
    ref = reference(head, depth, topk)[:cap]
    values = np.exp([s for s, *_ in ref])
    n = best_node_count(values, cost, len(values))
    assert len(draft) == n
    if n:
        np.testing.assert_allclose(draft.scores, values[:n], rtol=1e-5)


def test_auto_budget_feeds_no_node_below_the_cost():
    head = random_head(7)
    run(head, 6, 10, 64, token_cost=0.2)
    assert head.calls
    for path in head._fed:
        p = 1.0
        for i, t in enumerate(path):
            p *= dict(head.children(path[:i]))[t]
        assert p > 0.2 - 1e-6


def test_frontier_width_and_depth_are_capped_by_the_budget():
    head = random_head(3)
    draft, c = run(head, depth=16, topk=32, max_nodes=4)
    assert head.roots == 1
    assert c["expand_calls"] <= 3
    assert all(call[3] <= 4 and len(call[1]) <= 4 for call in head.calls)


def test_dirty_head_output_is_cleaned():
    counters = Counter()
    ids, lps = clean_children(np.array([5, 7, 5, 99, 3, -1]),
                              np.array([-1.0, np.nan, -0.5, -0.1, 1e-7, -0.2]), 8,
                              vocab_size=64, counters=counters)
    assert ids.tolist() == [3, 5] and lps.tolist() == [0.0, -0.5]
    assert counters["invalid_children"] == 3 and counters["duplicate_children"] == 1


def test_rerank_repairs_a_broken_closure():
    # node 1 (child of 0) scores higher than its parent: a head bug
    score = np.array([-2.0, -0.1, -0.5, -3.0])
    depth = np.array([1, 2, 1, 1])
    parent = np.array([-1, 0, -1, -1])
    counters = Counter()
    keep = rerank(score, depth, parent, 2, counters)
    assert keep.tolist() == [2, 0] and counters["closure_repairs"] == 1
    # ties: a certain child (log-prob 0) comes after its parent
    keep = rerank(np.array([-0.5, -0.5]), np.array([2, 1]), np.array([1, -1]), 2)
    assert keep.tolist() == [1, 0]


def test_path_length():
    d = Draft(np.array([10, 11, 22, 20, 32]), np.array([-1, -1, 1, 0, 2]))
    assert path_length(d, [11, 22, 32]) == 3
    assert path_length(d, [10, 22]) == 1
    assert path_length(d, [5]) == 0


# ---------------------------------------------------------------------- proposer
def _proposer(k=5, **kw):
    kw.setdefault("depth", 3)
    kw.setdefault("topk", 2)
    p = Eagle2Proposer(k, model="/head", **kw)
    head = FakeHead(HAND)
    p.bind_target(head)
    return p, head


def test_proposer_drafts_the_hand_tree_and_learns_acceptance():
    p, head = _proposer()
    p.start("a", [1, 2, 3])
    d = p.propose("a", 8)
    assert d.tokens.tolist() == [10, 11, 22, 20, 32]
    # the target accepts 11, 22, then commits its own 40
    p.observe("a", [11, 22, 40])
    s = p.debug_stats()
    assert s["accepted"] == 2 and s["verified_steps"] == 1
    assert s["accept_at_depth"] == {"1": 1.0, "2": 1.0, "3": 0.0}
    assert s["head_calls"] == 3 and s["mean_tree_size"] == 5.0
    assert s["mean_expected"] == pytest.approx(0.6 + 0.35 + 0.315 + 0.30 + 0.252, abs=1e-3)
    # nothing accepted: the bonus token alone
    p.propose("a", 8)
    p.observe("a", [10])
    assert p.debug_stats()["accept_at_depth"]["1"] == 0.5
    p.finish("a")
    assert head.released == ["a"] and p.active_requests() == 0


def test_proposer_budget_cut_and_restart():
    p, head = _proposer()
    p.start("a", [1, 2, 3])
    assert len(p.propose("a", 2)) == 2      # the engine's budget caps the tree
    p.propose("a", 8)
    p.draft_cut("a", Draft(np.array([10]), np.array([-1]), np.array([0.6])))
    p.observe("a", [10, 21, 5])             # 21 was cut: only 10 counts
    assert p.debug_stats()["accepted"] == 1 and p.debug_stats()["nodes_cut"] == 4
    p.start("a", [1, 2, 3, 10, 21, 5])      # rebuilt: the head forgets its state
    assert head.released == ["a"]
    p.start("b", [7])                        # new: nothing to forget
    assert head.released == ["a"]


def test_proposer_unbound_and_auto():
    p = Eagle2Proposer(64, model="/head")
    p.start("a", [1])
    assert len(p.propose("a", 8)) == 0 and p.debug_stats()["unbound"] == 1
    p, head = _proposer(64, auto_budget=True)
    p.relative_token_cost = 0.7
    p.start("a", [1])
    assert len(p.propose("a", 64)) == 0 and not head.calls
    p.relative_token_cost = 0.25
    assert len(p.propose("a", 64)) == best_node_count(
        np.array([0.6, 0.35, 0.315, 0.30, 0.252]), 0.25, 5)


def test_bind_target_checks_the_hook():
    with pytest.raises(TypeError, match="expand"):
        Eagle2Proposer(8, model="/h").bind_target(object.__new__(type("H", (), {
            "root": lambda *a: None, "release": lambda *a: None})))


# ---------------------------------------------------------------------- config
@pytest.fixture
def head_dir(tmp_path, monkeypatch):
    """A head folder with the files the basic check wants (the real checker
    of vllm_specplug.eagle, if installed, is replaced by the basic one)."""
    monkeypatch.setattr(folders, "_head_checker", lambda: None)
    d = tmp_path / "head"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": 576, "vocab_size": 49152}))
    (d / "model.safetensors").write_bytes(b"")
    return d


def test_registered():
    assert {"eagle2", "sam_eagle2"} <= set(proposer_names())
    assert get_proposer_class("eagle2") is Eagle2Proposer
    assert get_proposer_class("sam_eagle2") is SamEagle2Proposer
    for cls in (Eagle2Proposer, SamEagle2Proposer):
        assert cls.drafts_trees and cls.supports_tensor_parallel and cls.takes_model_path
        assert cls.target_hook == "vllm_specplug.vllm_adapter.v1.eagle_runner:make_eagle_hook"


def test_model_key_accepted_for_eagle_methods(head_dir):
    for method in ("eagle2", "sam_eagle2"):
        vllm_kwargs, plugin = translate({"method": method, "model": str(head_dir),
                                         "depth": 4, "topk": 8})
        assert vllm_kwargs["num_speculative_tokens"] == 64 and plugin["auto_budget"]
        assert plugin["options"]["model"] == str(head_dir)
        p = build_proposer(plugin)
        eagle = p if method == "eagle2" else p.eagle
        assert (eagle.depth, eagle.topk, eagle.auto_budget, eagle.k) == (4, 8, True, 64)
    _, plugin = translate({"method": "eagle2", "model": str(head_dir),
                           "num_speculative_tokens": 12})
    p = build_proposer(plugin)
    assert (p.k, p.auto_budget, p.depth, p.topk) == (12, False, 6, 10)


def test_relative_model_path_becomes_absolute(head_dir, monkeypatch):
    monkeypatch.chdir(head_dir.parent)
    _, plugin = translate({"method": "eagle2", "model": "head"})
    assert plugin["options"]["model"] == str(head_dir)


@pytest.mark.parametrize("method", ["sam", "token_recycling", "sam_tr", "del"])
def test_model_key_still_refused_for_others(method, head_dir):
    with pytest.raises(SpecPlugConfigError, match=r"\['model'\].*remove it"):
        translate({"method": method, "model": str(head_dir)})


@pytest.mark.parametrize("method", ["eagle2", "sam_eagle2"])
@pytest.mark.parametrize("key,value", [("depth", 0), ("depth", 17), ("depth", "6"),
                                       ("topk", 0), ("topk", 33), ("topk", 2.5),
                                       ("model", 5)])
def test_bad_values_name_the_key(method, key, value, head_dir):
    spec = {"method": method, "model": str(head_dir), key: value}
    with pytest.raises(SpecPlugConfigError, match=rf"\[{key!r}\]"):
        translate(spec)


@pytest.mark.parametrize("method", ["eagle2", "sam_eagle2"])
def test_bad_head_folders(method, head_dir, tmp_path):
    def refused(model, must):
        spec = {"method": method} if model is None else {"method": method, "model": model}
        with pytest.raises(SpecPlugConfigError) as info:
            translate(spec)
        assert "['model']" in str(info.value) and must in str(info.value)
        assert repr(method) in str(info.value)

    refused(None, "required")
    refused(str(tmp_path / "nope"), "no such folder")
    (tmp_path / "f").write_text("x")
    refused(str(tmp_path / "f"), "is a file")
    (head_dir / "model.safetensors").unlink()
    refused(str(head_dir), "no weights")
    (head_dir / "pytorch_model.bin").write_bytes(b"")
    translate({"method": method, "model": str(head_dir)})
    (head_dir / "config.json").write_text("{not json")
    refused(str(head_dir), "config.json")


def test_head_checker_of_the_eagle_package_is_used(head_dir, monkeypatch):
    seen = []

    def checker(path, target):
        seen.append((path, target))
        raise ValueError("hidden_size missing")

    monkeypatch.setattr(folders, "_head_checker", lambda: checker)
    with pytest.raises(SpecPlugConfigError, match=r"\['model'\].*hidden_size missing"):
        translate({"method": "eagle2", "model": str(head_dir)})
    assert seen == [(str(head_dir), None)]
    # against the target: the target's config dict is handed over
    seen.clear()
    target = head_dir.parent / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"hidden_size": 8}))
    monkeypatch.setattr(folders, "_head_checker",
                        lambda: lambda path, cfg: seen.append((path, cfg)))
    for method in ("eagle2", "sam_eagle2"):
        translate({"method": method, "model": str(head_dir)}, tokenizer=str(target))
    assert seen == [(str(head_dir), None), (str(head_dir), {"hidden_size": 8})] * 2


def test_head_against_target_model(head_dir, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"hidden_size": 576, "vocab_size": 49152}))
    translate({"method": "eagle2", "model": str(head_dir)}, tokenizer=str(target))
    (target / "config.json").write_text(json.dumps({"hidden_size": 4096, "vocab_size": 49152}))
    for method in ("eagle2", "sam_eagle2"):
        with pytest.raises(SpecPlugConfigError, match=r"\['model'\].*hidden_size 576.*4096"):
            translate({"method": method, "model": str(head_dir)}, tokenizer=str(target))
    # a hub name (no local config.json) is not checked here
    translate({"method": "eagle2", "model": str(head_dir)}, tokenizer="some/hub-model")


def test_sam_eagle2_keys(head_dir):
    _, plugin = translate({"method": "sam_eagle2", "model": str(head_dir),
                           "sam_eagle2_threshold": 7, "sam_eagle2_merge": False,
                           "sam_continuation": "first"})
    p = build_proposer(plugin)
    assert p.threshold == 7 and not p.merge and p.sam.continuation == "first"
    with pytest.raises(SpecPlugConfigError, match="sam_eagle2_threshold"):
        translate({"method": "sam_eagle2", "model": str(head_dir), "sam_eagle2_threshold": 0})
    with pytest.raises(SpecPlugConfigError, match="unknown key 'tr_topk'"):
        translate({"method": "sam_eagle2", "model": str(head_dir), "tr_topk": 4})


# ---------------------------------------------------------------------- sam_eagle2
def _hybrid(**kw):
    p = SamEagle2Proposer(8, model="/head", depth=3, topk=2, sam_min_accept_prob=0.0, **kw)
    head = FakeHead(HAND)
    p.bind_target(head)
    assert p.eagle.hook is head
    return p, head


def test_sam_eagle2_long_match_drafts_sams_chain_else_eagles_tree():
    p, head = _hybrid(sam_eagle2_threshold=3, sam_eagle2_merge=False)
    text = [5, 6, 7, 8, 9, 50, 51, 5, 6, 7, 8]          # suffix 5 6 7 8 seen before
    p.start("a", text)
    assert p.match_len("a") == 4
    d = p.propose("a", 8)
    assert d.is_chain and d.tokens[:3].tolist() == [9, 50, 51]
    assert head.roots == 0                               # the head was not asked
    p.observe("a", [9, 50, 51, 52])
    p.start("b", [40, 41, 8])                            # short match: EAGLE-2's tree
    d = p.propose("b", 8)
    assert head.roots == 1 and d.tokens.tolist() == [10, 11, 22, 20, 32, 21, 30, 31]
    p.observe("b", [10, 20, 3])
    s = p.debug_stats()
    assert s["sam_steps"] == 1 and s["sam_tau"] == 4.0
    assert s["eagle2_steps"] == 1 and s["eagle2_tau"] == 3.0
    assert s["eagle2"]["accepted"] == 2
    p.finish("a")
    p.finish("b")
    assert head.released == ["a", "b"] and p.active_requests() == 0


def test_sam_eagle2_merges_sams_short_chain():
    p, head = _hybrid(sam_eagle2_threshold=5, sam_continuation="first", sam_spec_factor=1.0)
    p.start("a", [1, 2, 3, 9, 9, 1, 2])                  # match "1 2" (length 2) -> 3 9
    d = p.propose("a", 8)
    got = set(paths(d))
    assert {(3,), (3, 9)} <= got                         # SAM's chain
    assert {(10,), (11,), (11, 22)} <= got               # EAGLE-2's best nodes
    assert len(d) <= 8
    assert p.debug_stats()["merged_sam_nodes"] == 2
    p.observe("a", [3, 9, 4])
    assert p.debug_stats()["eagle2_steps"] == 1


def test_sam_tr_is_unchanged_by_the_generalisation():
    from vllm_specplug.proposers.hybrid import SamTokenRecyclingProposer

    p = SamTokenRecyclingProposer(8)
    assert p.tr is p.fallback and p.wants_target_topk and p.target_topk_k == 8
    assert SamTokenRecyclingProposer.target_hook is None
    assert not SamTokenRecyclingProposer.takes_model_path
    assert set(p.debug_stats()) >= {"sam_steps", "tr_steps", "none_steps", "tr_tau",
                                    "token_recycling", "merged_sam_nodes"}
