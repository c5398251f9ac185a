"""SpecPlugDrafter driven as vLLM's runner would, without vLLM.

The worker patch (which imports vLLM's GPU model runner) is replaced by a
no-op; the runner's per-step call is simulated with numpy arrays.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
from types import SimpleNamespace

import vllm_specplug.vllm_adapter.v1 as adapter
from helpers import arrays, fake_vllm_config, make_vllm_config, step
from vllm_specplug.config import translate
from vllm_specplug.proposers.base import Draft
from vllm_specplug.proposers.sam import SamProposer
from vllm_specplug.vllm_adapter.v1.drafter import SpecPlugDrafter

K = 4  # helpers.make_vllm_config's default num_speculative_tokens


@pytest.fixture
def drafter(patch_calls):
    return SpecPlugDrafter(make_vllm_config())


def fresh_draft(history, k=K, **options) -> list[int]:
    prop = SamProposer(k, **options)
    prop.start("x", history)
    return prop.propose("x", k).tokens.tolist()


# ------------------------------------------------------------- construction
def test_construction(patch_calls):
    d = SpecPlugDrafter(make_vllm_config())
    assert patch_calls == [1]
    assert d.method == "sam"
    assert d.k == K
    assert isinstance(d.proposer, SamProposer)
    assert d.proposer.num_speculative_tokens == K
    stats = d.stats()
    assert stats.pop("step_cost")["samples"] == 0
    assert stats.pop("proposer")["dynamic_drafts"] == 0
    assert stats.pop("batch_budget") == {"steps": 0, "disabled_steps": 0,
                                         "nodes_proposed": 0, "nodes_kept": 0, "nodes_explored": 0,
                                         "nodes_past_max_tokens": 0}
    assert stats.pop("propose_time") == {"calls": 0, "rows": 0, "seconds": 0.0,
                                         "draft_tokens": 0}
    assert stats.pop("calibration") == {"ratio": 1.0, "settled": 0, "accepted": 0.0,
                                        "expected": 0.0}
    assert stats.pop("exploration") == {"settled": 0, "hits": 0.0, "tries": 0.0}
    # no scheduler output yet: the queue is unknown, so the batch never drains
    assert stats.pop("drain") == {"waiting": None, "refill": 0.0, "refills": 0, "expired": 0,
                                  "open": 0, "drain_steps": 0}
    assert stats.pop("faults") == {"requests": 0, "steps": 0, "hooks": {},
                                   "requests_without_drafts": 0}
    # the goodput controller and backoff: off by default, nothing recorded
    assert stats.pop("goodput") == {"enabled": False, "level": 1.0, "active": 1.0, "windows": 0,
                                    "probes": 0, "moves": 0,
                                    "scores": {"1.0": None, "0.5": None, "0.25": None,
                                               "0.0": None}, "recent_moves": []}
    assert stats.pop("backoff") == {"enabled": False, "requests": 0, "mutes": 0, "restored": 0,
                                    "muted_steps": 0}
    trim = stats.pop("malloc_trim")  # on where the C library is glibc; nothing trimmed yet
    from vllm_specplug.malloc_trim import glibc_trim

    assert (trim["on"], trim["calls"], trim["interval_s"]) == (
        glibc_trim()[0] is not None, 0, 60.0), trim
    sizes = stats.pop("sizes")  # every structure that grows with traffic: empty
    assert {"drafter_requests", "sam_requests", "sam_acceptance_cache"} <= set(sizes)
    assert set(sizes.values()) == {0}, sizes
    assert stats == {"active_requests": 0, "state_bytes": 0, "errors": 0, "trees_held": 0}
    target = object()
    d.load_model(target)
    assert d.target_model is target


def test_options_reach_the_proposer(patch_calls):
    d = SpecPlugDrafter(make_vllm_config(
        {"method": "sam", "num_speculative_tokens": 3, "sam_min_match_len": 4,
         "sam_spec_factor": 0.5}))
    assert (d.k, d.proposer.min_match_len, d.proposer.spec_factor) == (3, 4, 0.5)
    d = SpecPlugDrafter(make_vllm_config(
        {"method": "sam", "num_speculative_tokens": 5, "sam_continuation": "first",
         "sam_min_accept_prob": 0.25}))
    assert (d.k, d.proposer.continuation, d.proposer.min_accept_prob) == (5, "first", 0.25)
    assert d.proposer.acceptance.tried.shape[1] == 5


def test_missing_plugin_config_is_explained(patch_calls):
    for extra in (None, {}, {"other": 1}):
        cfg = fake_vllm_config(extra, 4)
        with pytest.raises(RuntimeError, match="method"):
            SpecPlugDrafter(cfg)


def test_tree_proposers_install_tree_patches_and_keep_parents(patch_calls, monkeypatch):
    import numpy as np

    import vllm_specplug.vllm_adapter.v1 as adapter
    from vllm_specplug.config import translate

    tree_calls = []
    monkeypatch.setattr(adapter, "install_tree_patches", lambda *a: tree_calls.append(1))
    _, plugin = translate({"method": "debug_random_tree", "num_speculative_tokens": 6})
    cfg = fake_vllm_config({"specplug": plugin}, 6)
    d = SpecPlugDrafter(cfg)
    assert tree_calls == [1]
    d.begin_step(["a"], None)
    num_tokens, token_ids = arrays([[1, 2, 3]])
    drafts = d.propose([[3]], num_tokens, token_ids)
    assert len(drafts[0]) == 6
    parents = d.trees["a"].parents
    assert parents.shape == (6,) and np.all(parents < np.arange(6))
    assert d.stats()["trees_held"] == 1
    d.finish_request("a")
    assert d.stats()["trees_held"] == 0 and d.stats()["active_requests"] == 0


class FakeTPGroup:
    """A tensor-parallel group of which this drafter is rank ``rank``; rank
    0's broadcast payload is recorded (rank 0) or replayed (other ranks)."""

    def __init__(self, rank: int, payload=None):
        self.rank_in_group = rank
        self.payload = payload

    def broadcast_object(self, obj, src=0):
        assert src == 0
        if self.rank_in_group == 0:
            self.payload = obj
            return obj
        return self.payload


def test_tensor_parallel_ranks_adopt_rank0_drafts_and_trees(patch_calls, monkeypatch):
    """Ranks whose own proposers drafted differently (here: other seeds, as
    per-rank step timings would make "auto" budgets differ) end the step with
    rank 0's drafts and tree parents."""
    import vllm_specplug.vllm_adapter.v1 as adapter

    monkeypatch.setattr(adapter, "install_tree_patches", lambda *a: None)

    def rank_drafter(seed, group):
        _, plugin = translate({"method": "debug_random_tree", "num_speculative_tokens": 6,
                               "random_seed": seed})
        cfg = fake_vllm_config({"specplug": plugin}, 6, tensor_parallel_size=2)
        d = SpecPlugDrafter(cfg)
        assert d._tp is True
        d._tp = group
        return d

    rank0 = rank_drafter(0, FakeTPGroup(0))
    rank1 = rank_drafter(1, FakeTPGroup(1))
    hist = [[1, 2, 3], [4, 5]]
    d0 = step(rank0, ["a", "b"], hist, [[3], [5]])
    rank1._tp.payload = rank0._tp.payload
    d1 = step(rank1, ["a", "b"], hist, [[3], [5]])
    assert d1 == d0
    for r in ("a", "b"):
        assert rank1.trees[r].tokens.tolist() == rank0.trees[r].tokens.tolist()
        assert rank1.trees[r].parents.tolist() == rank0.trees[r].parents.tolist()
    # rank 1's own proposer would have drafted something else
    own = rank_drafter(1, FakeTPGroup(0))
    assert step(own, ["a", "b"], hist, [[3], [5]]) != d0


def test_non_default_acceptance_routes_chains_to_the_tree_path(patch_calls, monkeypatch):
    import vllm_specplug.vllm_adapter.v1 as adapter
    from vllm_specplug.scorers import BlockScorer

    tree_calls = []
    monkeypatch.setattr(adapter, "install_tree_patches", lambda *a: tree_calls.append(1))
    d = SpecPlugDrafter(make_vllm_config({"method": "sam", "num_speculative_tokens": K,
                                          "acceptance": "block"}))
    assert isinstance(d.scorer, BlockScorer) and d.route_chains and tree_calls == [1]
    drafts = step(d, ["a"], [[1, 2, 3, 1, 2]], [[2]])
    assert drafts[0] and d.trees["a"].is_chain
    assert d.trees["a"].tokens.tolist() == drafts[0]
    plain = SpecPlugDrafter(make_vllm_config())
    assert plain.scorer is None and not plain.route_chains
    step(plain, ["a"], [[1, 2, 3, 1, 2]], [[2]])
    assert "a" not in plain.trees


def test_worker_with_another_plugin_version_refuses_to_start(patch_calls):
    cfg = make_vllm_config()
    cfg.additional_config["specplug"]["version"] = "0.0.0-other"
    with pytest.raises(RuntimeError, match="version mismatch.*0.0.0-other"):
        SpecPlugDrafter(cfg)


def test_propose_without_begin_step(drafter):
    num_tokens, token_ids = arrays([[1, 2, 1, 2]])
    with pytest.raises(RuntimeError, match="propose_draft_token_ids"):
        drafter.propose([[2]], num_tokens, token_ids)
    # begin_step is consumed by one propose call
    drafter.begin_step(["a"], None)
    drafter.propose([[2]], num_tokens, token_ids)
    with pytest.raises(RuntimeError):
        drafter.propose([[2]], num_tokens, token_ids)


# ------------------------------------------------------------------- drafts
def test_first_step_drafts(drafter):
    hist = [1, 2, 3, 4, 5, 1, 2, 3]
    drafts = step(drafter, ["a"], [hist], [[3]])
    assert drafts == [[4, 5, 1, 2]] == [fresh_draft(hist)]
    assert drafter.stats()["active_requests"] == 1
    assert drafter.stats()["state_bytes"] > 0


def test_rows_without_sampled_tokens_get_no_draft(drafter):
    hists = [[1, 2, 3, 1, 2], [7, 8, 7, 8], [5, 6, 5, 6]]
    drafts = step(drafter, ["a", "b", "c"], hists, [[2], [], [6]])
    assert drafts == [fresh_draft(hists[0]), [], fresh_draft(hists[2])]
    assert drafts[0] and drafts[2]
    # a row still prefilling holds no state yet, but is not freed either
    assert drafter.stats()["active_requests"] == 2


# Options under which a draft depends on the request's tokens alone (no
# learned cut), so a fresh proposer given the same history drafts the same.
# a draft that depends on the request's own history alone: no cut learned,
# and no other running request's output (sam_global_live)
STATELESS = [{"sam_min_accept_prob": 0.0, "sam_global_live": False},
             {"sam_continuation": "first", "sam_min_accept_prob": 0.0,
              "sam_global_live": False}]


@pytest.mark.parametrize("opts", STATELESS + [{}, {"sam_continuation": "first"}],
                         ids=["frequent", "first", "frequent-learned", "first-learned"])
def test_multi_step_simulation_matches_fresh_proposer(patch_calls, opts):
    """Several requests, drafts verified against a hidden 'true' continuation.

    The drafter's proposer must see exactly what a proposer driven directly
    (start with the prompt, then observe each step's committed tokens) sees:
    same drafts, same learned acceptance table. Without the learned cut, a
    fresh proposer given the history drafts the same too.
    """
    # (batch-aware budgets off: they would cut drafts the direct proposer keeps)
    drafter = SpecPlugDrafter(make_vllm_config(
        {"method": "sam", "num_speculative_tokens": K, "batch_budget": "off", **opts}))
    direct = SamProposer(K, **opts)
    stateless = opts.get("sam_min_accept_prob") == 0.0
    nonempty_drafts = 0
    rng = random.Random(7)
    # each request's full text: a noisy repetitive stream (so drafts get accepted)
    truth = {}
    for rid in ("a", "b", "c"):
        pattern = [rng.randrange(20) for _ in range(rng.randint(3, 9))]
        truth[rid] = [t if rng.random() > 0.1 else rng.randrange(20)
                      for t in (pattern * 40)[:200]]
    pos = {"a": 6, "b": 9, "c": 4}  # prompt lengths
    last_drafts = {rid: [] for rid in truth}
    order = ["a", "b", "c"]
    total_drafted = 0
    for it in range(40):
        if it == 20:
            order = ["c", "a", "b"]  # the batch is reordered (rows move)
        sampled, hists = [], []
        for rid in order:
            t = truth[rid]
            if it == 0:
                committed = [t[pos[rid] - 1]]  # prefill: the prompt, then its sample
            else:
                d, accepted = last_drafts[rid], 0
                while accepted < len(d) and d[accepted] == t[pos[rid] + accepted]:
                    accepted += 1
                committed = t[pos[rid]:pos[rid] + accepted + 1]  # accepted + bonus
                pos[rid] += accepted + 1
            sampled.append(list(committed))
            hists.append(t[:pos[rid]])
        drafts = step(drafter, order, hists, sampled)
        # the drafter hands its proposer the engine's measured token cost
        # each step (the default length rule reads it): the direct one too
        direct.relative_token_cost = drafter.proposer.relative_token_cost
        for rid, hist, committed, d in zip(order, hists, sampled, drafts):
            if it == 0:
                direct.start(rid, hist)
            else:
                direct.observe(rid, committed)
            assert len(d) <= K
            assert d == direct.propose(rid, K).tokens.tolist()
            if stateless:
                assert d == fresh_draft(hist, **opts)
            last_drafts[rid] = d
            total_drafted += len(d)
            nonempty_drafts += bool(d)
        assert drafter.stats()["active_requests"] == len(order)
        assert drafter.stats()["errors"] == 0
    assert total_drafted > 0
    tables = ("acceptance", "global_acceptance")   # the request's own text; the others'
    for table in tables:
        acc, ref = getattr(drafter.proposer, table), getattr(direct, table)
        assert np.array_equal(acc.tried, ref.tried)
        assert np.array_equal(acc.accepted, ref.accepted)
        assert np.array_equal(acc.proposals, ref.proposals)
    # every non-empty draft was learned from (one per step and request, but the
    # last step's drafts, which are never verified)
    tried = sum(getattr(drafter.proposer, t).tried for t in tables)
    accepted = sum(getattr(drafter.proposer, t).accepted for t in tables)
    assert tried[:, 0].sum() == nonempty_drafts - sum(1 for d in drafts if d)
    assert 0 < accepted.sum() <= tried.sum()


@pytest.mark.parametrize("opts, hist", [
    ({"sam_continuation": "first", "sam_min_accept_prob": 0.0}, [1, 2, 3] * 20),
    ({"sam_continuation": "first", "sam_min_accept_prob": 0.0}, list(range(10)) * 3),
    ({}, list(range(10)) * 3),  # "frequent": one period (10 tokens) follows the match
])
def test_drafts_never_exceed_k(patch_calls, opts, hist):
    for k in (1, 2, 4, 8):
        d = SpecPlugDrafter(make_vllm_config(
            {"method": "sam", "num_speculative_tokens": k, **opts}))
        drafts = step(d, ["a"], [hist], [[hist[-1]]])
        assert len(drafts[0]) == k
        assert drafts[0] == fresh_draft(hist, k=k, **opts)


def test_drafts_are_capped_even_if_the_proposer_overshoots(drafter, monkeypatch):
    monkeypatch.setattr(drafter.proposer, "propose",
                        lambda req_id, budget: Draft.chain(list(range(budget + 5))))
    drafts = step(drafter, ["a"], [[1, 2, 3]], [[3]])
    assert drafts == [[0, 1, 2, 3]]


def test_draft_values_are_python_ints(drafter):
    drafts = step(drafter, ["a"], [[1, 2, 3, 1, 2]], [[2]])
    # "frequent": 3 1 2 reaches the end of the text, then [1, 2] again: 3
    assert drafts == [[3, 1, 2, 3]]
    assert all(type(t) is int for t in drafts[0])


def test_only_new_tokens_are_observed(drafter, monkeypatch):
    calls = []
    orig_start, orig_observe = drafter.proposer.start, drafter.proposer.observe
    monkeypatch.setattr(drafter.proposer, "start",
                        lambda rid, toks: (calls.append(("start", list(toks))),
                                           orig_start(rid, toks)))
    monkeypatch.setattr(drafter.proposer, "observe",
                        lambda rid, toks, topk=None: (calls.append(("observe", list(toks))),
                                                      orig_observe(rid, toks)))
    step(drafter, ["a"], [[1, 2, 3]], [[3]])
    step(drafter, ["a"], [[1, 2, 3, 4, 5]], [[4, 5]])
    step(drafter, ["a"], [[1, 2, 3, 4, 5]], [[]])  # no sample: nothing observed
    step(drafter, ["a"], [[1, 2, 3, 4, 5, 1]], [[1]])
    assert calls == [("start", [1, 2, 3]), ("observe", [4, 5]), ("observe", [1])]


# --------------------------------------------------------- request life cycle
def test_request_leaving_the_batch_is_freed(drafter):
    hists = [[1, 2, 1, 2], [3, 4, 3, 4], [5, 6, 5, 6]]
    step(drafter, ["a", "b", "c"], hists, [[2], [4], [6]])
    assert drafter.stats()["active_requests"] == 3
    full_bytes = drafter.stats()["state_bytes"]
    # "b" finished: rows shift up
    drafts = step(drafter, ["a", "c"], [hists[0] + [1], hists[2] + [5]], [[1], [5]])
    assert drafts == [fresh_draft(hists[0] + [1]), fresh_draft(hists[2] + [5])]
    assert drafter.stats()["active_requests"] == 2
    assert drafter.stats()["state_bytes"] < full_bytes
    assert set(drafter.requests.running()) == {"a", "c"}
    # all left
    assert step(drafter, [], [], []) == []
    assert drafter.stats()["active_requests"] == 0
    assert drafter.stats()["state_bytes"] == 0


def test_returning_request_is_rebuilt(drafter):
    step(drafter, ["a"], [[1, 2, 1, 2]], [[2]])
    step(drafter, [], [], [])  # preempted: freed
    assert drafter.stats()["active_requests"] == 0
    hist = [1, 2, 1, 2, 1]
    assert step(drafter, ["a"], [hist], [[1]]) == [fresh_draft(hist)]
    assert drafter.stats()["active_requests"] == 1


def test_changed_last_token_at_same_count_rebuilds(drafter):
    old = [1, 2, 3, 9, 1, 2, 3]
    assert step(drafter, ["a"], [old], [[3]]) == [[9, 1, 2, 3]]
    # preemption + recomputation sampled something else at the same position
    new = [1, 2, 3, 9, 1, 2, 7]
    drafts = step(drafter, ["a"], [new], [[7]])
    assert drafts == [fresh_draft(new)] == [[]]
    # and the rebuilt state continues correctly
    newer = new + [1, 2, 3]
    assert step(drafter, ["a"], [newer], [[1, 2, 3]]) == [fresh_draft(newer)] == [[9, 1, 2, 7]]
    assert drafter.stats()["active_requests"] == 1


def test_changed_history_at_same_count_rebuilds_with_new_draft(drafter):
    old = [1, 2, 3, 7, 8, 9, 1, 2]
    assert step(drafter, ["a"], [old], [[2]]) == [[3, 7, 8, 9]]
    new = [1, 2, 3, 7, 8, 9, 8, 9]
    drafts = step(drafter, ["a"], [new], [[9]])
    assert drafts == [fresh_draft(new)] == [[8, 9, 8, 9]]


def test_shrunk_history_rebuilds(drafter):
    step(drafter, ["a"], [[4, 5, 6, 4, 5, 6, 4, 5]], [[5]])
    hist = [4, 5, 6, 4, 5]  # fewer tokens than seen: recomputation from scratch
    assert step(drafter, ["a"], [hist], [[5]]) == [fresh_draft(hist)] == [[6, 4, 5, 6]]


def test_changed_token_behind_new_tokens_rebuilds(drafter):
    step(drafter, ["a"], [[1, 2, 3, 4]], [[4]])
    # the token at the old last position differs: not an extension of what we saw
    hist = [1, 2, 3, 0, 1, 2]
    assert step(drafter, ["a"], [hist], [[1, 2]]) == [fresh_draft(hist)] == [[3, 0, 1, 2]]


# ------------------------------------------------------------------- errors
def _propose_raising_for(drafter, monkeypatch, bad: str):
    """Make the proposer's ``propose`` raise for request ``bad`` only;
    returns the original."""
    orig = drafter.proposer.propose

    def flaky(req_id, budget):
        if req_id == bad:
            raise ValueError("boom")
        return orig(req_id, budget)

    monkeypatch.setattr(drafter.proposer, "propose", flaky)
    return orig


def test_proposer_error_affects_only_its_request(drafter, monkeypatch, caplog):
    hists = [[1, 2, 3, 1, 2], [4, 5, 6, 4, 5], [7, 8, 9, 7, 8]]
    step(drafter, ["a", "b", "c"], hists, [[2], [5], [8]])
    assert drafter.stats()["active_requests"] == 3

    orig = _propose_raising_for(drafter, monkeypatch, "b")
    hists = [h + [h[2]] for h in hists]
    with caplog.at_level("ERROR", logger="vllm_specplug"):
        drafts = step(drafter, ["a", "b", "c"], hists, [[3], [6], [9]])
    assert drafts == [fresh_draft(hists[0]), [], fresh_draft(hists[2])]
    assert drafts[0] and drafts[2]
    assert drafter.stats()["errors"] == 1
    assert drafter.stats()["active_requests"] == 2  # b's state was dropped
    assert "b" not in drafter.requests.running()
    assert any("b" in r.getMessage() for r in caplog.records)

    # b decodes without drafts for the rest of its life (tests/test_faults.py),
    # the others draft on
    monkeypatch.setattr(drafter.proposer, "propose", orig)
    hists = [h + [h[0]] for h in hists]
    drafts = step(drafter, ["a", "b", "c"], hists, [[1], [4], [7]])
    assert drafts == [fresh_draft(hists[0]), [], fresh_draft(hists[2])]
    assert drafter.stats()["errors"] == 1
    assert drafter.stats()["active_requests"] == 2


def test_errors_accumulate(drafter, monkeypatch):
    def broken(req_id, budget):
        raise RuntimeError("always")

    monkeypatch.setattr(drafter.proposer, "propose", broken)
    for i in range(3):
        h = [1, 2] * (i + 2)
        assert step(drafter, ["a", "b"], [h, h], [[2], [2]]) == [[], []]
    assert drafter.stats()["errors"] == 2  # once each: then never called again
    assert drafter.stats()["active_requests"] == 0


def test_error_in_start_is_contained(drafter, monkeypatch):
    orig = drafter.proposer.start

    def bad_start(req_id, tokens):
        if req_id == "a":
            raise MemoryError("no room")
        orig(req_id, tokens)

    monkeypatch.setattr(drafter.proposer, "start", bad_start)
    drafts = step(drafter, ["a", "b"], [[1, 2, 1, 2], [3, 4, 3, 4]], [[2], [4]])
    assert drafts == [[], [3, 4, 3, 4]]
    assert drafter.stats()["errors"] == 1
    assert drafter.stats()["active_requests"] == 1


# ------------------------------------------------------------- max_tokens
class _Params:
    def __init__(self, max_tokens):
        self.max_tokens = max_tokens
        self.extra_args = None


class _State:
    def __init__(self, prompt_len, max_tokens):
        self.num_prompt_tokens = prompt_len
        self.lora_request = None
        self.sampling_params = None if max_tokens == "pooling" else _Params(max_tokens)


class _Runner:
    def __init__(self, states):
        self.requests = states


def _attach(d, states):
    """``d`` driven by a runner holding ``states``, its requests scheduled
    (their salts recorded, none) as vLLM's ``_update_states`` patch does."""
    d.runner = _Runner(states)
    d.note_scheduler_output(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, specplug_cache_salt=None) for r in states],
        total_num_scheduled_tokens=len(states), finished_req_ids=set()))


@pytest.mark.parametrize("generated, max_tokens, want", [
    (1, 20, 4),       # far from the end: the whole draft
    (1, 4, 2),        # 3 tokens left: 2 drafts and the step's own token
    (3, 4, 0),        # 1 left: the step's own token only, no draft
    (1, None, 4),     # no limit known
    (1, "pooling", 4)])
def test_chain_drafts_stop_at_max_tokens(patch_calls, generated, max_tokens, want):
    """The request's prompt is 8 tokens and ``generated`` of its tokens are
    output; drafts reach at most max_tokens - generated - 1 positions, and
    the proposer learns only from what is verified (``draft_cut``)."""
    hist = [1, 2, 3, 4, 1, 2, 3, 4] + [1, 2, 3, 4][:generated]
    d = SpecPlugDrafter(make_vllm_config())
    _attach(d, {"a": _State(8, max_tokens)})
    cuts = []
    orig = d.proposer.draft_cut
    d.proposer.draft_cut = lambda req_id, kept: (cuts.append(len(kept)), orig(req_id, kept))
    drafts = step(d, ["a"], [hist], [[hist[-1]]])
    full = fresh_draft(hist)
    assert len(full) == K
    assert drafts[0] == full[:want]
    assert cuts == ([want] if want < K else [])
    assert d.stats()["batch_budget"]["nodes_past_max_tokens"] == K - want
    pending = d.proposer._pending.get("a")
    assert (pending[2] if pending else []) == full[:want]


def test_tree_drafts_stop_at_max_tokens_by_depth(patch_calls, monkeypatch):
    """A tree keeps its nodes at depth <= max_tokens - generated - 1 (their
    ancestors with them), parents renumbered; the proposer hears of the cut."""
    from vllm_specplug.tree import depths

    monkeypatch.setattr(adapter, "install_tree_patches", lambda *a: None)
    _, plugin = translate({"method": "debug_random_tree", "num_speculative_tokens": 8})
    d = SpecPlugDrafter(fake_vllm_config({"specplug": plugin}, 8))
    _attach(d, {"a": _State(3, 5)})   # 2 generated below: room 5 - 2 - 1 = 2
    cuts = []
    d.proposer.draft_cut = lambda req_id, kept: cuts.append(kept)
    d.begin_step(["a"], None)
    num_tokens, token_ids = arrays([[1, 2, 3, 7, 9]])
    drafts = d.propose([[9]], num_tokens, token_ids)
    ref = type(d.proposer)(8)           # the same draft: deterministic in the context
    ref.start("a", [1, 2, 3, 7, 9])
    full = ref.propose("a", 8)
    deep = depths(full.parent_array())
    assert not full.is_chain and deep.max() > 2   # the test needs a tree to cut
    want = full.tokens[deep <= 2].tolist()
    assert drafts[0] == want and len(cuts) == 1 and cuts[0].tokens.tolist() == want
    kept = d.trees["a"]
    # the kept nodes' paths from the root are the full tree's
    paths = lambda t, parents: [tuple(_path(t, parents, i)) for i in range(len(t))]
    assert paths(kept.tokens, kept.parent_array()) == [
        p for p, dd in zip(paths(full.tokens, full.parent_array()), deep) if dd <= 2]
    assert d.stats()["batch_budget"]["nodes_past_max_tokens"] == int((deep > 2).sum())


def _path(tokens, parents, i):
    out = []
    while i >= 0:
        out.append(int(tokens[i]))
        i = int(parents[i])
    return out[::-1]


def test_proposers_size_drafts_by_a_rows_share_of_the_step(drafter):
    """With B decoding rows the proposer trades a verified token against one
    row's share of the step, B * b / (a + B * b), not against the whole step
    (which would draft B times too long for the batch budget to keep)."""
    step(drafter, ["a", "b", "c"], [[1, 2, 3], [4, 5, 6], [7, 8]], [[3], [6], []])
    a, b = drafter.step_cost.fit()
    assert drafter.proposer.relative_token_cost == pytest.approx(2 * b / (a + 2 * b))
    step(drafter, ["a"], [[1, 2, 3, 9]], [[9]])
    assert drafter.proposer.relative_token_cost == pytest.approx(b / (a + b))


def test_finish_frees_a_request_whatever_path_it_left_by(drafter, monkeypatch):
    """Finishing a request drops its cache salt and calls the proposer's
    ``complete`` once for it, whether it finished in the batch, after a
    preemption had already freed its state, or after a fault."""
    from types import SimpleNamespace as NS

    completed = []
    complete = drafter.proposer.complete
    monkeypatch.setattr(drafter.proposer, "complete",
                        lambda req_id: (completed.append(req_id), complete(req_id))[1])
    drafter.note_scheduler_output(NS(scheduled_new_reqs=[
        NS(req_id=r, specplug_cache_salt=f"salt-{r}") for r in ("a", "b", "c")],
        total_num_scheduled_tokens=3, finished_req_ids=set()))
    assert {"a", "b", "c"} <= set(drafter.requests.holding("salt"))
    hists = [[1, 2, 1, 2], [3, 4, 3, 4], [5, 6, 5, 6]]
    step(drafter, ["a", "b", "c"], hists, [[2], [4], [6]])
    step(drafter, ["b", "c"], [hists[1] + [3], hists[2] + [5]], [[3], [5]])  # "a" preempted
    assert drafter.requests.holding("preempted") == ["a"]
    assert "a" not in drafter.requests.running() and completed == []
    drafter.finish_request("a")
    assert completed == ["a"] and "a" not in drafter.requests
    drafter.finish_request("b")
    assert completed == ["a", "b"] and "b" not in drafter.requests
    _propose_raising_for(drafter, monkeypatch, "c")
    step(drafter, ["c"], [hists[2] + [5, 6]], [[6]])            # "c" faults, decodes on
    assert "c" in drafter.containment and "c" not in drafter.requests.running()
    drafter.finish_request("c")
    assert completed == ["a", "b", "c"] and not drafter.requests
    assert drafter.stats()["active_requests"] == 0
