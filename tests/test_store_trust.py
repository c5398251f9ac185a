"""``sam``'s cross-request global store under issue 45 ("Trust, second pass"):

* item 6, noisy neighbour: one tenant cannot empty another's store, neither
  by volume (7,000 tokens from one tenant) nor by numbers (one-token outputs
  under fresh salts); the budget's bounds still hold (``tenants.TenantStores``);
* item 7, a store insertion's fault costs only that output, never the
  unrelated request whose start or draft ran the insertion;
* item 10a, only the output the user received enters the store (nothing
  past a stop token or ``max_tokens``, nothing of a request with stop
  strings: ``base.OutputEnd``);
* item 10d, ``store_add`` fault injection reaches every tenant's store.

Tests that count a store's documents turn ``sam_global_live`` off: running
requests' windows are more documents through the same path
(tests/test_sam_live.py).
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from helpers import arrays, make_vllm_config
from vllm_specplug import faults
from vllm_specplug.proposers.base import OutputEnd, RequestInfo
from vllm_specplug.proposers.sam import SamProposer
from vllm_specplug.proposers.tenants import TenantStores

LIGHT = list(range(100, 400))                 # 300 tokens of the light tenant


def _check_bounds(stores: TenantStores) -> None:
    assert len(stores) <= stores.max_partitions
    assert stores.num_tokens <= stores.max_tokens
    assert stores.resident_nbytes() <= stores.max_nbytes


# ------------------------------------------------------- item 6: fair shares
def test_a_heavy_tenant_cannot_empty_a_light_tenants_store():
    """7,000 tokens and more from one tenant (several times the budget) used
    to drop the light tenant's store; now the heavy tenant sheds its own
    oldest segments: it is the one above its fair share."""
    stores = TenantStores(4096, 8)
    stores.add("light", LIGHT)
    rng = np.random.default_rng(0)
    stores.add("heavy", rng.integers(0, 50_000, 7000).tolist())
    for _ in range(40):                       # a quarter segment each: full segments
        stores.add("heavy", rng.integers(0, 50_000, 256).tolist())
        _check_bounds(stores)
        assert stores.peek("light").documents() == [LIGHT]
    assert stores.segments_trimmed > 0 and stores.dropped == 0
    # the heavy tenant still uses the rest of the budget
    assert stores.peek("heavy").num_tokens >= stores.max_tokens - len(LIGHT) - stores.segment_tokens


def test_fresh_salts_with_one_token_outputs_cannot_evict_an_established_store():
    """Sixteen and more one-token outputs, each under a fresh salt, used to
    drop an established store (by the tenant bound and by the bytes each
    new store's hash table costs); now fresh stores displace each other."""
    stores = TenantStores(4096, 16)
    stores.add("victim", LIGHT)
    for i in range(64):
        stores.add(("fresh", i), [7])
        _check_bounds(stores)
        assert stores.peek("victim").documents() == [LIGHT]
        assert stores.peek(("fresh", i)).documents() == [[7]]   # the newest stays
    assert stores.dropped > 0


def test_fresh_salts_at_the_default_budget_leave_an_established_store():
    """The issue's case at the default sizes (500,000 tokens, 16 tenants),
    through the proposer: the victim's next request still drafts its text."""
    prop = SamProposer(8, sam_min_accept_prob=0.0, sam_global_live=False)
    victim = ("victim-salt", None)
    _run(prop, "v0", [1, 2], LIGHT[:60], RequestInfo(victim, 2))
    for i in range(20):
        _run(prop, f"f{i}", [1, 2], [5], RequestInfo((f"fresh-{i}", None), 2))
        _check_bounds(prop.stores)
    assert prop.stores.peek(victim).documents() == [LIGHT[:60]]
    prop.start("v1", [3, 4] + LIGHT[:5], RequestInfo(victim, 2))
    assert prop.propose("v1", 8).tokens.tolist() == LIGHT[5:13]


def test_a_heavy_tenant_through_the_proposer_leaves_the_light_ones_drafts():
    prop = SamProposer(8, sam_global_tokens=4096, sam_min_accept_prob=0.0, sam_global_live=False)
    light = ("light", None)
    _run(prop, "l0", [1, 2], LIGHT[:60], RequestInfo(light, 2))
    rng = np.random.default_rng(1)
    for i in range(28):                       # 7,168 output tokens, filling segments
        _run(prop, f"h{i}", [1, 2], rng.integers(1000, 50_000, 256).tolist(),
             RequestInfo(("heavy", None), 2))
        _check_bounds(prop.stores)
    assert prop.stores.peek(light).documents() == [LIGHT[:60]]
    prop.start("l1", [3, 4] + LIGHT[:5], RequestInfo(light, 2))
    assert prop.propose("l1", 8).tokens.tolist() == LIGHT[5:13]
    stats = prop.debug_stats()
    assert stats["global_store_segments_trimmed"] > 0
    assert stats["global_store_tenants_dropped"] == 0


def test_a_store_within_its_fair_share_keeps_its_newest_segment_under_byte_pressure():
    """A light tenant with two segments may lose its oldest to byte pressure
    from many fresh stores (it is above its share of the bytes), never its
    newest."""
    stores = TenantStores(4096, 16)
    first, second = list(range(1000, 1900)), list(range(2000, 2900))
    stores.add("victim", first)
    stores.add("victim", second)              # does not fit the first segment: a second
    assert len(stores.peek("victim").segments) == 2
    for i in range(40):
        stores.add(("fresh", i), [7])
        _check_bounds(stores)
        assert second in stores.peek("victim").documents()


def test_the_shared_budget_holds_under_mixed_traffic():
    """Random tenants and lengths: every bound holds after every insertion
    and the document just added is always kept."""
    stores = TenantStores(4096, 8)
    rng = np.random.default_rng(2)
    for i in range(400):
        key = int(rng.integers(0, 20)) if rng.random() < 0.7 else ("new", i)
        doc = rng.integers(0, 50_000, int(rng.choice([1, 5, 60, 400, 1500]))).tolist()
        stores.add(key, doc)
        _check_bounds(stores)
        assert stores.peek(key).documents()[-1] == doc[-stores.segment_tokens:]


# --------------------------------------- item 7: faults stay with their output
def test_an_insertion_fault_does_not_cost_the_next_request_its_drafts():
    """Tenant A's output is inserted inside tenant B's next start and
    proposal; the insertion raising must neither raise there nor cost B
    (another tenant) its drafts."""
    prop = SamProposer(8, sam_min_accept_prob=0.0)
    b = ("b", None)
    _run(prop, "b0", [1, 2], LIGHT[:40], RequestInfo(b, 2))
    prop.start("a0", [1, 2, 3], RequestInfo(("a", None), 2))
    prop.observe("a0", [9, 9, 9])
    prop.complete("a0")
    prop.finish("a0")
    prop.stores.add = _raising(prop.stores.add)
    prop.start("b1", [3, 4] + LIGHT[:5], RequestInfo(b, 2))      # runs the insertion
    assert prop.propose("b1", 8).tokens.tolist() == LIGHT[5:13]
    assert prop.debug_stats()["global_store_failed_documents"] == 1
    assert not prop._completed


# ------------------------------ item 10d: store_add reaches every tenant's store
def test_store_add_injection_reaches_salted_and_later_stores():
    prop = SamProposer(8, sam_min_accept_prob=0.0, sam_global_live=False)
    early = ("early", None)
    _run(prop, "e0", [1, 2], LIGHT[:20], RequestInfo(early, 2))   # a store before arming
    injector = faults.Injector(faults.parse("sam:store_add:1,sam:store_add:3"))
    injector.arm_proposer(prop)
    salted = ("salt-1", None)
    _run(prop, "s0", [1, 2], LIGHT[20:40], RequestInfo(salted, 2))   # call 1: a new store
    _run(prop, "s1", [1, 2], LIGHT[40:60], RequestInfo(salted, 2))   # call 2
    _run(prop, "e1", [1, 2], LIGHT[60:80], RequestInfo(early, 2))    # call 3: the early store
    prop.start("z", [1])
    assert injector.raised == {"store_add": 2}
    assert prop.stores.peek(salted).documents() == [LIGHT[40:60]]
    assert prop.stores.peek(early).documents() == [LIGHT[:20]]
    assert prop.debug_stats()["global_store_failed_documents"] == 2
    assert () not in prop.stores                      # arming made no store


def test_a_store_add_fault_in_a_salted_tenant_leaves_every_request_drafting(
        patch_calls, monkeypatch, caplog):
    """Through the drafter, armed from the environment: the salted tenant's
    first insertion raises; the unrelated next request (another salt) still
    drafts, and no request is counted as faulted."""
    import vllm_specplug.vllm_adapter.v1 as adapter
    from vllm_specplug.vllm_adapter.v1.drafter import SpecPlugDrafter

    monkeypatch.setattr(adapter, "install_tree_patches", lambda *a: None)
    monkeypatch.setenv("VLLM_SPECPLUG_STEP_COST_CACHE", "0")
    monkeypatch.setenv(faults.ENV, "sam:store_add:1")
    d = SpecPlugDrafter(make_vllm_config({"method": "sam", "num_speculative_tokens": 4,
                                          "sam_min_accept_prob": 0.0,
                                          "batch_budget": "off"}))
    runner = _Runner(d)
    hist = [1, 2] + LIGHT[:1]
    runner.step({"a": hist}, new={"a": "salt-1"})
    for t in LIGHT[1:12]:
        hist = hist + [t]
        runner.step({"a": hist})
    d.finish_request("a")
    b = [7, 8, 9] * 3                         # b repeats its own text: drafts from it
    drafts = []
    with caplog.at_level(logging.ERROR, logger="vllm_specplug"):
        for i in range(4):                    # its start inserts a's output: raises
            drafts.append(runner.step({"b": b}, new={"b": "salt-2"} if i == 0 else None)["b"])
            b = b + [b[-3]]
    assert d.faults.raised == {"store_add": 1}
    assert all(drafts), drafts
    assert d.stats()["faults"]["requests"] == 0 and d.stats()["errors"] == 0
    assert d.proposer.debug_stats()["global_store_failed_documents"] == 1
    assert not d.proposer.stores.peek(("salt-1", None)).documents()
    assert any("global store" in r.getMessage() for r in caplog.records)


# --------------------------------- item 10a: only what the user received
EOS = 2


def _output_run(prop, req_id, prompt, output, end, tenant=("t", None)):
    prop.start(req_id, prompt + output[:1], RequestInfo(tenant, len(prompt), end))
    prop.observe(req_id, output[1:])
    prop.complete(req_id)
    prop.finish(req_id)
    prop.start("next-" + req_id, [1], RequestInfo(tenant, 1))   # inserts
    prop.finish("next-" + req_id)
    return prop.stores.peek(tenant)


@pytest.mark.parametrize("end, kept", [
    (OutputEnd(frozenset({EOS})), [50, 51, 52, EOS]),          # stopped at EOS
    (OutputEnd(frozenset({EOS, 53})), [50, 51, 52, EOS]),      # the first stop token
    (OutputEnd(frozenset({53}), max_tokens=3), [50, 51, 52]),  # max_tokens first
    (OutputEnd(), [50, 51, 52, EOS, 60, 61]),                  # no end known: all
    (None, [50, 51, 52, EOS, 60, 61]),
])
def test_tokens_past_the_outputs_end_stay_out_of_the_store(end, kept):
    prop = SamProposer(8)
    store = _output_run(prop, "r", [10, 11, 12], [50, 51, 52, EOS, 60, 61], end)
    assert store.documents() == [kept]
    assert prop.debug_stats()["global_store_unreceived_tokens"] == 6 - len(kept)
    assert prop.structure_sizes()["sam_output_ends"] == 0


def test_output_ends_are_held_only_while_their_requests_live():
    """``sam_output_ends`` (structure_sizes): one entry a live request that
    feeds a store, freed at finish, also over preemptions and opt-outs."""
    prop = SamProposer(8)
    end = OutputEnd(frozenset({EOS}), 16)
    for i in range(200):
        r = f"r{i}"
        tenant = None if i % 5 == 0 else ("t", None)     # opted out: nothing kept
        prop.start(r, [1, 2, 3], RequestInfo(tenant, 2, end))
        prop.observe(r, [4, 5])
        if i % 3 == 0:                                    # preempted, back
            prop.finish(r)
            prop.start(r, [1, 2, 3, 4, 5], RequestInfo(tenant, 2, end))
        assert prop.structure_sizes()["sam_output_ends"] == (tenant is not None)
        prop.complete(r)
        prop.finish(r)
        assert prop.structure_sizes()["sam_output_ends"] == 0
    prop.start("x", [1], RequestInfo(("t", None), 1, end))
    prop.start("y", [1], RequestInfo(("t", None), 1, None))   # no end: nothing kept
    assert prop.structure_sizes()["sam_output_ends"] == 1


def test_a_request_with_stop_strings_feeds_no_output():
    """vLLM cuts at a stop string in its front end, which the worker never
    sees: none of the output is known to have reached the user."""
    prop = SamProposer(8)
    assert _output_run(prop, "r", [10, 11], [50, 51, 52], OutputEnd(unknown=True)) is None
    assert prop.debug_stats()["global_store_unreceived_tokens"] == 3
    # with sam_global_prompts the prompt (the user's own text) still goes in
    prop = SamProposer(8, sam_global_prompts=True)
    store = _output_run(prop, "r", [10, 11], [50, 51, 52], OutputEnd(unknown=True))
    assert store.documents() == [[10, 11]]


def test_the_output_end_of_sampling_params():
    params = lambda **kw: SimpleNamespace(**{"stop": None, "stop_token_ids": None,  # noqa: E731
                                             "eos_token_id": None, "max_tokens": None,
                                             "repetition_detection": None, **kw})
    assert OutputEnd.of(None) is None
    assert OutputEnd.of(params(eos_token_id=2, stop_token_ids=[7], max_tokens=9)) == \
        OutputEnd(frozenset({2, 7}), 9)
    assert OutputEnd.of(params()) == OutputEnd()           # ignore_eos: no EOS id
    assert OutputEnd.of(params(stop=["\n\n"])).unknown
    assert OutputEnd.of(params(stop="x")).unknown
    assert not OutputEnd.of(params(stop=[])).unknown
    assert OutputEnd.of(params(repetition_detection=object())).unknown
    assert OutputEnd(frozenset({2}), 3).received([5, 2, 9]) == 2
    assert OutputEnd(frozenset({2}), 3).received([5, 6, 7, 2]) == 3
    assert OutputEnd().received([]) == 0


def test_the_output_end_of_vllms_own_sampling_params():
    """The attribute names ``OutputEnd.of`` reads, on the installed vLLM."""
    vllm = pytest.importorskip("vllm")
    sp = vllm.SamplingParams(max_tokens=5, stop_token_ids=[7])
    sp.update_from_generation_config({}, eos_token_id=2)
    assert OutputEnd.of(sp) == OutputEnd(frozenset({2, 7}), 5)
    assert OutputEnd.of(vllm.SamplingParams(stop=["END"])).unknown
    ignore = vllm.SamplingParams(ignore_eos=True)
    ignore.update_from_generation_config({}, eos_token_id=2)
    assert 2 not in OutputEnd.of(ignore).stop_token_ids


def test_the_drafter_keeps_tokens_accepted_past_eos_out_of_the_store(patch_calls, monkeypatch):
    """Through the drafter as vLLM's runner drives it: the last step commits
    EOS and two accepted draft tokens after it (vLLM's scheduler drops those);
    only the output up to EOS enters the store."""
    import vllm_specplug.vllm_adapter.v1 as adapter
    from vllm_specplug.vllm_adapter.v1.drafter import SpecPlugDrafter

    monkeypatch.setattr(adapter, "install_tree_patches", lambda *a: None)
    monkeypatch.setenv("VLLM_SPECPLUG_STEP_COST_CACHE", "0")
    d = SpecPlugDrafter(make_vllm_config({"method": "sam", "num_speculative_tokens": 4,
                                          "batch_budget": "off"}))
    runner = _Runner(d, eos=EOS, max_tokens=64)
    out = LIGHT[:8]
    runner.step({"a": [1, 3] + out[:1]}, new={"a": None})
    runner.step({"a": [1, 3] + out})
    runner.step({"a": [1, 3] + out + [EOS, 60, 61]})   # EOS, then two accepted past it
    d.finish_request("a")
    runner.step({"b": [5, 6, 7]}, new={"b": None})
    assert d.proposer.stores.peek(()).documents() == [out + [EOS]]
    assert d.proposer.debug_stats()["global_store_unreceived_tokens"] == 2


# ------------------------------------------------------------------ helpers
def _run(prop, req_id, prompt, output, info):
    """A request through the proposer: started with its prompt and first
    output token, the rest observed, then completed; its output goes in at
    the next start."""
    prop.start(req_id, prompt + output[:1], info)
    if output[1:]:
        prop.observe(req_id, output[1:])
    prop.complete(req_id)
    prop.finish(req_id)
    prop.start("_next", [0], info)
    prop.finish("_next")


def _raising(add):
    def raising(*args, **kwargs):
        raise faults.InjectedFault("test fault")
    return raising


class _Runner:
    """vLLM's runner as the drafter sees it: per-request state (prompt
    length, sampling parameters) and a step's scheduler output."""

    def __init__(self, drafter, eos=None, max_tokens=None):
        self.d = drafter
        self.eos, self.max_tokens = eos, max_tokens
        self.requests = {}
        drafter.runner = self

    def step(self, hists: dict, new: dict | None = None) -> dict:
        from vllm_specplug.vllm_adapter.v1 import tenancy

        for req_id in new or {}:
            params = SimpleNamespace(extra_args=None, max_tokens=self.max_tokens, stop=None,
                                     stop_token_ids=None, eos_token_id=self.eos,
                                     repetition_detection=None)
            prompt = len(hists[req_id]) - 1
            self.requests[req_id] = SimpleNamespace(sampling_params=params, lora_request=None,
                                                    num_prompt_tokens=prompt)
        self.d.note_scheduler_output(SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r, **{tenancy.SALT_ATTR: s})
                                for r, s in (new or {}).items()],
            total_num_scheduled_tokens=len(hists), finished_req_ids=set()))
        req_ids = list(hists)
        self.d.begin_step(req_ids, None)
        n, ids = arrays([hists[r] for r in req_ids])
        drafts = self.d.propose([[hists[r][-1]] for r in req_ids], n, ids)
        return dict(zip(req_ids, drafts))
