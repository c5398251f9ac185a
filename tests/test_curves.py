"""``bench.curves``: baselines replayed as vLLM drives them, cost lines, records."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_specplug.bench import curves as C
from vllm_specplug.bench.simulate import replay, replay_many
from vllm_specplug.proposers.base import Draft


def _vllm_ngram_function():
    """vLLM 0.32's own prompt-lookup function, read from its source and run
    as plain Python (importing vLLM takes ~10-25 s here)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM not installed")
    path = Path(spec.submodule_search_locations[0]) / "v1" / "spec_decode" / "ngram_proposer.py"
    tree = ast.parse(path.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
              and n.name == "_find_longest_matched_ngram_and_propose_tokens")
    fn.decorator_list = []
    ns = {"np": np}
    exec(compile(ast.Module([fn], []), str(path), "exec"), ns)
    return ns[fn.name]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=40), st.integers(1, 3),
       st.integers(0, 3), st.integers(1, 9))
def test_ngram_rule_is_vllms(tokens, min_n, extra, k):
    vllm_fn = _vllm_ngram_function()
    max_n = min_n + extra
    want = vllm_fn(np.asarray(tokens, dtype=np.int32), min_n, max_n, 4096, k).tolist()
    assert C.ngram_draft(tokens, min_n, max_n, k) == want


def test_ngram_hand_example():
    # last 3 tokens 1 2 3 occur at 0 (earliest) and 4: draft what followed 0
    assert C.ngram_draft([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2, 5, 3) == [9, 1, 2]
    assert C.ngram_draft([1, 2, 3, 4], 2, 5, 3) == []            # no repeat
    assert C.ngram_draft([5, 5], 1, 5, 4) == [5]                  # up to the end only


def test_suffix_baseline_uses_earlier_responses():
    """vLLM's suffix: a request drafts from an earlier request's response
    (the global cache); the first one cannot (its prompt is unrelated)."""
    answer = list(range(100, 140))
    prop = C.SuffixBaseline(8)
    first = replay(prop, [1, 2, 3], answer, 8, req_id="a")
    assert first["accepted"] == 0 and prop.active_requests() == 0
    second = replay(prop, [4, 5, 6], answer, 8, req_id="b")
    assert second["accepted"] >= 30, second
    assert second["draft_tokens"] <= 8 * second["drafts"]


def test_suffix_baseline_matches_the_arctic_cache_driven_directly():
    """The same drafts as SuffixDecodingCache driven as vLLM 0.32 drives it."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    rng = np.random.default_rng(0)
    reqs = [(rng.integers(0, 6, 20).tolist(), rng.integers(0, 6, 40).tolist())
            for _ in range(3)]
    ours = C.SuffixBaseline(5)
    cache = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=10000)
    for i, (prompt, out) in enumerate(reqs):
        rid = f"r{i}"
        ours.start(rid, prompt + out[:1])
        cache.start_request(rid, prompt)
        cache.add_active_response(rid, out[:1])
        ctx = prompt + out[:1]
        for j in range(1, len(out)):
            want = cache.speculate(rid, ctx[-24:], max_spec_tokens=5, max_spec_factor=1.0,
                                   min_token_prob=0.1).token_ids
            assert ours.propose(rid, 5).tokens.tolist() == list(want)
            ours.observe(rid, [out[j]])
            cache.add_active_response(rid, [out[j]])
            ctx.append(out[j])
        ours.finish(rid)
        cache.stop_request(rid)


def test_cost_line_speedup():
    line = C.CostLine(10.0, 1.0)
    assert line.speedup(1.0, 0.0) == 1.0
    # tau 2 with 4 nodes: 2 * 11 / 15
    assert line.speedup(2.0, 4.0) == pytest.approx(22 / 15)
    flat = C.gpu_like_cost_line()
    assert flat.cost(65) - flat.cost(1) == pytest.approx(0.1 * flat.a)   # 64 tokens: 10%
    pts = [{"budget": 1, "tau": 1.2, "nodes_per_step": 1.0},
           {"budget": 8, "tau": 1.5, "nodes_per_step": 6.0}]
    assert C.best_budget(pts, line)["budget"] == 1      # 1.2*11/12=1.10 > 1.5*11/17=0.97
    assert C.best_budget(pts, flat)["budget"] == 8


def test_cpu_line_fits_the_measured_points():
    line = C.cpu_cost_line()
    a, b, r2 = C.fit_line([(1, 3.0), (2, 5.0), (4, 9.0)])
    assert (a, b, r2) == pytest.approx((1.0, 2.0, 1.0))
    assert 55 < line.a < 80 and 3 < line.b < 7   # ~70 ms a step, ~4-7 ms a token
    assert "R^2" in line.source


def test_load_cost_line_formats(tmp_path):
    p = tmp_path / "line.json"
    p.write_text(json.dumps({"a": 2.0, "b": 0.5}))
    assert (C.load_cost_line(str(p)).a, C.load_cost_line(str(p)).b) == (2.0, 0.5)
    g = tmp_path / "gpu_checks.json"
    g.write_text(json.dumps({"verify_cost": {"fits": {
        "1024/1": {"a_ms": 20.0, "b_ms_per_token": 0.01},
        "4096/8": {"a_ms": 30.0, "b_ms_per_token": 0.2}}}}))
    assert C.load_cost_line(str(g)).b == 0.01
    line = C.load_cost_line(f"{g}:4096/8")
    assert (line.a, line.b) == (30.0, 0.2) and "4096/8" in line.source
    with pytest.raises(ValueError, match="no verify_cost fit"):
        C.load_cost_line(f"{g}:1/1")
    p.write_text(json.dumps({"a": -1.0, "b": 0.5}))
    with pytest.raises(ValueError, match="implausible"):
        C.load_cost_line(str(p))


def _write_records(tmp_path, rows, k=2):
    rec = tmp_path / "r.jsonl"
    rec.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ids = np.concatenate([np.stack([r["output_ids"], [0] * len(r["output_ids"])], 1)
                          for r in rows]).astype(np.int32)
    offsets = np.cumsum([0] + [len(r["output_ids"]) for r in rows])
    npz = tmp_path / "t.npz"
    np.savez(npz, ids=ids, logprobs=np.zeros(ids.shape, np.float16), offsets=offsets,
             argmax_agrees=np.zeros(len(rows), np.int32), k=np.int32(k))
    return rec, npz


def test_load_records_halves_and_topk(tmp_path):
    rows = [{"pos": i, "prompt_ids": [1, 2], "output_ids": [3 + i] * (i + 1)} for i in range(4)]
    rec, npz = _write_records(tmp_path, rows)
    odd = C.load_records(rec, npz, "odd")
    assert [r["pos"] for r in odd] == [1, 3]
    assert odd[1]["topk"][0][:, 0].tolist() == [6, 6, 6, 6]
    assert [r["pos"] for r in C.load_records(rec, None, "even")] == [0, 2]
    bad = tmp_path / "bad.npz"
    np.savez(bad, ids=np.zeros((3, 2)), logprobs=np.zeros((3, 2)), offsets=np.array([0, 3]))
    with pytest.raises(ValueError, match="top-k of 1 records"):
        C.load_records(rec, bad)


def test_token_recycling_learns_from_the_fed_topk(tmp_path):
    """With the target's top-k fed, Token Recycling drafts a repeated answer
    from its matrix; without it, only from the prompt's bigrams."""
    answer = list(range(200, 240))
    rows = [{"pos": 1, "prompt_ids": [1, 2, 3], "output_ids": answer},
            {"pos": 3, "prompt_ids": [4, 5, 6], "output_ids": answer}]
    rec, npz = _write_records(tmp_path, rows)
    with_topk = C.curve("token_recycling", C.load_records(rec, npz), [4])[0]
    without = C.curve("token_recycling", C.load_records(rec, None), [4])[0]
    assert without["accepted"] == 0
    # rows learned along the path: multi-token acceptance (the template's
    # greedy path is 3 deep at budget 4 under the prior rank rates)
    assert with_topk["tau"] > 1.5 and with_topk["accepted"] >= 25


def test_curve_all_methods_small(tmp_path):
    rng = np.random.default_rng(1)
    base = rng.integers(10, 30, 30).tolist()
    rows = [{"pos": 2 * i + 1, "prompt_ids": base[:10], "output_ids": base + base[:10]}
            for i in range(2)]
    rec, npz = _write_records(tmp_path, rows)
    recs = C.load_records(rec, npz)
    for m in C.METHODS:
        pts = C.curve(m, recs, [1, 4])
        for p in pts:
            assert p["generated"] == 80 and p["steps"] + p["accepted"] == 80
            assert p["nodes_per_step"] <= p["budget"]
        # the second request repeats the first: every method drafts something
        assert pts[1]["accepted"] > 0, m
    res = replay_many(C.METHODS["sam"][0](4), C.requests_of(recs), 4)
    assert res["tau"] == pytest.approx(C.curve("sam", recs, [4])[0]["tau"])


def test_curve_tau_by_category_sums_its_requests(tmp_path):
    rows = [{"pos": 1, "category": "a", "prompt_ids": [1, 2, 3], "output_ids": [1, 2, 3] * 5},
            {"pos": 3, "category": "b", "prompt_ids": [7, 8], "output_ids": [9, 10, 11, 12]},
            {"pos": 5, "category": "a", "prompt_ids": [4], "output_ids": [5, 6]}]
    pt = C.curve("sam", rows, [4])[0]
    each: list = []
    replay_many(C.METHODS["sam"][0](4), C.requests_of(rows), 4, per_request=each)
    assert [e["generated"] for e in each] == [15, 4, 2]
    assert pt["tau_by_category"]["a"] == pytest.approx(17 / (each[0]["steps"] + each[2]["steps"]))
    assert pt["tau_by_category"]["b"] == pytest.approx(4 / each[1]["steps"]) == 1.0
    assert pt["tau"] == pytest.approx(21 / sum(e["steps"] for e in each))


def test_curve_hands_the_relative_token_cost_to_the_proposer():
    seen = []

    def make(n):
        p = C.METHODS["sam"][0](n)
        seen.append(p)
        return p

    rows = [{"pos": 1, "prompt_ids": [1, 2, 3, 4], "output_ids": [1, 2, 3, 4] * 6}]
    C.curve("sam", rows, [8], factory=make, relative_token_cost=0.5)
    C.curve("sam", rows, [8], factory=make)
    assert seen[0].relative_token_cost == 0.5
    assert seen[1].relative_token_cost == type(seen[1]).relative_token_cost
    line = C.CostLine(3.0, 1.0)
    assert line.relative_token_cost == 0.25


class _Truth(C.NgramBaseline):
    """Drafts the true continuation of ``outputs[req_id]`` (for the oracle test)."""

    def __init__(self, outputs: dict, k: int) -> None:
        super().__init__(k)
        self.outputs, self.k_true = outputs, k

    def start(self, req_id, token_ids):
        super().start(req_id, token_ids)
        self.base = len(token_ids) - 1   # the prompt's length: the first output is in

    def propose(self, req_id, budget):
        done = len(self._tokens[req_id]) - self.base
        return Draft.chain(self.outputs[req_id][done:done + min(budget, self.k_true)])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=12),
                          st.lists(st.integers(0, 3), min_size=1, max_size=30)),
                min_size=1, max_size=3), st.integers(1, 6))
def test_oracle_replay_bounds(requests, k):
    """One source: the oracle is that source's replay (its accepted tokens
    are what it verifies). With a source drafting the truth it reaches the
    most a k-token budget allows, k + 1 tokens a step, whatever else is
    offered; it never verifies a rejected node."""
    single = C.oracle_replay({"ngram": C.NgramBaseline(k)}, requests, k)
    plain = replay_many(C.NgramBaseline(k), requests, k)
    assert single["steps"] == plain["steps"]
    assert single["nodes_per_step"] * single["steps"] == pytest.approx(plain["accepted"])
    outputs = {f"r{i}": list(r[1]) for i, r in enumerate(requests)}
    both = C.oracle_replay({"ngram": C.NgramBaseline(k), "truth": _Truth(outputs, k)},
                           requests, k)
    assert both["steps"] == sum(1 + -(-(len(o) - 1) // (k + 1)) for _, o in requests)
    gen = sum(len(o) for _, o in requests)
    assert both["nodes_per_step"] * both["steps"] == pytest.approx(gen - both["steps"])
    assert both["steps"] <= single["steps"]
