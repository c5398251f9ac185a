"""SpecPlugDrafter's plumbing between vLLM's runner and the proposer, driven
without vLLM (as ``test_drafter_unit``): what each hook is handed (the
request's tenant, the target's top-k, the target hook's arguments), which
hook a fault is charged to, the samples the step-cost model is fed, and the
per-request state every way out of the batch frees. Written for the
survivors of the drafter's mutation run (results/mutation/2026-12-05/
drafter.txt, docs/testing.md).
"""
from __future__ import annotations

import logging
from types import SimpleNamespace as NS

import numpy as np
import pytest

from helpers import arrays, make_vllm_config, step
from test_drafter_unit import _State, _attach
from vllm_specplug.proposers.base import TargetTopK
from vllm_specplug.vllm_adapter.v1 import drafter as drafter_mod
from vllm_specplug.vllm_adapter.v1.drafter import SpecPlugDrafter

K = 4


@pytest.fixture
def drafter(patch_calls):
    return SpecPlugDrafter(make_vllm_config())


class _Recorder:
    """Wraps a drafter's proposer: records each hook's calls, and raises in
    ``raise_in`` (a hook name) for request ``bad``."""

    def __init__(self, monkeypatch, proposer, raise_in: str | None = None, bad: str = "a"):
        self.calls: list[tuple] = []
        self.raise_in, self.bad = raise_in, bad
        for hook in ("start", "observe", "propose", "draft_cut", "finish", "complete"):
            orig = getattr(proposer, hook)

            def wrapped(req_id, *args, _hook=hook, _orig=orig, **kwargs):
                self.calls.append((_hook, req_id, args, kwargs))
                if _hook == self.raise_in and req_id == self.bad:
                    raise ValueError(f"boom in {_hook}")
                return _orig(req_id, *args, **kwargs)

            monkeypatch.setattr(proposer, hook, wrapped)

    def names(self, req_id: str = "a") -> list[str]:
        return [c[0] for c in self.calls if c[1] == req_id]


# ------------------------------------------------------------ rebuilds
def test_a_rebuilt_request_is_finished_once_before_its_new_start(drafter, monkeypatch):
    rec = _Recorder(monkeypatch, drafter.proposer)
    step(drafter, ["a"], [[1, 2, 3, 1, 2]], [[2]])
    assert rec.names() == ["start", "propose"]          # a new request: no finish
    rec.calls.clear()
    # recomputed after a preemption to a different last token: the old state goes
    step(drafter, ["a"], [[1, 2, 3, 1, 7]], [[7]])
    assert rec.names() == ["finish", "start", "propose"]
    assert drafter.proposer.active_requests() == 1


def test_a_finish_raising_in_a_rebuild_is_charged_to_finish(drafter, monkeypatch, caplog):
    rec = _Recorder(monkeypatch, drafter.proposer, raise_in="finish")
    step(drafter, ["a", "b"], [[1, 2, 3, 1, 2], [4, 5, 4, 5]], [[2], [5]])
    with caplog.at_level(logging.ERROR, logger="vllm_specplug"):
        drafts = step(drafter, ["a", "b"], [[1, 2, 3, 1, 7], [4, 5, 4, 5, 4]], [[7], [4]])
    assert drafts[0] == [] and drafts[1]
    f = drafter.stats()["faults"]
    assert f["hooks"] == {"finish": 1} and f["requests_without_drafts"] == 1, f
    # a finish that raised is not called again for it
    assert rec.names().count("finish") == 1


@pytest.mark.parametrize("hook", ["start", "observe", "propose"])
def test_a_fault_is_charged_to_the_hook_that_raised(drafter, monkeypatch, hook):
    rec = _Recorder(monkeypatch, drafter.proposer, raise_in="start" if hook == "start" else None)
    step(drafter, ["a"], [[1, 2, 3, 1, 2]], [[2]])
    rec.raise_in = hook
    step(drafter, ["a"], [[1, 2, 3, 1, 2, 3]], [[3]])
    assert drafter.stats()["faults"]["hooks"] == {hook: 1}
    names = rec.names()
    assert names[-2:] == [hook, "finish"]     # its state freed after the fault


# ---------------------------------------------------------- calibration
def test_calibration_settles_the_accepted_drafts_of_the_last_step(drafter, monkeypatch):
    settled = []
    monkeypatch.setattr(drafter.calibration, "settle",
                        lambda req_id, accepted: settled.append((req_id, accepted)))
    hist = [1, 2, 3, 4, 1, 2, 3, 4, 1]
    step(drafter, ["a"], [hist], [[1]])
    assert settled == []                           # its first step: nothing to settle
    hist += [2, 3, 4]                              # 2 drafts accepted and the step's own token
    step(drafter, ["a"], [hist], [[2, 3, 4]])
    assert settled == [("a", 2)]
    step(drafter, ["a"], [hist], [[]])             # nothing committed: nothing settled
    assert settled == [("a", 2)]


# ------------------------------------------------------------- tenancy
class _LoRA:
    lora_name = "adapter-7"
    lora_int_id = 7
    lora_path = "/adapters/7"


def test_the_proposer_starts_a_request_with_its_tenant(patch_calls, monkeypatch):
    d = SpecPlugDrafter(make_vllm_config())
    state = _State(5, None)
    state.lora_request = _LoRA()
    _attach(d, {"a": state})
    d.note_scheduler_output(NS(scheduled_new_reqs=[NS(req_id="a",
                                                     specplug_cache_salt="salt-a")],
                               total_num_scheduled_tokens=1, finished_req_ids=set()))
    got = []
    orig = d.proposer.start
    monkeypatch.setattr(d.proposer, "start", lambda req_id, tokens, info=None: (
        got.append(info), orig(req_id, tokens, info=info))[1])
    step(d, ["a"], [[1, 2, 3, 1, 2]], [[2]])
    assert len(got) == 1 and got[0].num_prompt_tokens == 5
    assert got[0].tenant == ("salt-a", ("adapter-7", 7, "/adapters/7"))


# ------------------------------------------------------------- top-k
def _topk(n=2) -> TargetTopK:
    return TargetTopK(input_ids=np.arange(n), token_ids=np.arange(2 * n).reshape(n, 2),
                      logprobs=np.zeros((n, 2), dtype=np.float32))


def test_the_targets_top_k_reaches_its_requests_observe(drafter, monkeypatch):
    rec = _Recorder(monkeypatch, drafter.proposer)
    first, later = _topk(), _topk(3)
    drafter.pending_topk = {"a": first}
    step(drafter, ["a", "b"], [[1, 2, 3, 1, 2], [4, 5, 4, 5]], [[2], [5]])
    # a new request: started, then handed the top-k of its prefill
    assert rec.names() == ["start", "observe", "propose"]
    assert rec.calls[1][2] == ([], first)
    assert "observe" not in rec.names("b")       # no top-k for b, nothing new either
    rec.calls.clear()
    drafter.pending_topk = {"a": later}
    step(drafter, ["a", "b"], [[1, 2, 3, 1, 2, 3], [4, 5, 4, 5, 4]], [[3], [4]])
    obs = {c[1]: c[2] for c in rec.calls if c[0] == "observe"}
    assert obs["a"] == ([3], later) and obs["b"] == ([4], None)
    assert drafter.pending_topk == {}            # consumed by the step
    # a top-k with no new token (a step that committed nothing) is still observed
    rec.calls.clear()
    drafter.pending_topk = {"a": first}
    step(drafter, ["a"], [[1, 2, 3, 1, 2, 3]], [[3]])
    assert [c[2] for c in rec.calls if c[0] == "observe"] == [([], first)]


# ------------------------------------------------------- the target hook
class _TargetHook:
    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def begin_step(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if self.fail:
            raise ValueError("no features this step")


def test_begin_step_hands_the_target_hook_the_steps_tensors(drafter):
    hook = _TargetHook()
    drafter.target_hook = hook
    drafter.runner = runner = object()
    drafter.begin_step(["a"], "sched", hidden_states="h", sampled_token_ids=None)
    assert hook.calls == []                      # no sampled tokens: not the verify step
    drafter.begin_step(["a", "b"], "sched", hidden_states="h", sampled_token_ids=[[1], [2]],
                       aux_hidden_states="aux")
    assert hook.calls == [((runner, "h", [[1], [2]], ["a", "b"], "sched"),
                           {"aux_hidden_states": "aux"})]


def test_a_raising_target_hook_is_logged_with_its_error(drafter, caplog):
    drafter.target_hook = _TargetHook(fail=True)
    with caplog.at_level(logging.ERROR, logger="vllm_specplug"):
        drafter.begin_step(["a"], None, sampled_token_ids=[[1]])
    assert drafter.budget.fault
    assert any("no features this step" in (r.getMessage() + str(r.exc_info))
               for r in caplog.records)


# ----------------------------------------------------------- step costs
def test_the_step_cost_model_gets_each_steps_verified_tokens_and_time(drafter, monkeypatch):
    clock = iter(np.arange(100.0, 200.0, 0.5))
    monkeypatch.setattr(drafter_mod.time, "perf_counter", lambda: float(next(clock)))
    samples = []
    monkeypatch.setattr(drafter.step_cost, "add",
                        lambda n, dt, rows: samples.append((n, dt, rows)))
    h = {"a": [1, 2, 3, 4, 1, 2, 3], "b": [5, 6, 7, 5, 6, 7, 5]}
    first = step(drafter, ["a", "b"], list(h.values()), [[3], [5]])
    assert samples == []                          # no earlier step to time
    drafted = sum(len(d) for d in first)
    assert drafted > 0
    assert drafter.budget.last[:2] == (("a", "b"), drafted)
    then = drafter.budget.last[2]
    h = {r: v + [v[-4]] for r, v in h.items()}
    step(drafter, ["a", "b"], list(h.values()), [[h["a"][-1]], [h["b"][-1]]])
    # one sample: the 2 rows' own tokens plus last step's drafts, over the
    # time between the two steps' clock readings
    assert len(samples) == 1 and samples[0][0] == 2 + drafted and samples[0][2] == 2
    assert samples[0][1] == drafter.budget.last[2] - then > 0
    # a step with a row not decoding is not timed, nor the one after it
    step(drafter, ["a", "b"], list(h.values()), [[h["a"][-1]], []])
    assert drafter.budget.last is None
    step(drafter, ["a", "b"], list(h.values()), [[h["a"][-1]], [h["b"][-1]]])
    assert len(samples) == 1


def test_the_step_cost_is_cached_only_when_a_cache_is_set(drafter, monkeypatch):
    saved = []
    monkeypatch.setattr(drafter_mod, "save_fit", lambda model, path: saved.append(path))
    monkeypatch.setattr(drafter_mod, "SAVE_EVERY", 1)
    drafter._cost_cache = None
    h = [[1, 2, 3, 1, 2]]
    for _ in range(3):
        step(drafter, ["a"], h, [[h[0][-1]]])
    assert saved == []
    drafter._cost_cache = "/nonexistent/cache.json"
    step(drafter, ["a"], h, [[h[0][-1]]])
    assert saved == ["/nonexistent/cache.json"]


def test_a_step_cost_cache_that_cannot_be_written_is_dropped_with_a_warning(
        drafter, monkeypatch, caplog, tmp_path):
    def broken(model, path):
        raise OSError("read-only file system")

    monkeypatch.setattr(drafter_mod, "save_fit", broken)
    monkeypatch.setattr(drafter_mod, "SAVE_EVERY", 1)
    drafter._cost_cache = str(tmp_path / "fit.json")
    h = [[1, 2, 3, 1, 2]]
    with caplog.at_level(logging.WARNING, logger="vllm_specplug"):
        for _ in range(3):
            step(drafter, ["a"], h, [[h[0][-1]]])
    assert drafter._cost_cache is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert str(tmp_path / "fit.json") in warnings[0] and "read-only file system" in warnings[0]


# ------------------------------------------------- state freed on the way out
def _bounded(patch_calls, max_tokens=20):
    d = SpecPlugDrafter(make_vllm_config())
    _attach(d, {r: _State(4, max_tokens) for r in "abc"})
    return d


def _per_request_state(d, req_id) -> dict:
    return {"seen": req_id in d.requests.running(),
            "calibration": req_id in d.calibration.pending}


def test_a_fault_frees_every_per_request_structure(patch_calls, monkeypatch):
    d = _bounded(patch_calls)
    hists = {"a": [1, 2, 3, 1, 2], "b": [4, 5, 4, 5, 4]}
    step(d, list(hists), list(hists.values()), [[2], [4]])
    hists = {r: h + [h[-2]] for r, h in hists.items()}
    step(d, list(hists), list(hists.values()), [[hists["a"][-1]], [hists["b"][-1]]])
    assert all(_per_request_state(d, "a").values()), _per_request_state(d, "a")
    _Recorder(monkeypatch, d.proposer, raise_in="propose")
    hists = {r: h + [h[-2]] for r, h in hists.items()}
    step(d, list(hists), list(hists.values()), [[hists["a"][-1]], [hists["b"][-1]]])
    assert "a" in d.containment
    assert not any(_per_request_state(d, "a").values()), _per_request_state(d, "a")
    assert _per_request_state(d, "b")["seen"]


def test_leaving_the_batch_frees_every_per_request_structure(patch_calls):
    d = _bounded(patch_calls)
    hists = {"a": [1, 2, 3, 1, 2], "b": [4, 5, 4, 5, 4]}
    step(d, list(hists), list(hists.values()), [[2], [4]])
    hists = {r: h + [h[-2]] for r, h in hists.items()}
    step(d, list(hists), list(hists.values()), [[hists["a"][-1]], [hists["b"][-1]]])
    assert all(_per_request_state(d, "a").values())
    step(d, ["b"], [hists["b"] + [5]], [[5]])              # a preempted
    assert not any(_per_request_state(d, "a").values()), _per_request_state(d, "a")
    assert d.requests.holding("preempted") == ["a"]


def test_a_faulted_request_that_finishes_leaves_no_trace(patch_calls, monkeypatch):
    d = _bounded(patch_calls)
    _Recorder(monkeypatch, d.proposer, raise_in="propose")
    step(d, ["a", "b"], [[1, 2, 3, 1, 2], [4, 5, 4, 5, 4]], [[2], [4]])
    d.requests["a"].preempted = True   # it had also been preempted before its fault
    d.finish_request("a")
    assert "a" not in d.requests and "a" not in d.containment
    assert not any(_per_request_state(d, "a").values())


def test_finish_forgets_the_request(drafter):
    step(drafter, ["a"], [[1, 2, 3, 1, 2]], [[2]])
    assert "a" in drafter.requests
    drafter.finish_request("a")
    assert "a" not in drafter.requests


def _so(scheduled_tokens):
    return NS(scheduled_new_reqs=[], total_num_scheduled_tokens=scheduled_tokens,
              finished_req_ids=set())


def test_malloc_trim_runs_only_in_a_step_that_schedules_nothing(drafter, monkeypatch):
    """Issue 45 item 4: the last running request finishing inside a step
    that schedules another one (back-to-back load) is not an idle moment:
    no trim there; the step vLLM runs with nothing scheduled is, once its
    finished requests are freed."""
    trims, written = [], []
    monkeypatch.setattr(drafter.malloc_trim, "maybe", lambda: trims.append(True))
    monkeypatch.setattr(drafter_mod.stats_export, "maybe_write",
                        lambda d, freed=False: written.append(freed))
    drafter.note_scheduler_output(_so(8))
    step(drafter, ["a", "b"], [[1, 2, 1, 2], [3, 4, 3, 4]], [[2], [4]])
    drafter.after_update_states()
    assert trims == [] and written == [False]
    written.clear()
    drafter.note_scheduler_output(_so(5))        # a new request "c" scheduled ...
    drafter.finish_request("a")                  # ... while a and b finish
    drafter.finish_request("b")
    drafter.after_update_states()
    assert trims == [] and written.count(True) == 2
    drafter.note_scheduler_output(_so(0))        # nothing scheduled: idle
    drafter.after_update_states()
    assert trims == [True]
    drafter.after_update_states()                # once per idle step
    assert trims == [True]


def test_the_update_states_patch_trims_after_the_step_freed_its_requests(monkeypatch):
    """The runner patch hands the scheduler output over before vLLM's
    ``_update_states`` (which frees finished requests) and lets the drafter
    trim after it."""
    from vllm_specplug.vllm_adapter.v1 import tenancy
    from vllm_specplug.vllm_adapter.v1.drafter_state import DrafterState

    order = []

    class Runner:
        def _update_states(self, scheduler_output):
            order.append("vllm")

    class D(DrafterState):
        def __init__(self):
            pass

        def note_scheduler_output(self, so):
            order.append("note")

        def after_update_states(self):
            order.append("after")

    runner = Runner()
    runner.drafter = D()
    patched = tenancy.make_update_states(Runner._update_states)
    patched(runner, _so(0))
    assert order == ["note", "vllm", "after"]


@pytest.mark.parametrize("hook", ["complete", "finish"])
def test_a_hook_raising_at_the_finish_frees_the_request(patch_calls, monkeypatch, hook):
    """``complete`` or ``finish`` raising as a request finishes: its state is
    freed and it is not remembered as a request decoding without drafts."""
    d = _bounded(patch_calls)
    hists = {"a": [1, 2, 3, 1, 2], "b": [4, 5, 4, 5, 4]}
    step(d, list(hists), list(hists.values()), [[2], [4]])
    hists = {r: h + [h[-2]] for r, h in hists.items()}
    step(d, list(hists), list(hists.values()), [[hists["a"][-1]], [hists["b"][-1]]])
    d.trees["a"] = d.trees.get("a") or NS()        # a tree remembered for it
    assert all(_per_request_state(d, "a").values()), _per_request_state(d, "a")
    _Recorder(monkeypatch, d.proposer, raise_in=hook)
    d.finish_request("a")
    f = d.stats()["faults"]
    assert f["hooks"] == {hook: 1} and f["requests_without_drafts"] == 0, f
    assert "a" not in d.containment and "a" not in d.trees
    assert not any(_per_request_state(d, "a").values()), _per_request_state(d, "a")


def test_a_preempted_request_that_returns_is_no_longer_preempted(drafter):
    step(drafter, ["a", "b"], [[1, 2, 1, 2], [3, 4, 3, 4]], [[2], [4]])
    step(drafter, ["b"], [[3, 4, 3, 4, 3]], [[3]])
    assert drafter.requests.holding("preempted") == ["a"]
    step(drafter, ["a", "b"], [[1, 2, 1, 2, 1], [3, 4, 3, 4, 3, 4]], [[1], [4]])
    assert not drafter.requests.holding("preempted") and "a" in drafter.requests.running()


def test_a_top_k_observe_raising_after_a_start_is_charged_to_observe(drafter, monkeypatch):
    _Recorder(monkeypatch, drafter.proposer, raise_in="observe")
    drafter.pending_topk = {"a": _topk()}
    assert step(drafter, ["a"], [[1, 2, 3, 1, 2]], [[2]]) == [[]]
    assert drafter.stats()["faults"]["hooks"] == {"observe": 1}


def test_a_fault_in_the_adapters_own_code_is_charged_to_the_adapter(drafter, monkeypatch):
    def broken(req_id, n):
        raise KeyError(req_id)

    step(drafter, ["a"], [[1, 2, 3, 1, 2]], [[2]])
    monkeypatch.setattr(drafter, "_tokens_left", broken)
    step(drafter, ["a"], [[1, 2, 3, 1, 2, 3]], [[3]])
    assert drafter.stats()["faults"]["hooks"] == {"adapter": 1}


def test_drafts_cut_by_the_batch_budget_are_told_to_the_proposer(drafter, monkeypatch):
    """The batch budget keeps fewer nodes than drafted: the proposer learns
    what was kept (``draft_cut``); raising there costs that request alone."""
    rec = _Recorder(monkeypatch, drafter.proposer)
    def cut_first(drafts, *a, explored_masks, **k):
        explored_masks.extend(np.zeros(0 if i == 0 else len(d), dtype=bool)
                              for i, d in enumerate(drafts))
        return [d.__class__.empty() if i == 0 else d for i, d in enumerate(drafts)], 0

    monkeypatch.setattr(drafter_mod, "allocate_batch_exploring", cut_first)
    hists = [[1, 2, 3, 1, 2], [4, 5, 6, 4, 5]]
    drafts = step(drafter, ["a", "b"], hists, [[2], [5]])
    assert drafts[0] == [] and drafts[1]
    cuts = [c for c in rec.calls if c[0] == "draft_cut"]
    assert [(c[1], len(c[2][0])) for c in cuts] == [("a", 0)]
    rec.raise_in = "draft_cut"
    hists = [h + [h[2]] for h in hists]
    drafts = step(drafter, ["a", "b"], hists, [[3], [6]])
    assert drafts[0] == [] and drafts[1]
    assert drafter.stats()["faults"]["hooks"] == {"draft_cut": 1}
    assert "a" in drafter.containment and "b" not in drafter.containment


def test_a_budget_fault_cuts_every_draft_and_tells_each_proposer(drafter, monkeypatch):
    rec = _Recorder(monkeypatch, drafter.proposer)

    def broken(*args, **kwargs):
        raise ArithmeticError("budget")

    monkeypatch.setattr(drafter, "_fit_to_batch", broken)
    drafts = step(drafter, ["a", "b"], [[1, 2, 3, 1, 2], [4, 5, 6, 4, 5]], [[2], [5]])
    assert drafts == [[], []]
    cuts = sorted((c[1], len(c[2][0])) for c in rec.calls if c[0] == "draft_cut")
    assert cuts == [("a", 0), ("b", 0)]
    assert drafter.stats()["faults"]["hooks"] == {"budget": 1}


def test_a_step_cost_fault_is_logged_with_its_error(drafter, monkeypatch, caplog):
    def broken(req_ids, sampled):
        raise ZeroDivisionError("no time between steps")

    monkeypatch.setattr(drafter, "_time_step", broken)
    with caplog.at_level(logging.ERROR, logger="vllm_specplug"):
        assert step(drafter, ["a"], [[1, 2, 3, 1, 2]], [[2]]) == [[]]
    assert drafter.stats()["faults"]["hooks"] == {"step_cost": 1}
    assert any("no time between steps" in (r.getMessage() + str(r.exc_info))
               for r in caplog.records)


def test_steps_disabled_by_batch_size_are_counted(patch_calls):
    d = SpecPlugDrafter(make_vllm_config({"method": "sam", "num_speculative_tokens": 4,
                                          "disable_by_batch_size": 2}))
    for i in range(3):
        h = [[1, 2] * (i + 2), [3, 4] * (i + 2)]
        assert step(d, ["a", "b"], h, [[2], [4]]) == [[], []]
    assert d.stats()["batch_budget"]["disabled_steps"] == 3


def test_nodes_past_max_tokens_add_up_over_steps(patch_calls, monkeypatch):
    d = SpecPlugDrafter(make_vllm_config())
    monkeypatch.setattr(d, "_tokens_left", lambda req_id, n: 2)
    hist = [1, 2, 3, 4, 1, 2, 3, 4, 1]
    assert len(step(d, ["a"], [hist], [[1]])[0]) == 2
    hist += [2, 3, 4]
    assert len(step(d, ["a"], [hist], [[2, 3, 4]])[0]) == 2
    assert d.stats()["batch_budget"]["nodes_past_max_tokens"] == 2 * (K - 2)


def test_propose_time_adds_up_each_calls_time(drafter, monkeypatch):
    clock = iter(np.arange(0.0, 100.0, 0.25))
    monkeypatch.setattr(drafter_mod.time, "perf_counter", lambda: float(next(clock)))
    drafted = 0
    for h in ([1, 2, 1, 2], [1, 2, 1, 2, 1]):
        drafted += sum(len(d) for d in step(drafter, ["a"], [h], [[h[-1]]]))
    # each call reads the clock at its start, in _time_step and at its end
    t = drafter.propose_time
    assert (t["calls"], t["rows"], t["seconds"]) == (2, 2, 2 * 0.5)
    # and counts the draft tokens it returned
    assert t["draft_tokens"] == drafted > 0


def test_propose_without_begin_step_names_the_missing_patch(drafter):
    num_tokens, token_ids = arrays([[1, 2, 1, 2]])
    with pytest.raises(RuntimeError) as e:
        drafter.propose([[2]], num_tokens, token_ids)
    assert str(e.value) == ("vllm_specplug: the runner patch "
                            "GPUModelRunner.propose_draft_token_ids was not applied; is the "
                            "installed vLLM supported?")
