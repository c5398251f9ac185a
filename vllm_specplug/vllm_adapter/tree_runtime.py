"""Tree verification inside vLLM's V1 runner (CPU attention path).

A tree proposer's draft reaches vLLM's scheduler flattened in topological
order (a prefix of it is still a valid subtree, so the scheduler's budget
truncation is safe); its parent array waits in the drafter's side table.
In the worker, for every request whose scheduled draft is a real tree:

1. ``GPUModelRunner._prepare_inputs`` (patch): after vLLM computed positions
   and the slot mapping (slots stay base + 1 + node index), the model's
   position ids of the draft rows become base + depth, as on their path.
2. Attention (``TreeCPUAttentionImpl``, installed over CPU_ATTN): vLLM's
   kernel runs as usual, then the draft rows of tree requests are recomputed
   with torch SDPA over the request's cached keys/values (prefix + this
   step's nodes) under the ancestor mask.
3. ``GPUModelRunner._sample`` (patch, in ``sample.py``): vLLM's rejection sampler runs, then
   each tree request's output row is replaced by our scorer's accepted path +
   bonus token (greedy or lossless multi-branch rejection sampling), and the
   accepted nodes' KV is moved to the contiguous slots plain decoding would
   have used, in every layer. The scheduler's chain accounting (rollback of
   num_draft - num_accepted) is then right.

Requests a tree cannot serve exactly (penalties, logprobs, bad words, other
attention features) fall back to vLLM's chain verification of the flattened
draft, which is lossless too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from ..proposers.base import Draft
from ..scorers import GreedyScorer, RejectionScorer
from ..tree import ancestor_mask, compaction_moves, depths
from . import cpu_kv

logger = logging.getLogger("vllm_specplug")


@dataclass
class TreeRequest:
    req_id: str
    row: int              # batch row
    root_row: int         # index of the root (last committed) token among this step's tokens
    base: int             # position of the root
    parents: np.ndarray   # [n] scheduled nodes
    tokens: np.ndarray    # [n]
    slots: torch.Tensor   # [base + 1 + n] KV slots of positions 0 .. base + n
    mask: torch.Tensor    # [n, base + 1 + n] which keys each node attends to


@dataclass
class AttentionGroup:
    """Tree requests of similar length, attended in one batched SDPA call."""
    slots: torch.Tensor     # [R * L] KV slots (padded per request to L)
    mask: torch.Tensor      # [R, 1, N, L] which keys each node row attends to
    rows: torch.Tensor      # [R * N] query rows (padding repeats a real row)
    valid: torch.Tensor     # [R * N] which of them are real nodes
    out_rows: torch.Tensor  # rows[valid]
    shape: tuple[int, int, int]  # (R, N, L)


@dataclass
class StepTrees:
    """Tree requests of the step being executed in this worker."""
    requests: list[TreeRequest] = field(default_factory=list)
    groups: list[AttentionGroup] = field(default_factory=list)
    stats: dict = field(default_factory=lambda: {"tree_steps": 0, "tree_nodes": 0,
                                                 "tree_accepted": 0, "compacted": 0,
                                                 "fallbacks": 0})


STEP = StepTrees()
_GREEDY = GreedyScorer()
_REJECTION = RejectionScorer()
_RNG = np.random.default_rng(0)


def _falls_back(runner, row: int) -> str | None:
    """Why a request must be verified as a chain instead (None: it can be a tree)."""
    sm = runner.input_batch.sampling_metadata
    if not sm.no_penalties:
        return "penalties"
    if sm.max_num_logprobs is not None:
        return "logprobs"
    if sm.bad_words_token_ids:
        return "bad words"
    if sm.allowed_token_ids_mask is not None:
        return "allowed token ids"
    if getattr(runner, "uses_mrope", False):
        return "M-RoPE"
    return None


def prepare_tree_requests(runner, scheduler_output) -> None:
    """Fill STEP for this step and rewrite tree rows' position ids."""
    from .drafter import SpecPlugDrafter

    STEP.requests = []
    STEP.groups = []
    drafter = getattr(runner, "drafter", None)
    if not isinstance(drafter, SpecPlugDrafter) or not drafter.trees:
        return
    spec = scheduler_output.scheduled_spec_decode_tokens
    if not spec:
        return
    qsl = runner.query_start_loc.np
    table = runner.input_batch.block_table[0]
    bs = table.block_size
    block_table = table.block_table.np
    structured = set(getattr(scheduler_output, "structured_output_request_ids", None) or ())
    for req_id, toks in spec.items():
        parents = drafter.trees.get(req_id)
        n = len(toks)
        if parents is None or n == 0:
            continue
        parents = parents[:n]
        if Draft(np.asarray(toks), parents).is_chain:
            continue
        row = runner.input_batch.req_id_to_index[req_id]
        why = "structured output" if req_id in structured else _falls_back(runner, row)
        if why:
            STEP.stats["fallbacks"] += 1
            continue
        root_row = int(qsl[row + 1]) - n - 1
        base = int(runner.positions[root_row])
        d = depths(parents)
        runner.positions[root_row + 1: root_row + 1 + n] = torch.from_numpy(
            (base + d).astype(np.int64)).to(runner.positions.device)
        length = base + 1 + n
        pos = np.arange(length)
        slots = block_table[row, pos // bs].astype(np.int64) * bs + pos % bs
        mask = np.zeros((n, length), dtype=bool)
        mask[:, : base + 1] = True
        mask[:, base + 1:] = ancestor_mask(parents)
        STEP.requests.append(TreeRequest(req_id, row, root_row, base, parents,
                                         np.asarray(toks, dtype=np.int64),
                                         torch.from_numpy(slots), torch.from_numpy(mask)))
    STEP.groups = build_groups(STEP.requests)


# Requests per batched attention call; sorted by length so padding stays small.
GROUP_SIZE = 32


def build_groups(requests: list[TreeRequest]) -> list[AttentionGroup]:
    """Index tensors for batched tree attention, computed once per step."""
    groups = []
    order = sorted(requests, key=lambda tr: tr.slots.numel())
    for start in range(0, len(order), GROUP_SIZE):
        part = order[start: start + GROUP_SIZE]
        r = len(part)
        n_max = max(tr.parents.size for tr in part)
        l_max = max(tr.slots.numel() for tr in part)
        slots = torch.zeros(r, l_max, dtype=torch.long)
        mask = torch.zeros(r, 1, n_max, l_max, dtype=torch.bool)
        rows = torch.zeros(r, n_max, dtype=torch.long)
        valid = torch.zeros(r, n_max, dtype=torch.bool)
        for i, tr in enumerate(part):
            n, length = tr.parents.size, tr.slots.numel()
            slots[i, :length] = tr.slots
            slots[i, length:] = tr.slots[0]
            mask[i, 0, :n, :length] = tr.mask
            mask[i, 0, n:, 0] = True  # padding rows: any valid key (output unused)
            rows[i, :n] = torch.arange(tr.root_row + 1, tr.root_row + 1 + n)
            rows[i, n:] = tr.root_row + 1
            valid[i, :n] = True
        rows, valid = rows.view(-1), valid.view(-1)
        groups.append(AttentionGroup(slots.view(-1), mask, rows, valid, rows[valid],
                                     (r, n_max, l_max)))
    return groups


def tree_attention(impl, query: torch.Tensor, kv_cache: torch.Tensor,
                   output: torch.Tensor) -> None:
    """Recompute the draft rows of tree requests under their ancestor masks,
    one batched SDPA call per group of requests."""
    num_heads = impl.num_heads
    num_kv_heads = impl.num_kv_heads
    head_size = impl.head_size
    rep = num_heads // num_kv_heads
    for g in STEP.groups:
        r, n, length = g.shape
        k, v = cpu_kv.gather(kv_cache, g.slots)          # [R * L, Hkv, D]
        k = k.view(r, length, num_kv_heads, head_size).transpose(1, 2)
        v = v.view(r, length, num_kv_heads, head_size).transpose(1, 2)
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        q = query[g.rows].view(r, n, num_heads, head_size).transpose(1, 2)  # [R, H, N, D]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=g.mask, scale=impl.scale)
        out = out.transpose(1, 2).reshape(r * n, num_heads * head_size)[g.valid]
        output[g.out_rows] = out.view(output[g.out_rows].shape).to(output.dtype)


def _processed_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float
                     ) -> np.ndarray:
    """Target distributions as plain sampling would use them."""
    x = logits.float() / max(temperature, 1e-6)
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_x, dim=-1) > top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, idx, sorted_x)
    return torch.softmax(x, dim=-1).double().numpy()


def _rng_for(sm, row: int) -> np.random.Generator:
    gen = sm.generators.get(row) if sm.generators else None
    if gen is None:
        return _RNG
    seed = int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device))
    return np.random.default_rng(seed)


def tree_logits(logits: torch.Tensor, spec_meta) -> list[torch.Tensor]:
    """Each tree request's logits rows (root, then one per node), copied before
    vLLM's sampler may process ``logits`` in place."""
    cu = spec_meta.cu_num_sampled_tokens.cpu().numpy()
    out = []
    for tr in STEP.requests:
        first = int(cu[tr.row - 1]) if tr.row > 0 else 0
        out.append(logits[first: first + tr.parents.size + 1].detach().float().cpu().clone())
    return out


def accept_trees(runner, rows_per_request: list[torch.Tensor], sampler_output) -> None:
    """Replace tree requests' outputs with tree acceptance, then compact KV."""
    sm = runner.input_batch.sampling_metadata
    out = sampler_output.sampled_token_ids
    for tr, rows in zip(STEP.requests, rows_per_request):
        n = tr.parents.size
        draft = Draft(tr.tokens, tr.parents)
        temp = float(sm.temperature[tr.row]) if sm.temperature is not None else 0.0
        if sm.all_greedy or temp < 1e-5:
            acc = _GREEDY.accept(draft, rows.numpy())
        else:
            top_k = int(sm.top_k[tr.row]) if sm.top_k is not None else 0
            top_p = float(sm.top_p[tr.row]) if sm.top_p is not None else 1.0
            probs = _processed_probs(rows, temp, top_k, top_p)
            acc = _REJECTION.accept(draft, probs, None, _rng_for(sm, tr.row))
        toks = acc.tokens(draft)
        out[tr.row].fill_(-1)
        out[tr.row, : len(toks)] = torch.tensor(toks, dtype=out.dtype)
        moves = compaction_moves(acc.path)
        if moves:
            src = [int(tr.slots[tr.base + 1 + s]) for s, _ in moves]
            dst = [int(tr.slots[tr.base + 1 + t]) for _, t in moves]
            for kv in runner.kv_caches:
                cpu_kv.move(kv, src, dst)
            STEP.stats["compacted"] += 1
        STEP.stats["tree_steps"] += 1
        STEP.stats["tree_nodes"] += n
        STEP.stats["tree_accepted"] += len(acc.path)


# ---------------------------------------------------------------- patches

def make_prepare_inputs(original):
    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        result = original(self, scheduler_output, *args, **kwargs)
        prepare_tree_requests(self, scheduler_output)
        return result

    return _prepare_inputs
