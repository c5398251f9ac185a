"""Faults on the tree verification path are contained (issue 45, finding 3),
fast tier: the ``_sample`` patch, ``tree_runtime.accept_trees`` and the CPU
tree attention layer driven with a fake runner around a real drafter, no
engine.

A fault while scoring one request's tree (its scorer raises, a third-party
one included, or returns something that is no path of the draft; its target
distribution holds NaN; its seeded replay raises) costs that request its
drafts, this step and after, never the engine nor the other requests: the
row gets plain decoding's next token from its root row (no draft accepted)
and the fault is counted in ``stats()["faults"]``. A failure of tree
attention or of the KV compaction costs the step's drafts of the tree
requests it touched (counted as a shared step), a failure of tree
preparation gives the step's drafts to vLLM's chain verification. No engine
test injects these faults yet (tests/test_engine_faults.py: proposer hooks)."""
from __future__ import annotations

import importlib.metadata
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import vllm_specplug.vllm_adapter.v1 as adapter
from helpers import arrays, make_vllm_config
from vllm_specplug import faults
from vllm_specplug.proposers.base import Draft
from vllm_specplug.scorers import registry as scorer_registry
from vllm_specplug.scorers.base import Acceptance, Scorer
from vllm_specplug.vllm_adapter.v1 import sample, seeded, tree_runtime
from vllm_specplug.vllm_adapter.v1.drafter import SpecPlugDrafter

V = 8                                   # vocabulary
PARENTS = np.array([-1, -1, 0])         # root -> nodes 0, 1; node 0 -> node 2
TOKENS = np.array([1, 2, 5])
N = len(PARENTS)
# vLLM's rejection sampler's rows (its verification of the flattened draft):
# the first token of each is its verification of the root's row
VLLM_ROWS = [[3, 4, 4, -1], [7, -1, -1, -1], [6, 1, -1, -1]]


@pytest.fixture(autouse=True)
def _no_patches(patch_calls, monkeypatch):
    monkeypatch.setattr(adapter, "install_tree_patches", lambda *a: None)
    monkeypatch.delenv(faults.ENV, raising=False)
    monkeypatch.setenv("VLLM_SPECPLUG_STEP_COST_CACHE", "0")


def make_drafter(**extra) -> SpecPlugDrafter:
    spec = {"method": "sam", "num_speculative_tokens": 4, "batch_budget": "off", **extra}
    return SpecPlugDrafter(make_vllm_config(spec))


def peaked(tokens: list[int]) -> torch.Tensor:
    """Logits rows (root, then one per node), row j sure of ``tokens[j]``."""
    rows = torch.zeros(len(tokens), V)
    rows[torch.arange(len(tokens)), torch.tensor(tokens)] = 60.0
    return rows


# a distribution that accepts node 0 then node 2 (a path that needs a KV
# move), then emits 6: the row [1, 5, 6]
ACCEPTING = [1, 5, 0, 6]


def tree(req_id: str, row: int, greedy: bool = False, chain: bool = False):
    parents = np.arange(-1, N - 1) if chain else PARENTS
    tr = tree_runtime.tree_request(req_id, row, row * (N + 1), 5, parents, TOKENS,
                                   np.arange(4), 16)
    tr.greedy, tr.chain = greedy, chain
    tr.temperature = 0.0 if greedy else 1.0
    return tr


class Runner(SimpleNamespace):
    """What accept_trees and the _sample patch read of vLLM's runner."""


def runner_for(drafter, trs, sm=None, requests=None) -> Runner:
    sm = sm or SimpleNamespace(generators={})
    return Runner(drafter=drafter, kv_caches=[torch.zeros(4, 1, 16, 8)],
                  input_batch=SimpleNamespace(sampling_metadata=sm,
                                              req_ids=[tr.req_id for tr in trs]),
                  requests=requests or {},
                  sampler=SimpleNamespace(topk_topp_sampler=gumbel))


def vllm_output(rows: int = 3):
    return SimpleNamespace(sampled_token_ids=torch.tensor(VLLM_ROWS[:rows]),
                           logprobs_tensors=None)


def gumbel(logits, generators, k, p):
    """A sampler module's draw (``topk_topp_sampler``): Gumbel argmax with the
    row's generator."""
    u = torch.rand(logits.shape, generator=generators[0])
    return (logits - torch.log(-torch.log(u))).argmax(dim=-1), None


def row_of(out, row):
    return out.sampled_token_ids[row].tolist()


def fault_stats(d):
    return d.stats()["faults"]


# ------------------------------------------------------- a NaN root row
def test_nan_root_row_through_the_sample_patch_returns_vllms_token(caplog):
    """The ``_sample`` patch end to end: one request's root row holds a NaN
    (the rejection scorer would raise 'Probabilities contain NaN'): its row
    is vLLM's own token for that position with no draft accepted, the fault
    is counted and logged once, the other request's tree is accepted as
    usual, and the request drafts nothing from then on."""
    d = make_drafter()
    trs = [tree("a", 0), tree("b", 1)]
    logits = torch.cat([peaked(ACCEPTING), peaked(ACCEPTING)])
    logits[0, 3] = float("nan")
    runner = runner_for(d, trs)
    runner.rejection_sampler = SimpleNamespace(is_processed_logprobs_mode=False)
    d.step.requests = list(trs)
    meta = SimpleNamespace(max_spec_len=N, cu_num_sampled_tokens=torch.tensor([4, 8]),
                           num_draft_tokens=[N, N])
    out = vllm_output(2)
    patched = sample.make_sample(lambda self, logits, meta: out)
    with caplog.at_level(logging.ERROR, logger="vllm_specplug"):
        got = patched(runner, logits, meta)
    assert got is out
    assert row_of(out, 0) == [3, -1, -1, -1]        # vLLM's token, nothing accepted
    assert row_of(out, 1) == [1, 5, 6, -1]          # b: accepted as usual
    assert d.step.accepted_paths == {"a": [], "b": [0, 2]}
    f = fault_stats(d)
    assert f["requests"] == 1 and f["hooks"] == {"tree_scorer": 1}, f
    assert "a" in d.containment and "b" not in d.containment
    records = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(records) == 1 and "NaN" in str(records[0].exc_info[1])
    assert d.step.stats["fault_rows"] == 1 and not d.step.requests   # the step was cleared
    # the next steps: a decodes without drafts, b drafts on
    hist = {"a": [10, 11, 12] * 4, "b": [20, 21, 22] * 4}
    d.begin_step(["a", "b"], None)
    num, ids = arrays(list(hist.values()))
    drafts = d.propose([[h[-1]] for h in hist.values()], num, ids)
    assert drafts[0] == [] and drafts[1]


def test_nan_root_row_of_a_greedy_request_is_plain_decodings_argmax():
    """A greedy row is not scored by probabilities: plain decoding's argmax
    (torch's, NaN first, as vLLM's greedy sampler) is what it emits."""
    d = make_drafter()
    trs = [tree("g", 0, greedy=True)]
    rows = peaked(ACCEPTING)
    rows[0, 6] = float("nan")
    out = vllm_output(1)
    d.step.requests = trs
    tree_runtime.accept_trees(runner_for(d, trs), [rows.argmax(-1)], out)
    assert row_of(out, 0) == [6, -1, -1, -1]
    assert fault_stats(d)["requests"] == 0


# ------------------------------------------------------ third-party scorers
class RaisingScorer(Scorer):
    """A third-party rule with a bug: it raises when the root's row is sure
    of token 2 (request a's here); otherwise accepts node 0 and the argmax
    of its row."""
    name = "raising"

    def accept(self, draft, target_probs, draft_probs, rng):
        if int(np.argmax(target_probs[0])) == 2:
            raise RuntimeError("third-party scorer bug")
        return Acceptance([0], int(np.argmax(target_probs[1])))


class PathlessScorer(Scorer):
    """Returns node 2 without its parent, node 0: not a path of the draft."""
    name = "pathless"

    def accept(self, draft, target_probs, draft_probs, rng):
        return Acceptance([2], 0)


@pytest.fixture
def third_party(monkeypatch):
    """The scorer registry sees RaisingScorer and PathlessScorer as installed
    plugins (entry points of ``vllm_specplug.scorers``)."""
    eps = [importlib.metadata.EntryPoint(name=name, value=f"test_tree_faults:{cls}",
                                         group=scorer_registry.SCORER_GROUP)
           for name, cls in (("raising", "RaisingScorer"), ("pathless", "PathlessScorer"))]
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None: [e for e in eps if e.group == group])
    scorer_registry.SCORERS.reset()
    yield
    monkeypatch.undo()
    scorer_registry.SCORERS.reset()


def test_a_raising_third_party_scorer_costs_only_its_requests_drafts(third_party, caplog):
    d = make_drafter(acceptance="raising")
    assert type(d.scorer).__name__ == "RaisingScorer"
    trs = [tree("a", 0), tree("b", 1), tree("c", 2, chain=True)]
    rows = [peaked([2, 0, 0, 0]), peaked(ACCEPTING), peaked([1, 4, 0, 0])]
    d.step.requests = trs
    out = vllm_output()
    with caplog.at_level(logging.ERROR, logger="vllm_specplug"):
        tree_runtime.accept_trees(runner_for(d, trs), rows, out)
    assert row_of(out, 0) == [3, -1, -1, -1]        # vLLM's token for a
    assert row_of(out, 1) == [1, 5, -1, -1]         # b: the scorer's path [0], bonus 5
    assert row_of(out, 2) == [1, 4, -1, -1]         # c (a routed chain): scored too
    f = fault_stats(d)
    assert f["requests"] == 1 and f["hooks"] == {"tree_scorer": 1}, f
    assert list(d.containment.faulted) == ["a"]
    assert "third-party scorer bug" in str(caplog.records[0].exc_info[1])


def test_a_scorer_result_that_is_no_path_of_the_draft_is_a_fault(third_party):
    """Node 2 without its parent would commit a token sequence no draft
    path carries and move the KV of the wrong node: refused, contained."""
    d = make_drafter(acceptance="pathless")
    trs = [tree("a", 0)]
    d.step.requests = trs
    out = vllm_output(1)
    tree_runtime.accept_trees(runner_for(d, trs), [peaked(ACCEPTING)], out)
    assert row_of(out, 0) == [3, -1, -1, -1]
    assert fault_stats(d)["hooks"] == {"tree_scorer": 1}


def test_check_acceptance():
    draft = Draft(TOKENS, PARENTS)
    tree_runtime.check_acceptance(Acceptance([0, 2], 3), draft, V)
    tree_runtime.check_acceptance(Acceptance([], 7), draft, V)
    for bad in (Acceptance([2], 3), Acceptance([1, 2], 3), Acceptance([3], 0),
                Acceptance([-1], 0), Acceptance([0], V), Acceptance([0], -1)):
        with pytest.raises(ValueError):
            tree_runtime.check_acceptance(bad, draft, V)


# ---------------------------------------------------------- seeded replay
def seeded_runner(d, trs, gen):
    sm = SimpleNamespace(generators={0: gen}, allowed_token_ids_mask=None,
                         bad_words_token_ids={}, no_penalties=True,
                         temperature=torch.ones(len(trs)), top_k=None, top_p=None)
    params = SimpleNamespace(min_tokens=0, all_stop_token_ids=set())
    requests = {tr.req_id: SimpleNamespace(sampling_params=params, output_token_ids=[])
                for tr in trs}
    return runner_for(d, trs, sm, requests)


def plain_draw(root_row: torch.Tensor, state: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Plain decoding's token from ``root_row`` with a generator at ``state``,
    and the generator's state after that one draw."""
    gen = torch.Generator()
    gen.set_state(state)
    tok, _ = gumbel(root_row[None].clone(), {0: gen}, None, None)
    return int(tok[0]), gen.get_state()


def _seeded_tree():
    """A drafter holding one seeded tree request "s", its generator, the
    generator's state at the step's start, and the tree's logit rows."""
    d = make_drafter()
    trs = [tree("s", 0)]
    d.step.requests = trs
    gen = torch.Generator().manual_seed(11)
    start = gen.get_state()
    rows = torch.randn(N + 1, V, generator=torch.Generator().manual_seed(3))
    return d, trs, gen, start, rows


@pytest.mark.parametrize("always", [False, True])
def test_a_failing_seeded_replay_is_contained(monkeypatch, always):
    """The replay of a seeded tree raises: the row gets plain decoding's draw
    from the root row with the generator at the step's start, and the
    generator ends one draw on, as plain decoding's (``always``: the replay
    of the root alone raises too: vLLM's own token, the generator left at
    the step's start)."""
    d, trs, gen, start, rows = _seeded_tree()
    original = seeded.replay_row

    def replay_row(runner, row, draft, raw):
        if always or len(draft):
            torch.rand(5, generator=gen)   # it drew before raising
            raise RuntimeError("replay bug")
        return original(runner, row, draft, raw)

    monkeypatch.setattr(seeded, "replay_row", replay_row)
    out = vllm_output(1)
    tree_runtime.accept_trees(seeded_runner(d, trs, gen), [rows], out, seeded={0: start})
    want, after = plain_draw(rows[0], start)
    if always:
        assert row_of(out, 0) == [3, -1, -1, -1]
        assert torch.equal(gen.get_state(), start)
    else:
        assert row_of(out, 0) == [want, -1, -1, -1]
        assert torch.equal(gen.get_state(), after)
    assert fault_stats(d)["hooks"] == {"seeded_replay": 1}
    assert "s" in d.containment


def test_a_seeded_tree_replays_plain_decodings_draws_without_a_fault():
    """(The fake runner is faithful: without a fault the seeded tree row is
    plain decoding's draw too, here with no draft accepted.)"""
    d, trs, gen, start, rows = _seeded_tree()
    rows[0, TOKENS[PARENTS == -1]] = -1e9   # no child of the root can be drawn
    out = vllm_output(1)
    tree_runtime.accept_trees(seeded_runner(d, trs, gen), [rows], out, seeded={0: start})
    assert row_of(out, 0) == [plain_draw(rows[0], start)[0], -1, -1, -1]
    assert fault_stats(d)["requests"] == 0


def sample_seeded_chain(d, gen, replay_row=None, recompute=None, monkeypatch=None):
    """One step of the ``_sample`` patch for a seeded request whose draft is a
    chain (vLLM's chain path verifies it, then its row is replayed); vLLM's
    sampler is a fake that draws from the request's generator. Returns the
    sampler's output and the generator's state after vLLM's draws."""
    runner = seeded_runner(d, [tree("s", 0)], gen)
    runner.rejection_sampler = SimpleNamespace(is_processed_logprobs_mode=False)
    params = runner.requests["s"].sampling_params
    params.thinking_token_budget = params.logprob_token_ids = params.logprobs = None
    meta = SimpleNamespace(max_spec_len=N, cu_num_sampled_tokens=torch.tensor([N + 1]),
                           cu_num_draft_tokens=torch.tensor([N]), num_draft_tokens=[N],
                           draft_token_ids=torch.tensor(TOKENS))
    out = vllm_output(1)
    drawn = {}

    def vllm_sampler(self, logits, meta):
        torch.rand(4, generator=gen)
        drawn["state"] = gen.get_state()
        return out

    if replay_row is not None:
        monkeypatch.setattr(seeded, "replay_row", replay_row)
    if recompute is not None:
        monkeypatch.setattr(seeded, "recompute_logprobs", recompute)
    sample.make_sample(vllm_sampler)(runner, torch.randn(N + 1, V), meta)
    return out, drawn["state"]


def test_a_failing_seeded_chain_replay_keeps_vllms_verification(monkeypatch):
    """A seeded chain row (vLLM's chain path) whose replay raises keeps
    vLLM's own verification of the step, its generator where vLLM's draws
    left it; the request drafts nothing more."""
    d = make_drafter()
    gen = torch.Generator().manual_seed(5)

    def replay_row(*args):
        torch.rand(3, generator=gen)
        raise RuntimeError("replay bug")

    out, drawn = sample_seeded_chain(d, gen, replay_row=replay_row, monkeypatch=monkeypatch)
    assert row_of(out, 0) == VLLM_ROWS[0]
    assert torch.equal(gen.get_state(), drawn)
    assert fault_stats(d)["hooks"] == {"seeded_replay": 1} and "s" in d.containment


def test_a_seeded_chain_is_replayed_without_a_fault():
    """(Without a fault the row is replaced by the replay: plain decoding's
    draws from the step's start.)"""
    d = make_drafter()
    gen = torch.Generator().manual_seed(5)
    out, drawn = sample_seeded_chain(d, gen)
    assert row_of(out, 0) != VLLM_ROWS[0] and not torch.equal(gen.get_state(), drawn)
    assert fault_stats(d)["requests"] == 0 and d.step.stats["seeded_chain_steps"] == 1


def test_failing_to_find_the_seeded_rows_leaves_vllms_verification(monkeypatch):
    d = make_drafter()
    gen = torch.Generator().manual_seed(5)

    def seeded_rows(*args):
        raise RuntimeError("seeded rows bug")

    monkeypatch.setattr(seeded, "seeded_rows", seeded_rows)
    out, drawn = sample_seeded_chain(d, gen)
    assert row_of(out, 0) == VLLM_ROWS[0] and torch.equal(gen.get_state(), drawn)
    f = fault_stats(d)
    assert f["steps"] == 1 and f["requests"] == 0 and f["hooks"] == {"seeded_replay": 1}


def test_failing_logprobs_after_a_chain_replay_restore_vllms_rows(monkeypatch):
    d = make_drafter()
    gen = torch.Generator().manual_seed(5)

    def recompute(*args):
        raise RuntimeError("logprobs bug")

    out, drawn = sample_seeded_chain(d, gen, recompute=recompute, monkeypatch=monkeypatch)
    assert row_of(out, 0) == VLLM_ROWS[0] and torch.equal(gen.get_state(), drawn)
    f = fault_stats(d)
    assert f["steps"] == 1 and f["requests"] == 0 and f["hooks"] == {"seeded_replay": 1}


# ------------------------------------------------- tree attention, compaction
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_tree_attention_failure_in_a_layer_is_contained(monkeypatch, device):
    """Our attention layer (CPU_ATTN's, or FLASH_ATTN's on CUDA, its Python
    code run here without a GPU): vLLM's kernel runs, our recomputation
    raises (out of memory, a kernel launch): the forward returns, the error
    is kept on the step and the following layers skip tree rows."""
    from vllm_specplug.vllm_adapter.v1.step_state import StepTrees

    if device == "cpu":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as Base

        from vllm_specplug.vllm_adapter.v1 import tree_attention as layers
        cls, name = layers.TreeCPUAttentionImpl, "tree_attention"
    else:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl as Base

        from vllm_specplug.vllm_adapter.v1 import tree_attention_cuda as layers
        cls, name = layers.TreeFlashAttentionImpl, "flash_tree_attention"
    monkeypatch.setattr(Base, "forward", lambda self, *a, **k: "vllm's")

    def oom(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(layers, name, oom)
    impl = cls.__new__(cls)
    impl.tree_layer, impl.tree_warm = True, True
    step = StepTrees(requests=[object()], attended=True)
    impl.tree_step = step
    meta = SimpleNamespace(block_table=torch.zeros(1, 1))
    args = (None, torch.zeros(1), None, None, torch.zeros(1), meta, torch.zeros(1))
    assert impl.forward(*args) == "vllm's"
    assert isinstance(step.attention_error, RuntimeError) and not step.attended
    assert impl.tree_step_now() is None          # later layers: vLLM's kernel only
    step.clear()
    assert step.attention_error is None


def test_after_a_tree_attention_failure_every_tree_row_is_plain_decodings():
    """Tree rows accept no draft: greedy rows get their root row's argmax,
    sampled ones vLLM's own token; a chain routed to the tree path (its rows
    are vLLM's causal attention's) is scored as usual. One shared fault, no
    request loses its later drafts."""
    d = make_drafter()
    trs = [tree("g", 0, greedy=True), tree("s", 1), tree("c", 2, chain=True)]
    d.step.requests = trs
    d.step.fail_attention(RuntimeError("tree attention failed"))
    rows = [peaked([4, 5, 0, 6]).argmax(-1), peaked(ACCEPTING), peaked([1, 2, 5, 0])]
    out = vllm_output()
    tree_runtime.accept_trees(runner_for(d, trs), rows, out)
    assert row_of(out, 0) == [4, -1, -1, -1]
    assert row_of(out, 1) == [7, -1, -1, -1]
    assert row_of(out, 2) == [1, 2, 5, 0]            # the chain: every node accepted
    f = fault_stats(d)
    assert f["steps"] == 1 and f["requests"] == 0 and f["hooks"] == {"tree_attention": 1}
    assert d.step.stats["fault_rows"] == 2


def test_a_failing_kv_compaction_leaves_no_draft_accepted(monkeypatch):
    from vllm_specplug.vllm_adapter.v1 import cpu_kv

    def move(*args):
        raise RuntimeError("move bug")

    monkeypatch.setattr(cpu_kv, "move", move)
    d = make_drafter()
    trs = [tree("g", 0, greedy=True), tree("s", 1)]
    d.step.requests = trs
    rows = [peaked([1, 2, 0, 6]).argmax(-1), peaked(ACCEPTING)]   # g's path [0] moves nothing
    out = vllm_output(2)
    tree_runtime.accept_trees(runner_for(d, trs), rows, out)
    assert row_of(out, 0) == [1, 2, -1, -1]
    assert row_of(out, 1) == [7, -1, -1, -1]          # its path [0, 2] needed a move
    assert d.step.accepted_paths == {"g": [0], "s": []}
    assert d.step.stats["tree_accepted"] == 1
    assert fault_stats(d)["hooks"] == {"tree_compaction": 1}


def test_a_failing_logits_copy_costs_its_request_only(monkeypatch):
    d = make_drafter()
    trs = [tree("a", 0, greedy=True), tree("b", 1, greedy=True)]
    trs[0].stop_levels, trs[0].stop_ids = 1, [99]      # out of the vocabulary: raises
    d.step.requests = trs
    logits = torch.cat([peaked([1, 5, 0, 6]), peaked([1, 5, 0, 6])])
    rows = tree_runtime.tree_logits(logits, SimpleNamespace(
        cu_num_sampled_tokens=torch.tensor([4, 8])), d.step)
    assert rows[0] is None and "a" in d.step.row_faults
    out = vllm_output(2)
    tree_runtime.accept_trees(runner_for(d, trs), rows, out)
    assert row_of(out, 0) == [3, -1, -1, -1]
    assert row_of(out, 1) == [1, 5, 6, -1]
    assert fault_stats(d)["hooks"] == {"tree_logits": 1}


def test_anything_else_costs_the_steps_tree_drafts_only(monkeypatch):
    """The last guard: an unexpected error in acceptance (here writing the
    output) leaves every tree row with vLLM's first token."""
    d = make_drafter()
    trs = [tree("a", 0), tree("b", 1)]
    d.step.requests = trs
    calls = []
    original = seeded.write_row

    def write_row(out, row, tokens):
        calls.append(row)
        if len(calls) == 2:
            raise RuntimeError("bug")
        original(out, row, tokens)

    monkeypatch.setattr(seeded, "write_row", write_row)
    out = vllm_output(2)
    tree_runtime.accept_trees(runner_for(d, trs), [peaked(ACCEPTING)] * 2, out)
    assert row_of(out, 0) == [3, -1, -1, -1] and row_of(out, 1) == [7, -1, -1, -1]
    assert fault_stats(d)["hooks"] == {"tree_acceptance": 1}


def test_a_failing_tree_preparation_gives_the_drafts_to_vllms_chain_path(monkeypatch):
    """``_prepare_inputs``: tree preparation rewrote a request's position ids
    and then raised: vLLM's positions are back, the step has no tree request
    (vLLM verifies every draft as a chain, causal and lossless), one shared
    fault is counted."""
    d = make_drafter()
    d.trees["a"] = Draft(TOKENS, PARENTS)
    runner = Runner(drafter=d, positions=torch.arange(10, 18))
    scheduler_output = SimpleNamespace(total_num_scheduled_tokens=8)

    def prepare(runner, scheduler_output):
        runner.positions[1:4] = torch.tensor([11, 11, 12])
        d.step.requests.append(tree("a", 0))
        d.step.attended = True
        raise RuntimeError("prepare bug")

    monkeypatch.setattr(tree_runtime, "prepare_tree_requests", prepare)
    patched = tree_runtime.make_prepare_inputs(lambda self, so: "vllm's")
    assert patched(runner, scheduler_output) == "vllm's"
    assert runner.positions.tolist() == list(range(10, 18))
    assert not d.step.requests and not d.step.attended
    assert fault_stats(d)["hooks"] == {"tree_prepare": 1} and fault_stats(d)["requests"] == 0
