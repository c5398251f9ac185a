"""Replay greedy decoding offline to measure a proposer's tau in milliseconds.

At temperature 0 the output of a lossless method is plain decoding's output,
so a draft's accepted length is the depth of its deepest node whose path from
the root matches the true continuation (for a chain: its longest common
prefix with it). ``replay`` drives a proposer exactly as the vLLM drafter
does at batch size 1 (start after the prefill step, then propose / accept /
observe per step) and counts target steps, giving the tau the engine would.

Proposers that want the target's top-k (``wants_target_topk``: Token
Recycling, ``sam_tr``) get it from a recording of the target's top-k along
the true output (``topk``: one row per output position, the distribution
that predicts that token). In the engine every scored position is fed:
the last committed token and every draft node, rejected ones included. The
replay knows the target's top-k only along the true path, so it feeds the
positions of the accepted path and the bonus position (and, after start,
the prefill's last position, as the engine does). Rejected nodes' top-k
are missing: Token Recycling's matrix learns less per step than in the
engine (an approximation; see docs/acceptance_curves.md).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..proposers.base import Draft, Proposer, TargetTopK

COUNTERS = ("generated", "steps", "accepted", "draft_tokens", "drafts")


def accepted_length(draft: Draft, truth: Sequence[int], pos: int = 0) -> int:
    """Greedy acceptance of a chain or tree: the depth of the deepest node
    whose tokens from the root match ``truth[pos:]`` (0: none)."""
    tokens = draft.tokens
    if draft.parents is None:  # a chain: longest common prefix
        a, end = 0, min(tokens.size, len(truth) - pos)
        while a < end and tokens[a] == truth[pos + a]:
            a += 1
        return a
    parents = draft.parents
    depth = np.zeros(tokens.size, dtype=np.int64)   # 0: node not on a matching path
    best = 0
    for i in range(tokens.size):
        p = parents[i]
        d = 1 if p < 0 else (depth[p] + 1 if depth[p] else 0)
        if d and pos + d - 1 < len(truth) and tokens[i] == truth[pos + d - 1]:
            depth[i] = d
            if d > best:
                best = d
    return int(best)


def within_budget(draft: Draft, budget: int) -> Draft:
    """The draft as the drafter verifies it: a prefix of its node order of at
    most ``budget`` nodes."""
    if len(draft) <= budget:
        return draft
    keep = np.arange(len(draft)) < budget
    return Draft(draft.tokens[keep], None if draft.parents is None else draft.parents[keep])


def _topk_rows(topk, out: Sequence[int], prompt_last: int | None, lo: int, hi: int
               ) -> TargetTopK:
    """The target's top-k at output positions lo..hi-1 (each row predicts
    out[j]; its input token is out[j - 1], or the prompt's last token)."""
    ids, logprobs = topk
    inputs = [out[j - 1] if j > 0 else prompt_last for j in range(lo, hi)]
    return TargetTopK(np.asarray(inputs, dtype=np.int32),
                      np.asarray(ids[lo:hi], dtype=np.int32),
                      np.asarray(logprobs[lo:hi], dtype=np.float32))


def replay(proposer: Proposer, prompt_ids: Sequence[int], output_ids: Sequence[int],
           budget: int, req_id: str = "r", topk: tuple | None = None) -> dict:
    """One request at batch size 1. ``topk``: ``(ids [len(out), k], logprobs
    [len(out), k])``, the target's top-k predicting each output token, fed to
    proposers that want it (without it they get none)."""
    out = list(output_ids)
    if not out:
        return {key: 0 for key in COUNTERS}
    feed = topk is not None and proposer.wants_target_topk
    if feed and len(topk[0]) < len(out):
        raise ValueError(f"topk has {len(topk[0])} rows for {len(out)} output tokens")
    prompt_last = int(prompt_ids[-1]) if len(prompt_ids) else None
    proposer.start(req_id, list(prompt_ids) + out[:1])  # the prefill step made out[0]
    if feed and prompt_last is not None:
        # the prefill's last position, scored in the engine's first step
        proposer.observe(req_id, [], _topk_rows(topk, out, prompt_last, 0, 1))
    pos, steps, accepted, draft_tokens, drafts = 1, 1, 0, 0, 0
    while pos < len(out):
        draft = within_budget(proposer.propose(req_id, budget), budget)
        a = accepted_length(draft, out, pos)
        if len(draft):
            drafts += 1
            draft_tokens += len(draft)
        n = min(a + 1, len(out) - pos)
        rows = _topk_rows(topk, out, prompt_last, pos, pos + n) if feed else None
        proposer.observe(req_id, out[pos:pos + n], rows)
        accepted += n - 1
        pos += n
        steps += 1
    proposer.complete(req_id)
    proposer.finish(req_id)
    return {"generated": len(out), "steps": steps, "accepted": accepted,
            "draft_tokens": draft_tokens, "drafts": drafts}


def replay_many(proposer: Proposer, requests: Sequence[tuple], budget: int,
                per_request: list | None = None) -> dict:
    """``replay`` of (prompt ids, output ids[, topk]) requests one after
    another with one proposer (batch size 1: each request finishes before the
    next starts, so what a proposer keeps across requests is used); totals
    and tau. ``per_request``: a list that receives each request's counters."""
    total = {key: 0 for key in COUNTERS}
    for i, request in enumerate(requests):
        prompt, output = request[0], request[1]
        topk = request[2] if len(request) > 2 else None
        res = replay(proposer, prompt, output, budget, req_id=f"r{i}", topk=topk)
        if per_request is not None:
            per_request.append(res)
        for key in total:
            total[key] += res[key]
    total["tau"] = total["generated"] / total["steps"] if total["steps"] else 1.0
    return total
