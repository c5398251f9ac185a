"""``bench.simulate.replay``: offline greedy replay of a proposer. No vLLM."""
from __future__ import annotations

from typing import ClassVar

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vllm_specplug.bench.simulate import replay
from vllm_specplug.proposers.base import Draft, Proposer
from vllm_specplug.proposers.sam import SamProposer


class Scripted(Proposer):
    """Proposes a fixed list of drafts, one per call, and logs every call."""

    name: ClassVar[str] = "scripted"

    def __init__(self, drafts):
        self.drafts = [list(d) for d in drafts]
        self.calls: list[tuple] = []
        self.live: set[str] = set()

    def start(self, req_id, token_ids):
        self.calls.append(("start", req_id, list(token_ids)))
        self.live.add(req_id)

    def observe(self, req_id, committed_ids, target_topk=None):
        self.calls.append(("observe", req_id, list(committed_ids)))

    def propose(self, req_id, budget):
        self.calls.append(("propose", req_id, budget))
        return Draft.chain(self.drafts.pop(0))

    def finish(self, req_id):
        self.calls.append(("finish", req_id))
        self.live.discard(req_id)

    def active_requests(self):
        return len(self.live)


PROMPT = [100, 101]
OUT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


def test_replay_hand_example():
    prop = Scripted([
        [2, 3, 9],          # pos 1: 2, 3 right, 9 wrong -> commit 2 3 4 (bonus 4)
        [],                 # pos 4: no draft -> commit 5
        [7],                # pos 5: wrong -> commit 6
        [7, 8, 9, 10, 11],  # pos 6: right up to the end of the output -> commit 7 8 9 10
    ])
    res = replay(prop, PROMPT, OUT, budget=5, req_id="q")
    assert res == {"generated": 10, "steps": 5, "accepted": 5, "draft_tokens": 9, "drafts": 3}
    assert prop.drafts == []  # every scripted draft was used
    assert prop.calls == [
        ("start", "q", [100, 101, 1]),  # the prefill step produced OUT[0]
        ("propose", "q", 5), ("observe", "q", [2, 3, 4]),
        ("propose", "q", 5), ("observe", "q", [5]),
        ("propose", "q", 5), ("observe", "q", [6]),
        ("propose", "q", 5), ("observe", "q", [7, 8, 9, 10]),
        ("finish", "q"),
    ]
    assert prop.active_requests() == 0


def test_replay_draft_covering_the_rest_exactly():
    # the draft is the whole rest of the output: committed without a bonus token
    prop = Scripted([[2, 3, 4]])
    res = replay(prop, [], [1, 2, 3, 4], budget=8)
    assert res == {"generated": 4, "steps": 2, "accepted": 2, "draft_tokens": 3, "drafts": 1}
    assert prop.calls[1:] == [("propose", "r", 8), ("observe", "r", [2, 3, 4]),
                              ("finish", "r")]


def test_replay_empty_and_single_token_outputs():
    prop = Scripted([])
    assert replay(prop, [1, 2], [], 4) == {"generated": 0, "steps": 0, "accepted": 0,
                                           "draft_tokens": 0, "drafts": 0}
    assert prop.calls == []  # nothing to decode: the proposer is not even started
    assert replay(prop, [1, 2], [3], 4) == {"generated": 1, "steps": 1, "accepted": 0,
                                            "draft_tokens": 0, "drafts": 0}
    assert prop.calls == [("start", "r", [1, 2, 3]), ("finish", "r")]


@pytest.mark.parametrize("opts", [{}, {"sam_continuation": "first", "sam_min_accept_prob": 0.0}],
                         ids=["frequent", "first"])
def test_replay_sam_hand_example(opts):
    # start: [1..6, 1] -> match [1] -> draft 2 3 4 5 (K = 4), all right: commit
    # 2 3 4 5 6. Then [1..6, 1..6] -> match [1..6] -> draft 1 2 3 4, wrong: commit 7.
    prop = SamProposer(4, **opts)
    res = replay(prop, [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7], 4)
    assert res == {"generated": 7, "steps": 3, "accepted": 4, "draft_tokens": 8, "drafts": 2}
    assert prop.active_requests() == 0
    # what was learned: a length-1 match drafted 4, all accepted; a length-6 one
    # drafted 4, none accepted
    assert prop.acceptance.tried[1].tolist() == [1, 1, 1, 1]
    assert prop.acceptance.accepted[1].tolist() == [1, 1, 1, 1]
    assert prop.acceptance.tried[6].tolist() == [1, 1, 1, 1]
    assert prop.acceptance.accepted[6].tolist() == [0, 0, 0, 0]


def test_replay_budget_limits_drafts():
    # budget 2: [1] -> draft 2 3, right: commit 2 3 4; [1, 2, 3, 4] -> draft 5 6,
    # right: commit 5 6 7 (7 the bonus)
    res = replay(SamProposer(8), [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7], 2)
    assert res == {"generated": 7, "steps": 3, "accepted": 4, "draft_tokens": 4, "drafts": 2}


REPETITIVE = [5, 6, 7, 8, 9, 10, 11] * 12


def test_replay_tau_is_one_without_drafts():
    prop = SamProposer(8, sam_min_match_len=1024)
    res = replay(prop, REPETITIVE[:14], REPETITIVE, 8)
    assert res == {"generated": len(REPETITIVE), "steps": len(REPETITIVE), "accepted": 0,
                   "draft_tokens": 0, "drafts": 0}
    assert res["generated"] / res["steps"] == 1.0
    # the same output with drafting on: tau well above 1
    res = replay(SamProposer(8), REPETITIVE[:14], REPETITIVE, 8)
    assert res["generated"] / res["steps"] > 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=30), st.lists(st.integers(0, 3), max_size=60),
       st.integers(1, 8), st.sampled_from(["first", "frequent"]))
# a draft from the request's own live window in the global store (CI, 2026-12-07)
@example(prompt=[], out=[0] * 17, budget=1, continuation="frequent")
def test_replay_invariants(prompt, out, budget, continuation):
    prop = SamProposer(8, sam_continuation=continuation)
    res = replay(prop, prompt, out, budget)
    assert res["generated"] == len(out)
    assert res["generated"] == res["steps"] + res["accepted"]
    assert 0 <= res["accepted"] <= res["draft_tokens"] <= min(budget, 8) * res["drafts"]
    assert res["drafts"] <= max(res["steps"] - 1, 0)
    assert prop.active_requests() == 0
    # every verified draft was learned from, once, by its source's table (the
    # request's own text, or the global store, where its live windows go)
    tables = (prop.acceptance, prop.global_acceptance, prop.static_acceptance)
    assert sum(t.tried[:, 0].sum() for t in tables) == res["drafts"]
    assert sum(t.tried.sum() for t in tables) == res["draft_tokens"]
    # and what replay counts as accepted is what the proposer counted
    assert sum(t.accepted.sum() for t in tables) == res["accepted"]


# ---------------------------------------------------------------- trees

import numpy as np  # noqa: E402

from vllm_specplug.bench.simulate import accepted_length, replay_many  # noqa: E402
from vllm_specplug.proposers.base import TargetTopK  # noqa: E402


def brute_force_accepted(tokens, parents, truth, pos):
    """Enumerate every root-to-node path; the deepest one equal to truth[pos:]."""
    best = 0
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.append(int(tokens[j]))
            j = int(parents[j])
        path.reverse()
        if path == list(truth[pos:pos + len(path)]):
            best = max(best, len(path))
    return best


@st.composite
def trees(draw):
    n = draw(st.integers(0, 24))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    return tokens, parents


@settings(max_examples=300, deadline=None)
@given(trees(), st.lists(st.integers(0, 2), max_size=12), st.integers(0, 4))
def test_tree_acceptance_against_path_enumeration(tree, truth, pos):
    tokens, parents = tree
    draft = Draft(np.asarray(tokens), np.asarray(parents))
    assert accepted_length(draft, truth, pos) == brute_force_accepted(tokens, parents,
                                                                      truth, pos)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2), max_size=10), st.lists(st.integers(0, 2), max_size=12),
       st.integers(0, 4))
def test_chain_as_tree_same_acceptance(tokens, truth, pos):
    chain = Draft.chain(tokens)
    as_tree = Draft(np.asarray(tokens), np.arange(-1, len(tokens) - 1))
    assert accepted_length(chain, truth, pos) == accepted_length(as_tree, truth, pos)


class ScriptedTree(Scripted):
    """Scripted drafts given as (tokens, parents) or chains; logs top-k."""

    wants_target_topk: ClassVar[bool] = True

    def __init__(self, drafts, as_tree=True):
        super().__init__([])
        self.trees = list(drafts)
        self.as_tree = as_tree
        self.topk: list[TargetTopK | None] = []

    def observe(self, req_id, committed_ids, target_topk=None):
        super().observe(req_id, committed_ids)
        self.topk.append(target_topk)

    def propose(self, req_id, budget):
        self.calls.append(("propose", req_id, budget))
        tokens, parents = self.trees.pop(0)
        if parents is None:
            parents = list(range(-1, len(tokens) - 1))
            if not self.as_tree:
                return Draft.chain(tokens)
        return Draft(np.asarray(tokens, dtype=np.int32), np.asarray(parents))


def test_tree_replay_hand_example_and_topk_rows():
    out = [1, 2, 3, 4, 5, 6, 7, 8]
    # the target's top-k: row j predicts out[j]; rank 0 is the truth, rank 1 is 50 + j
    ids = np.array([[t, 50 + j] for j, t in enumerate(out)])
    logprobs = np.log(np.array([[0.6, 0.3]] * len(out)))
    prop = ScriptedTree([
        # pos 1: root children 9 and 2; 2 -> 3 -> 9 and 2 -> 3 -> 4: depth 3 accepted
        ([9, 2, 3, 9, 4], [-1, -1, 1, 2, 2]),
        # pos 5: [6, 7] matches only below a wrong root: nothing accepted
        ([5, 6, 7], [-1, 0, 0]),
        ([7, 8], None),        # pos 6: a chain, right to the end: no bonus
    ])
    res = replay(prop, [100, 101], out, budget=5, topk=(ids, logprobs))
    assert res == {"generated": 8, "steps": 4, "accepted": 4, "draft_tokens": 10, "drafts": 3}
    assert [c for c in prop.calls if c[0] == "observe"] == [
        ("observe", "r", []), ("observe", "r", [2, 3, 4, 5]), ("observe", "r", [6]),
        ("observe", "r", [7, 8])]
    # the prefill's position (input: the prompt's last token), then per step
    # the accepted path and the bonus position
    rows = [(t.input_ids.tolist(), t.token_ids[:, 0].tolist()) for t in prop.topk]
    assert rows == [([101], [1]), ([1, 2, 3, 4], [2, 3, 4, 5]), ([5], [6]), ([6, 7], [7, 8])]
    assert prop.topk[1].token_ids[:, 1].tolist() == [51, 52, 53, 54]
    assert np.allclose(prop.topk[0].logprobs, np.log([[0.6, 0.3]]))


def test_tree_replay_cuts_drafts_to_the_budget():
    prop = ScriptedTree([([2, 9, 3, 4], [-1, -1, 0, 2]), ([], None)])
    # budget 3 keeps nodes 0-2 (the engine keeps a prefix of the node order)
    res = replay(prop, [0], [1, 2, 3, 4, 5], budget=3)
    assert res == {"generated": 5, "steps": 3, "accepted": 2, "draft_tokens": 3, "drafts": 1}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=6), min_size=1, max_size=12),
       st.lists(st.integers(0, 3), min_size=1, max_size=14))
def test_chain_drafts_same_result_as_trees_of_chains(drafts, out):
    drafts = drafts + [[]] * len(out)
    chain = ScriptedTree([(d, None) for d in drafts], as_tree=False)
    tree = ScriptedTree([(d, None) for d in drafts], as_tree=True)
    assert replay(chain, [7], out, 8) == replay(tree, [7], out, 8)
    assert chain.calls == tree.calls


def test_replay_many_takes_topk_per_request():
    out = [1, 2, 3]
    ids = np.array([[1], [2], [3]])
    prop = ScriptedTree([([2, 3], None)] * 2)
    res = replay_many(prop, [([0], out, (ids, np.zeros((3, 1)))), ([0], out)], 4)
    assert res["tau"] == 6 / 4
    fed = [t for t in prop.topk if t is not None]
    assert len(fed) == 2   # the first request only: prefill row, then one step
    with pytest.raises(ValueError, match="topk has 2 rows"):
        replay(ScriptedTree([]), [0], out, 4, topk=(ids[:2], np.zeros((2, 1))))


def chain_replay_before_trees(proposer, prompt_ids, output_ids, budget, req_id="r"):
    """``replay`` as it was before tree drafts (chains only), for reference."""
    out = list(output_ids)
    if not out:
        return {"generated": 0, "steps": 0, "accepted": 0, "draft_tokens": 0, "drafts": 0}
    proposer.start(req_id, list(prompt_ids) + out[:1])
    pos, steps, accepted, draft_tokens, drafts = 1, 1, 0, 0, 0
    while pos < len(out):
        draft = proposer.propose(req_id, budget).tokens.tolist()
        a = 0
        while a < len(draft) and pos + a < len(out) and draft[a] == out[pos + a]:
            a += 1
        if draft:
            drafts += 1
            draft_tokens += len(draft)
        n = min(a + 1, len(out) - pos)
        proposer.observe(req_id, out[pos:pos + n])
        accepted += n - 1
        pos += n
        steps += 1
    proposer.complete(req_id)
    proposer.finish(req_id)
    return {"generated": len(out), "steps": steps, "accepted": accepted,
            "draft_tokens": draft_tokens, "drafts": drafts}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=20), st.lists(st.integers(0, 3), max_size=50),
       st.integers(1, 8), st.sampled_from(["first", "frequent"]))
def test_chain_replay_unchanged(prompt, out, budget, continuation):
    """Chain proposers: the tree-aware replay gives what the chain replay gave."""
    new = SamProposer(8, sam_continuation=continuation, sam_global_tokens=0)
    old = SamProposer(8, sam_continuation=continuation, sam_global_tokens=0)
    assert replay(new, prompt, out, budget) == chain_replay_before_trees(old, prompt, out,
                                                                         budget)
    assert new.acceptance.accepted.tolist() == old.acceptance.accepted.tolist()
