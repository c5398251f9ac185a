"""Faults are contained (docs/architecture.md, "Faults"), fast tier: the
drafter driven as vLLM's runner would, without vLLM (tests/test_drafter_unit.py).

An exception in a proposer hook costs its request's drafts for the rest of
its life, never the engine: the other requests keep drafting, the fault is
counted in ``stats()["faults"]`` and logged once with a traceback. A fault in
a step shared by the batch gives no drafts for that step only. The engine
tier is tests/test_engine_faults.py."""
from __future__ import annotations

import logging

import pytest

import vllm_specplug.vllm_adapter.v1 as adapter
from helpers import arrays, make_vllm_config
from vllm_specplug import faults
from vllm_specplug.options import SpecPlugConfigError
from vllm_specplug.proposers.sam import SamProposer
from vllm_specplug.vllm_adapter.v1.drafter import SpecPlugDrafter

K = 4
METHODS = {
    "sam": {"method": "sam", "num_speculative_tokens": K},
    "token_recycling": {"method": "token_recycling", "num_speculative_tokens": K},
    "sam_tr": {"method": "sam_tr", "num_speculative_tokens": K},
}
# each request repeats its own 3-token cycle, so every method drafts it
CYCLES = {"a": [10, 11, 12], "b": [20, 21, 22], "c": [30, 31, 32], "d": [40, 41, 42]}


@pytest.fixture(autouse=True)
def _no_patches(patch_calls, monkeypatch):
    monkeypatch.setattr(adapter, "install_tree_patches", lambda *a: None)
    monkeypatch.delenv(faults.ENV, raising=False)
    monkeypatch.setenv("VLLM_SPECPLUG_STEP_COST_CACHE", "0")


def make(method="sam", **extra) -> SpecPlugDrafter:
    """A drafter whose drafts do not depend on this machine's step timings
    (the batch-aware budget off) unless ``batch_budget`` is given."""
    extra.setdefault("batch_budget", "off")
    d = SpecPlugDrafter(make_vllm_config({**METHODS[method], **extra}))
    # verified tokens nearly free whatever this loop's timings: drafts are
    # never cut for their cost
    d.step_cost = type(d.step_cost)(prior_a=1.0, prior_b=1e-6, prior_weight=1e9)
    return d


class Driver:
    """Requests that each commit one token of their cycle per step."""

    def __init__(self, drafter, req_ids=("a", "b", "c")):
        self.d = drafter
        self.hist = {r: CYCLES[r] * 3 for r in req_ids}

    def step(self, req_ids=None) -> dict[str, list[int]]:
        req_ids = list(req_ids or self.hist)
        for r in req_ids:
            self.hist.setdefault(r, CYCLES[r] * 3)
            h = self.hist[r]
            h.append(CYCLES[r][len(h) % 3])
        self.d.begin_step(req_ids, None)
        num_tokens, token_ids = arrays([self.hist[r] for r in req_ids])
        drafts = self.d.propose([[self.hist[r][-1]] for r in req_ids], num_tokens, token_ids)
        return dict(zip(req_ids, drafts))


class Fault:
    """Makes ``obj.name`` raise for request ``req`` (any call when ``req``
    is None) once armed; records the calls made for ``req`` after that."""

    def __init__(self, monkeypatch, obj, name, req="b"):
        self.original = getattr(obj, name)
        self.req, self.armed, self.raised, self.calls_after = req, False, 0, 0
        monkeypatch.setattr(obj, name, self)

    def __call__(self, *args, **kwargs):
        if self.armed and (self.req is None or args[0] == self.req):
            if self.raised:
                self.calls_after += 1
            else:
                self.raised += 1
                raise faults.InjectedFault("test fault")
        return self.original(*args, **kwargs)


def fault_records(caplog):
    return [r for r in caplog.records
            if r.name == "vllm_specplug" and r.levelno >= logging.ERROR]


def assert_one_request_fault(d, caplog, hook, req="b"):
    f = d.stats()["faults"]
    assert f["requests"] == 1 and f["steps"] == 0 and f["hooks"] == {hook: 1}, f
    assert d.stats()["errors"] == 1
    records = fault_records(caplog)
    assert len(records) == 1, [r.getMessage() for r in records]
    assert req in records[0].getMessage() and hook in records[0].getMessage()
    assert d.method in records[0].getMessage()
    assert records[0].exc_info is not None  # the traceback, once


def keeps_drafting(steps, reqs=("a", "c")) -> bool:
    return all(all(s[r] for r in reqs) for s in steps[-2:])


# ----------------------------------------------------------- proposer hooks
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("hook", ["start", "observe", "propose"])
def test_a_faulting_hook_costs_only_its_requests_drafts(method, hook, monkeypatch, caplog):
    d = make(method)
    drv = Driver(d)
    fault = Fault(monkeypatch, d.proposer, hook)
    fault.armed = hook == "start"
    with caplog.at_level(logging.ERROR, logger="vllm_specplug"):
        before = [drv.step() for _ in range(3)]
        if hook != "start":
            assert any(s["b"] for s in before), before   # b drafted before its fault
            fault.armed = True
        after = [drv.step() for _ in range(5)]
    assert fault.raised == 1
    assert all(s["b"] == [] for s in after), after
    assert keeps_drafting(after), after
    assert fault.calls_after == 0          # never fed again
    assert "b" not in d.requests.running()
    assert d.stats()["faults"]["requests_without_drafts"] == 1
    # while it decodes without drafts, no per-request drafter state is kept for it
    assert "b" not in d.requests.holding("seen")
    assert_one_request_fault(d, caplog, hook)
    # it finishes: forgotten, the proposer not called for it
    d.finish_request("b")
    assert d.stats()["faults"]["requests_without_drafts"] == 0
    assert d.proposer.active_requests() == (2 if method != "token_recycling" else
                                            d.proposer.active_requests())


@pytest.mark.parametrize("method", list(METHODS))
def test_a_faulting_draft_cut_costs_only_its_requests_drafts(method, monkeypatch, caplog):
    d = make(method)
    drv = Driver(d)
    # max_tokens leaves room for 2 draft tokens: every draft is cut
    monkeypatch.setattr(d, "_tokens_left", lambda req_id, n: 2)
    fault = Fault(monkeypatch, d.proposer, "draft_cut")
    before = [drv.step() for _ in range(3)]
    assert any(s["b"] for s in before), before
    fault.armed = True
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="vllm_specplug"):
        after = [drv.step() for _ in range(5)]
    assert fault.raised == 1
    assert all(s["b"] == [] for s in after), after
    assert keeps_drafting(after), after
    assert fault.calls_after == 0
    assert_one_request_fault(d, caplog, "draft_cut")


def armed_after_steps(method, monkeypatch, hook, steps=3):
    """(drafter, driver, fault): ``hook`` raises for b once a, b and c drafted
    ``steps`` steps."""
    d = make(method)
    drv = Driver(d)
    fault = Fault(monkeypatch, d.proposer, hook)
    for _ in range(steps):
        drv.step()
    fault.armed = True
    return d, drv, fault


@pytest.mark.parametrize("method", list(METHODS))
def test_a_faulting_complete_leaves_the_engine_and_others_alone(method, monkeypatch, caplog):
    d, drv, fault = armed_after_steps(method, monkeypatch, "complete")
    with caplog.at_level(logging.ERROR, logger="vllm_specplug"):
        d.finish_request("a")
        d.finish_request("b")              # raises inside: contained
        after = [drv.step(["c", "d"]) for _ in range(5)]
    assert fault.raised == 1
    assert keeps_drafting(after, ("c", "d")), after
    assert_one_request_fault(d, caplog, "complete")
    # b finished: its state is freed and it is not remembered as faulted
    assert d.stats()["faults"]["requests_without_drafts"] == 0
    assert "b" not in d.requests.running() and d.proposer.active_requests() == 2


@pytest.mark.parametrize("method", list(METHODS))
def test_a_faulting_finish_leaves_the_engine_and_others_alone(method, monkeypatch, caplog):
    d, drv, fault = armed_after_steps(method, monkeypatch, "finish")
    with caplog.at_level(logging.ERROR, logger="vllm_specplug"):
        after = [drv.step(["a", "c"]) for _ in range(3)]   # b preempted: freed, raises
        back = [drv.step() for _ in range(3)]               # b resumes: no drafts
    assert fault.raised == 1
    assert keeps_drafting(after) and keeps_drafting(back), (after, back)
    assert all(s["b"] == [] for s in back), back
    assert fault.calls_after == 0
    assert_one_request_fault(d, caplog, "finish")
    d.finish_request("b")
    assert d.stats()["faults"]["requests_without_drafts"] == 0 and fault.calls_after == 0


# --------------------------------------------------- store and corpus matches
def sam_part(proposer) -> SamProposer:
    return proposer if isinstance(proposer, SamProposer) else proposer.sam


def test_a_failing_store_insertion_is_dropped_not_retried():
    """Issue 35's bug: ``_add_completed`` kept a document whose insertion
    raised, so every later start and proposal retried it (a traceback per
    request per step). The pending list is taken first: the failing document
    is dropped and counted, the others still go in, and (issue 45 item 7)
    the request whose start ran the insertion is not charged with it."""
    p = SamProposer(K, sam_global_tokens=1024, sam_global_prompts=True)
    for r in ("a", "b", "c"):
        p.start(r, CYCLES[r] * 4)
    for r in ("a", "b", "c"):
        p.complete(r)
        p.finish(r)
    calls = []
    original = p.global_store.add

    def add(tokens):
        calls.append(list(tokens))
        if tokens[0] == CYCLES["b"][0]:
            raise ValueError("store full of surprises")
        original(tokens)

    p.global_store.add = add
    p.start("x", [1, 2, 3])                      # does not raise for b's output
    assert len(calls) == 3                       # a, b (raised), c
    assert p.global_store.documents() == [CYCLES["a"] * 4, CYCLES["c"] * 4]
    assert p.debug_stats()["global_store_failed_documents"] == 1
    p.start("y", CYCLES["c"] * 2)                # nothing pending: no retry
    assert p.propose("y", K).tokens.tolist()
    assert len(calls) == 3 and not p._completed


@pytest.mark.parametrize("method", ["sam", "sam_tr"])
def test_a_failing_store_insertion_costs_only_its_output_and_is_not_retried(
        method, monkeypatch, caplog):
    """Issue 45 item 7: a's output is inserted inside the next request's
    proposal (b's, whatever its tenant). The insertion's fault used to be
    raised there and cost b its drafts for life; now it costs only a's
    output (dropped, counted, logged once) and every request drafts on."""
    d = make(method)
    drv = Driver(d, ("a", "b", "c"))
    store = sam_part(d.proposer).global_store
    fault = Fault(monkeypatch, store, "add", req=None)
    for _ in range(3):
        drv.step()
    d.finish_request("a")                        # a's output waits for the next step
    fault.armed = True
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="vllm_specplug"):
        after = [drv.step(["b", "c"]) for _ in range(5)]
    assert fault.raised == 1 and fault.calls_after == 0
    assert all(s["b"] and s["c"] for s in after), after
    f = d.stats()["faults"]
    assert f == {"requests": 0, "steps": 0, "hooks": {}, "requests_without_drafts": 0}, f
    assert d.stats()["errors"] == 0
    records = fault_records(caplog)
    assert len(records) == 1 and records[0].exc_info is not None, records
    assert "global store" in records[0].getMessage() and "request a" in records[0].getMessage()
    assert sam_part(d.proposer).debug_stats()["global_store_failed_documents"] == 1


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    from vllm_specplug.proposers.corpus_automaton import build_corpus_automaton

    path = tmp_path_factory.mktemp("corpus") / "c.sam"
    build_corpus_automaton([CYCLES["d"] * 5], 0, {"name": "toy", "vocab_sha256": "0" * 64},
                           path, progress=False)
    return str(path)


def test_a_failing_corpus_match_costs_one_request(corpus_file, monkeypatch, caplog):
    d = make("sam", sam_corpus=corpus_file)
    drv = Driver(d)
    for _ in range(2):
        drv.step()
    d.faults = None
    d.inject_faults("sam:corpus_match:1")        # the next match advanced: a's observe
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="vllm_specplug"):
        after = [drv.step() for _ in range(4)]
    assert all(s["a"] == [] for s in after) and keeps_drafting(after, ("b", "c")), after
    assert_one_request_fault(d, caplog, "observe", req="a")
    assert d.faults.raised == {"corpus_match": 1}


# ---------------------------------------------------------------- shared steps
@pytest.mark.parametrize("site", ["budget", "step_cost"])
def test_a_shared_step_fault_gives_no_drafts_for_that_step_only(site, monkeypatch, caplog):
    monkeypatch.setenv(faults.ENV, f"sam:{site}:3")
    d = make("sam", batch_budget="auto")
    assert d.faults is not None
    drv = Driver(d)
    with caplog.at_level(logging.ERROR, logger="vllm_specplug"):
        steps = [drv.step() for _ in range(6)]
    assert all(steps[1].values()), steps         # step 2 drafted
    assert all(v == [] for v in steps[2].values()), steps   # step 3: none
    assert all(all(s.values()) for s in steps[3:]), steps   # drafting again
    f = d.stats()["faults"]
    assert f == {"requests": 0, "steps": 1, "hooks": {site: 1},
                 "requests_without_drafts": 0}, f
    assert len(fault_records(caplog)) == 1


def test_a_shared_step_fault_is_logged_at_powers_of_ten(monkeypatch, caplog):
    d = make("sam", batch_budget="auto")
    drv = Driver(d)

    def broken(*a):
        raise faults.InjectedFault("always")

    monkeypatch.setattr(d, "_fit_to_batch", broken)
    with caplog.at_level(logging.ERROR, logger="vllm_specplug"):
        for _ in range(12):
            assert not any(drv.step().values())
    assert d.stats()["faults"]["steps"] == 12
    records = fault_records(caplog)
    assert len(records) == 2 and records[0].exc_info and not records[1].exc_info


class _BrokenTargetHook:
    def begin_step(self, *args, **kwargs):
        raise faults.InjectedFault("features")


def test_a_target_hook_fault_drops_that_steps_drafts(caplog):
    d = make("sam")
    drv = Driver(d)
    assert all(drv.step().values())
    d.target_hook = _BrokenTargetHook()
    reqs = list(drv.hist)
    for r in reqs:
        drv.hist[r].append(CYCLES[r][len(drv.hist[r]) % 3])
    with caplog.at_level(logging.ERROR, logger="vllm_specplug"):
        d.begin_step(reqs, None, sampled_token_ids=[[h[-1]] for h in drv.hist.values()])
        num_tokens, token_ids = arrays(list(drv.hist.values()))
        drafts = d.propose([[h[-1]] for h in drv.hist.values()], num_tokens, token_ids)
    assert drafts == [[], [], []]
    d.target_hook = None
    assert all(drv.step().values())              # the next step drafts again
    assert d.stats()["faults"] == {"requests": 0, "steps": 1,
                                   "hooks": {"target_begin_step": 1},
                                   "requests_without_drafts": 0}
    assert len(fault_records(caplog)) == 1


# ---------------------------------------------- eagle2's and del's target hooks
def test_eagle2_a_faulting_head_call_costs_only_its_requests_drafts(monkeypatch, caplog):
    from test_eagle2_tree import FakeHead

    from vllm_specplug.proposers.eagle2 import Eagle2Proposer

    head = FakeHead(default=lambda path: [(5 + len(path), 0.6), (6 + len(path), 0.3)])
    check_target_hook_fault(Eagle2Proposer(K, model="/head", depth=3, topk=2), "eagle2",
                            head, "root", monkeypatch, caplog)


def check_target_hook_fault(proposer, method, hook, call, monkeypatch, caplog):
    """``proposer`` bound to the fake ``hook`` in a drafter: once ``hook.call``
    raises for b, b drafts nothing more, a and c draft on."""
    d = make("sam")
    d.proposer, d.method = proposer, method
    d.containment.method = method
    proposer.bind_target(hook)
    drv = Driver(d)
    fault = Fault(monkeypatch, hook, call)
    assert all(drv.step().values())
    fault.armed = True
    with caplog.at_level(logging.ERROR, logger="vllm_specplug"):
        after = [drv.step() for _ in range(3)]
    assert all(s["b"] == [] for s in after) and keeps_drafting(after), after
    assert fault.calls_after == 0
    assert_one_request_fault(d, caplog, "propose")


class _CycleExitHook:
    """A DEL target hook whose every exit layer drafts the request's cycle."""

    num_layers = 30
    head_cost = 0.0

    @staticmethod
    def _next(t):
        return t // 10 * 10 + (t % 10 + 1) % 3

    def draft(self, req_id, token, position, exit_layer, max_tokens, threshold, shadow_layers):
        from vllm_specplug.proposers.early_exit import ExitDraft

        tokens = [self._next(token)]
        while len(tokens) < max_tokens:
            tokens.append(self._next(tokens[-1]))
        return ExitDraft(tokens, {c: tokens[0] for c in shadow_layers})


def test_del_a_faulting_exit_draft_costs_only_its_requests_drafts(monkeypatch, caplog):
    from vllm_specplug.proposers.early_exit import DelProposer

    check_target_hook_fault(DelProposer(K), "del", _CycleExitHook(), "draft",
                            monkeypatch, caplog)


# ----------------------------------------------------- the environment hook
@pytest.mark.parametrize("method", list(METHODS))
def test_the_environment_hook_makes_the_nth_call_raise(method, monkeypatch, caplog):
    monkeypatch.setenv(faults.ENV, f"{method}:propose:2,other_method:start:1")
    d = make(method)
    drv = Driver(d)
    with caplog.at_level(logging.ERROR, logger="vllm_specplug"):
        steps = [drv.step() for _ in range(5)]
    assert d.faults.raised == {"propose": 1}    # call 2: b's on the first step
    assert all(s["b"] == [] for s in steps) and keeps_drafting(steps), steps
    assert_one_request_fault(d, caplog, "propose")


@pytest.mark.parametrize("bad", ["sam:propose", "sam:nohook:1", "sam:propose:0",
                                 "sam:propose:x", ":propose:1"])
def test_a_bad_environment_hook_names_what_to_change(bad, monkeypatch):
    monkeypatch.setenv(faults.ENV, bad)
    with pytest.raises(SpecPlugConfigError, match=f"{faults.ENV}.*METHOD:HOOK:N"):
        make("sam")
    assert faults.parse("") == [] and faults.parse(" , ") == []
