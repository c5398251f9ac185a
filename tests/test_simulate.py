"""``bench.simulate.replay``: offline greedy replay of a proposer. No vLLM."""
from __future__ import annotations

from typing import ClassVar

import pytest
from hypothesis import given, settings
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
def test_replay_invariants(prompt, out, budget, continuation):
    prop = SamProposer(8, sam_continuation=continuation)
    res = replay(prop, prompt, out, budget)
    assert res["generated"] == len(out)
    assert res["generated"] == res["steps"] + res["accepted"]
    assert 0 <= res["accepted"] <= res["draft_tokens"] <= min(budget, 8) * res["drafts"]
    assert res["drafts"] <= max(res["steps"] - 1, 0)
    assert prop.active_requests() == 0
    # every verified draft was learned from, once
    assert prop.acceptance.tried[:, 0].sum() == res["drafts"]
    assert prop.acceptance.tried.sum() == res["draft_tokens"]
    # and what replay counts as accepted is what the proposer counted
    assert prop.acceptance.accepted.sum() == res["accepted"]
