"""Every structure that grows with traffic stays within its bound
(docs/architecture.md, "Bounds"): a lot of traffic through the pure
structures, then the bound is asserted. No vLLM, no engine."""
from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_specplug.proposers.sam import MAX_BUCKET, AcceptanceByMatchLength
from vllm_specplug.vllm_adapter.v1.drafter import MAX_PREEMPTED


# ------------------------------------------------------ acceptance tables
def test_best_length_cache_bounded_under_changing_costs():
    """The verify cost is refitted every step; a table that is not updated
    (a source that stops winning) must not gain a cache entry per cost."""
    table = AcceptanceByMatchLength(32)
    rng = random.Random(0)
    for step in range(5000):
        cost = 0.05 + 0.05 * rng.random()  # a new float every step
        for match_len in (1, 3, 7, 40):
            table.best_length(match_len, 32, cost)
    assert len(table._best) <= MAX_BUCKET + 1, len(table._best)
    assert len(table._rows) <= MAX_BUCKET + 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 8), st.integers(0, 8),
                          st.sampled_from([0.0, 0.01, 0.08, 0.08, 0.3, 1.0]),
                          st.integers(0, 8)), max_size=60))
def test_best_length_cache_gives_the_uncached_lengths(ops):
    """Whatever the order of updates and costs, the cached best length is
    the one computed from the table's current estimates (the drafts do not
    change with the cache's shape)."""
    table = AcceptanceByMatchLength(8)
    for match_len, drafted, accepted, cost, n in ops:
        if drafted:
            table.update(match_len, drafted, min(accepted, drafted))
        got = table.best_length(match_len, n, cost)
        fresh = AcceptanceByMatchLength._best_lengths(table.prob(match_len).tolist(), cost)
        assert got == (fresh[min(n, len(fresh) - 1)] if n > 0 else 0)


# ------------------------------------------------------------ global store
def test_global_store_bounded_in_tokens_and_bytes():
    """Three times its capacity in documents of random lengths: the store
    keeps at most ``max_tokens`` tokens and never holds more bytes than
    ``max_nbytes`` (a full ring's reserved arrays)."""
    from vllm_specplug.proposers.global_store import GlobalStore

    store = GlobalStore(4096)
    rng = np.random.default_rng(0)
    added = 0
    while added < 3 * store.max_tokens:
        doc = rng.integers(0, 500, size=int(rng.integers(1, 400)))
        store.add(doc)
        added += doc.size
        assert store.num_tokens <= store.max_tokens
        assert store.resident_nbytes() <= store.allocated_nbytes() <= store.max_nbytes()
    assert len(store.segments) == store.num_segments  # the ring is full: max_nbytes is reached
    assert store.allocated_nbytes() == store.max_nbytes()


# ------------------------------------------------------- per-request state
def _traffic(prop, n, rng, *, complete=True, preempt_every=0, topk_k=0):
    """``n`` requests through a proposer as the drafter drives it: start,
    a few steps of propose/observe (with target top-k when ``topk_k``),
    then complete + finish (or, every ``preempt_every``-th, finish only)."""
    from vllm_specplug.proposers.base import TargetTopK

    for i in range(n):
        rid = f"r{i}"
        ctx = rng.integers(0, 300, size=int(rng.integers(4, 60))).tolist()
        prop.start(rid, ctx)
        for _ in range(int(rng.integers(1, 6))):
            prop.propose(rid, 8)
            new = rng.integers(0, 300, size=int(rng.integers(1, 4))).tolist()
            topk = None
            if topk_k:
                ids = np.asarray(ctx[-1:] + new[:-1])
                topk = TargetTopK(ids, rng.integers(0, 300, size=(ids.size, topk_k)),
                                  np.zeros((ids.size, topk_k), dtype=np.float32))
            prop.observe(rid, new, topk)
            ctx += new
        if preempt_every and i % preempt_every == 0:
            prop.finish(rid)            # preempted: left the batch, never completed
            continue
        if complete:
            prop.complete(rid)
        prop.finish(rid)


def test_sam_per_request_state_freed_and_bounded(monkeypatch):
    """After a lot of traffic no per-request entry is left, the acceptance
    caches stay within a bucket's entries per table, and prompt lengths of
    requests that were never completed stay within MAX_TRACKED_PROMPTS."""
    import vllm_specplug.proposers.sam as sam

    monkeypatch.setattr(sam, "MAX_TRACKED_PROMPTS", 32)
    prop = sam.SamProposer(8, sam_global_tokens=sam.MIN_GLOBAL_TOKENS)
    rng = np.random.default_rng(1)
    for i in range(40):
        prop.relative_token_cost = 0.05 + 0.001 * i   # refitted every step in the engine
        _traffic(prop, 20, rng, preempt_every=3)
    sizes = prop.structure_sizes()
    assert sizes.pop("sam_prompt_lens") <= 32
    assert sizes.pop("sam_completed") <= 1   # finished since the last step: added at the next
    assert sizes.pop("sam_acceptance_cache") <= 3 * 2 * (MAX_BUCKET + 1)
    assert set(sizes.values()) == {0}, sizes
    assert prop.state_nbytes() == 0
    stats = prop.debug_stats()
    assert stats["global_store_tokens"] <= sam.MIN_GLOBAL_TOKENS


def test_token_recycling_state_bounded():
    """Per-request entries freed; the template cache holds one entry per
    draft budget; the matrix has a row per token id seen (rounded up)."""
    from vllm_specplug.proposers.token_recycling import ROW_GROWTH, TokenRecyclingProposer

    prop = TokenRecyclingProposer(8, tr_topk=4)
    _traffic(prop, 400, np.random.default_rng(2), preempt_every=5, topk_k=4)
    sizes = prop.structure_sizes()
    assert sizes["tr_requests"] == 0
    assert sizes["tr_template_cache"] <= 8 + 1
    assert sizes["tr_matrices"] == 1 and sizes["tr_private_matrices"] == 0
    assert prop.debug_stats()["matrix_rows"] <= 300 + ROW_GROWTH


def test_sam_tr_state_freed():
    from vllm_specplug.config import build_proposer, translate

    _, plugin = translate({"method": "sam_tr", "num_speculative_tokens": 8})
    prop = build_proposer(plugin)
    _traffic(prop, 300, np.random.default_rng(3), preempt_every=4, topk_k=prop.target_topk_k)
    sizes = prop.structure_sizes()
    sizes.pop("sam_acceptance_cache")
    sizes.pop("tr_template_cache")
    assert sizes.pop("tr_matrices") <= 1     # the default tenant's, kept
    assert sizes.pop("sam_completed") <= 1
    # preempted and never finished (the drafter reports finishes): at most
    # MAX_TRACKED_PROMPTS, the oldest forgotten
    assert sizes.pop("sam_prompt_lens") <= 75
    assert set(sizes.values()) == {0}, sizes


# ---------------------------------------------------- drafter and budgets
def test_drafter_state_freed_after_traffic(patch_calls):
    """Requests through the drafter as vLLM's runner drives it (a changing
    batch, requests leaving it finished or preempted): every per-request
    structure of the drafter and its proposer is back to empty."""
    from helpers import make_vllm_config, step

    from vllm_specplug.vllm_adapter.v1.drafter import SpecPlugDrafter

    d = SpecPlugDrafter(make_vllm_config({"method": "sam", "num_speculative_tokens": 4}))
    rng = random.Random(4)
    live: dict[str, list[int]] = {}
    for i in range(600):
        if len(live) < 6:
            live[f"q{i}"] = [rng.randrange(50) for _ in range(rng.randrange(3, 30))]
        for rid in list(live):
            live[rid].append(rng.randrange(50))
        ids = list(live)
        step(d, ids, [live[r] for r in ids], [[live[r][-1]] for r in ids])
        for rid in ids:
            if rng.random() < 0.2:
                if rng.random() < 0.5:
                    d.finish_request(rid)       # finished or aborted
                del live[rid]                   # else: preempted, leaves the batch
    step(d, [], [], [])
    sizes = d.stats()["sizes"]
    sizes.pop("sam_acceptance_cache")
    sizes.pop("sam_prompt_lens")   # preempted, never finished: bounded by MAX_TRACKED_PROMPTS
    assert sizes.pop("sam_completed") <= 6   # finished in the last step: added at the next
    # preempted, never finished (vLLM finishes or resumes each; bounded)
    assert 0 < sizes.pop("drafter_preempted") <= MAX_PREEMPTED
    assert set(sizes.values()) == {0}, sizes


def test_requests_preempted_and_never_finished_are_bounded(patch_calls, monkeypatch):
    """``drafter_preempted`` and ``drafter_salts`` (issue 45 item 10: sizes
    missing from ``sizes``): the first holds at most ``MAX_PREEMPTED``
    requests; both are emptied as the requests finish."""
    from types import SimpleNamespace as NS

    from helpers import make_vllm_config, step

    from vllm_specplug.vllm_adapter.v1 import drafter as drafter_mod

    monkeypatch.setattr(drafter_mod, "MAX_PREEMPTED", 8)
    d = drafter_mod.SpecPlugDrafter(make_vllm_config({"method": "sam",
                                                      "num_speculative_tokens": 4}))
    for i in range(40):
        d.note_scheduler_output(NS(scheduled_new_reqs=[NS(req_id=f"r{i}",
                                                          specplug_cache_salt="s")],
                                   total_num_scheduled_tokens=1, finished_req_ids=set()))
        step(d, [f"r{i}"], [[1, 2, 3, 1]], [[1]])
        step(d, [], [], [])                       # r{i} leaves unfinished: preempted
    sizes = d.stats()["sizes"]
    assert sizes["drafter_preempted"] == 8, sizes
    assert sizes["drafter_salts"] == 40, sizes
    for i in range(40):                           # finished or aborted at last
        d.finish_request(f"r{i}")
    sizes = d.stats()["sizes"]
    assert (sizes["drafter_preempted"], sizes["drafter_salts"]) == (0, 0), sizes


def test_drain_windows_are_bounded():
    """``DrainValuation.open`` (``sizes.drain_open``): at most ``MAX_OPEN``
    finishes wait for a refill, and each waits at most ``WINDOW`` steps."""
    from vllm_specplug.budget import DrainValuation

    v = DrainValuation()
    for _ in range(50):
        v.note_step(0, 0, 500, 5)
        assert len(v.open) <= DrainValuation.MAX_OPEN
    for _ in range(DrainValuation.WINDOW + 1):
        v.note_step(0, 0, 0, 5)
    assert not v.open and v.expired >= DrainValuation.MAX_OPEN


def test_calibration_pending_bounded(monkeypatch):
    from vllm_specplug.budget import AcceptanceCalibration

    monkeypatch.setattr(AcceptanceCalibration, "MAX_PENDING", 64, raising=False)
    cal = AcceptanceCalibration()
    for i in range(10_000):
        cal.expect(f"r{i}", 1.0)     # never settled nor forgotten
        cal.expect(f"r{i}", 2.0)     # a request's next draft replaces its entry
    assert len(cal.pending) == 64
    assert cal.pending["r9999"] == 2.0


def test_step_cost_model_has_fixed_size():
    from vllm_specplug.budget import StepCostModel

    model = StepCostModel()
    size = model._xtx.nbytes + model._xty.nbytes
    rng = random.Random(5)
    for _ in range(20_000):
        model.add(rng.randrange(1, 64), 0.01 + 0.001 * rng.random())
    assert model._xtx.nbytes + model._xty.nbytes == size and model.samples > 10_000


# ------------------------------------------------------- sam's learned stop rule
def test_learned_stop_state_is_bounded_and_freed():
    """sam_stop "learned": the calibration arrays keep their shape whatever
    the traffic; the per-request counters live while the request does."""
    from vllm_specplug.proposers.sam import SamProposer

    sam = SamProposer(16, sam_stop="learned", sam_global_tokens=0)
    sam.relative_token_cost = 0.05
    rng = random.Random(0)
    shapes = (sam._stop.calib_est.shape, sam._stop.calib_hit.shape)
    for r in range(60):
        rid = f"r{r}"
        text = [rng.randint(0, 30) for _ in range(40)]
        sam.start(rid, text)
        for _ in range(20):
            d = sam.propose(rid, 16)
            sam.observe(rid, list(d.tokens[:2]) + [rng.randint(0, 30)])
        if r % 3:           # a third of the requests are still running
            sam.complete(rid)
            sam.finish(rid)
    assert sam.structure_sizes()["sam_stop_requests"] == 20 == sam.active_requests()
    assert (sam._stop.calib_est.shape, sam._stop.calib_hit.shape) == shapes
    for r in range(0, 60, 3):
        sam.finish(f"r{r}")
    assert sam.structure_sizes()["sam_stop_requests"] == 0
