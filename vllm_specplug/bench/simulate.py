"""Replay greedy decoding offline to measure a proposer's tau in milliseconds.

At temperature 0 the output of a lossless method is plain decoding's output,
so a draft's accepted length is its longest common prefix with the true
continuation. ``replay`` drives a proposer exactly as the vLLM drafter does
(start after the prefill step, then propose / accept / observe per step) and
counts target steps, giving the same tau the engine would (chains only).
"""
from __future__ import annotations

from typing import Sequence

from ..proposers.base import Proposer


def replay(proposer: Proposer, prompt_ids: Sequence[int], output_ids: Sequence[int],
           budget: int, req_id: str = "r") -> dict:
    out = list(output_ids)
    if not out:
        return {"generated": 0, "steps": 0, "accepted": 0, "draft_tokens": 0, "drafts": 0}
    proposer.start(req_id, list(prompt_ids) + out[:1])  # the prefill step made out[0]
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


def replay_many(proposer: Proposer, requests: Sequence[tuple[Sequence[int], Sequence[int]]],
                budget: int) -> dict:
    """``replay`` of (prompt ids, output ids) pairs one after another with one
    proposer (batch size 1: each request finishes before the next starts, so
    what a proposer keeps across requests is used); totals and tau."""
    total = {"generated": 0, "steps": 0, "accepted": 0, "draft_tokens": 0, "drafts": 0}
    for i, (prompt, output) in enumerate(requests):
        res = replay(proposer, prompt, output, budget, req_id=f"r{i}")
        for key in total:
            total[key] += res[key]
    total["tau"] = total["generated"] / total["steps"] if total["steps"] else 1.0
    return total
