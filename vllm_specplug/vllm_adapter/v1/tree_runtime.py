"""Tree verification inside vLLM's V1 runner (CPU attention path).

A tree proposer's draft reaches vLLM's scheduler flattened in topological
order (a prefix of it is still a valid subtree, so the scheduler's budget
truncation is safe); its parent array waits in the drafter's side table.
In the worker, for every request whose scheduled draft is a real tree:

1. ``GPUModelRunner._prepare_inputs`` (patch): after vLLM computed positions
   and the slot mapping (slots stay base + 1 + node index), the model's
   position ids of the draft rows become base + depth, as on their path.
2. Attention (``TreeCPUAttentionImpl`` over CPU_ATTN, or on CUDA
   ``TreeFlashAttentionImpl`` over FLASH_ATTN): vLLM's kernel runs as usual,
   then the draft rows of tree requests are recomputed under the ancestor
   mask over the request's cached keys/values (prefix + this step's nodes):
   torch SDPA on CPU (``tree_attention``), the Triton paged tree-attention
   kernel on CUDA (``flash_tree_attention``, not yet run on a GPU).
3. ``GPUModelRunner._sample`` (patch, in ``sample.py``): vLLM's rejection sampler runs, then
   each tree request's output row is replaced by our scorer's accepted path +
   bonus token (greedy or lossless multi-branch rejection sampling), and the
   accepted nodes' KV is moved to the contiguous slots plain decoding would
   have used, in every layer. The scheduler's chain accounting (rollback of
   num_draft - num_accepted) is then right.

Requests a tree cannot serve exactly (penalties, logprobs, bad words, other
attention features) fall back to vLLM's chain verification of the flattened
draft, which is lossless too.

Faults (docs/architecture.md, "Faults") cost drafts, never the engine: if 1
raises, vLLM's positions are put back and the step's drafts are verified as
chains by vLLM; if 2 raises (``StepTrees.fail_attention``), or acceptance
for one request in 3 (its scorer, a NaN distribution, its seeded replay), or
the KV compaction, the rows concerned accept no draft and emit plain
decoding's next token from the root's row, which none of these touch
(``accept_trees``). CPU tree attention's working memory is bounded whatever
the contexts (``BLOCK_BYTES``, ``tree_attention``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from ...proposers.base import Draft
from ...scorers import GreedyScorer, RejectionScorer
from ...scorers.base import Acceptance
from ...tree import ancestor_mask, compaction_moves, depths
from . import cpu_kv, cuda_kv
from .cuda_checks import request_fallback_reason
from .request_options import fallback_reason, stop_tokens_to_mask
from .runner import our_drafter
from .step_state import StepTrees

logger = logging.getLogger("vllm_specplug")


@dataclass
class TreeRequest:
    req_id: str
    row: int              # batch row
    root_row: int         # index of the root (last committed) token among this step's tokens
    base: int             # position of the root
    parents: np.ndarray   # [n] scheduled nodes
    tokens: np.ndarray    # [n]
    # CPU path only (None on CUDA, whose kernel reads the block table itself):
    slots: torch.Tensor | None   # [base + 1 + n] KV slots of positions 0 .. base + n
    mask: torch.Tensor | None    # [n, base + 1 + n] which keys each node attends to
    # A chain (routed here for a non-default acceptance rule): vLLM's causal
    # attention is already right for it, so its rows are not recomputed.
    chain: bool = False
    # min_tokens: the stop tokens are masked in the rows of depth < stop_levels
    # (root row: depth 0), as plain decoding masks them (request_options)
    stop_levels: int = 0
    stop_ids: list[int] = field(default_factory=list)
    block_row: np.ndarray | None = None   # the request's row of the block table
    block_size: int = 0
    greedy: bool = True   # accepted by argmax (only the argmax leaves the device)
    # sampling parameters, from the request's SamplingParams on the host
    temperature: float = 0.0
    top_k: int = 0        # 0: off
    top_p: float = 1.0

    def slots_of(self, positions: list[int]) -> list[int]:
        """KV slots of these positions of the request."""
        pos = np.asarray(positions, dtype=np.int64)
        return (self.block_row[pos // self.block_size].astype(np.int64) * self.block_size
                + pos % self.block_size).tolist()


@dataclass
class AttentionGroup:
    """Tree requests of similar length, attended together (``tree_attention``).

    Requests are in ascending order of their key count (``lengths``), so the
    requests that still have keys at or past any key index are a suffix of
    the group. Which keys a node row sees is kept compactly (the prefix
    length, the node count and the [N, N] ancestor mask of each request) and
    expanded only for the key block being attended (``block_mask``)."""
    slots: torch.Tensor     # [R * L] KV slots (padded per request to L with its slot 0)
    rows: torch.Tensor      # [R * N] query rows (padding repeats a real row)
    valid: torch.Tensor     # [R * N] which of them are real nodes
    out_rows: torch.Tensor  # rows[valid]
    shape: tuple[int, int, int]  # (R, N, L)
    # Rows as one slice when the group is a single request (no gathers).
    row_slice: slice | None = None
    lengths: list[int] = field(default_factory=list)  # [R] keys of each request, ascending
    prefix: torch.Tensor | None = None     # [R] base + 1: the committed keys (and the root)
    nodes: torch.Tensor | None = None      # [R] n
    ancestors: torch.Tensor | None = None  # [R, N, N] node i sees node j (padding rows: none)
    # The whole group's mask repeated for grouped-query heads, by repeat count
    # (only built for a group attended in one call).
    gqa_masks: dict = field(default_factory=dict)

    def block_mask(self, first: int, start: int, stop: int) -> torch.Tensor:
        """[R - first, N, stop - start]: which of keys ``start .. stop - 1``
        each node row of requests ``first ..`` attends to: every committed
        key (padding rows too, so no row is ever fully masked) and, among the
        draft nodes, the row's own ancestors; none past the request's keys."""
        _, n, _ = self.shape
        j = torch.arange(start, stop)
        prefix = self.prefix[first:, None]
        keep = (j < prefix).unsqueeze(1).expand(-1, n, -1)
        idx = j - prefix
        inside = (idx >= 0) & (idx < self.nodes[first:, None])
        if bool(inside.any()):
            tree = self.ancestors[first:].gather(
                2, idx.clamp(0, n - 1).unsqueeze(1).expand(-1, n, -1))
            keep = keep | (tree & inside.unsqueeze(1))
        return keep

    def mask_for(self, rep: int) -> torch.Tensor:
        """[R, 1, rep * N, L]: the whole group's mask, query heads sharing a
        KV head folded into rows, head-major (row j * N + i is node i under
        the j-th head)."""
        if rep not in self.gqa_masks:
            mask = self.block_mask(0, 0, self.shape[2]).unsqueeze(1)
            self.gqa_masks[rep] = mask.repeat(1, 1, rep, 1) if rep > 1 else mask
        return self.gqa_masks[rep]


@dataclass
class FlashTreeArgs:
    """Per-step arguments of the Triton tree kernel (CUDA path), on the device.

    One entry per tree request, in ``step.requests`` order; all int64 and
    contiguous (views of one buffer, copied to the device in one transfer)."""
    rows: torch.Tensor           # [R] batch rows: rows of the layer's block table
    prefix_lens: torch.Tensor    # [R] base + 1 (prefix and root)
    node_counts: torch.Tensor    # [R] n
    query_start: torch.Tensor    # [R] root_row + 1: first node row among the step's tokens
    ancestor_bits: torch.Tensor  # [R, max n] bit j of [r, i]: node j is node i or an ancestor
    # block tables already gathered this step, keyed by the source tensor
    tables: dict = field(default_factory=dict)

    def block_table(self, batch_block_table: torch.Tensor) -> torch.Tensor:
        """The tree requests' rows of a layer's (kernel-block) block table; layers
        of one KV cache group share the tensor, so it is gathered once a step."""
        key = (batch_block_table.data_ptr(), tuple(batch_block_table.shape))
        table = self.tables.get(key)
        if table is None:
            table = self.tables[key] = batch_block_table.index_select(0, self.rows)
        return table


_GREEDY = GreedyScorer()
_REJECTION = RejectionScorer()


def _falls_back(runner, req_id: str, row: int, num_nodes: int) -> str | None:
    """Why a request must be verified as a chain instead (None: it can be a
    tree); every request option is accounted for in ``request_options``, and
    what the device's kernel cannot take in ``cuda_checks``."""
    if runner.uses_mrope:
        return "M-RoPE"
    return (fallback_reason(runner.requests[req_id].sampling_params, row,
                            runner.input_batch.sampling_metadata)
            or request_fallback_reason(num_nodes, runner.positions.device.type))


def prepare_tree_requests(runner, scheduler_output) -> None:
    """Fill the drafter's step state for this step and rewrite tree rows'
    position ids."""
    drafter = our_drafter(runner)
    if drafter is None:
        return
    step = drafter.step
    step.clear()
    if not drafter.trees:
        return
    spec = scheduler_output.scheduled_spec_decode_tokens
    if not spec:
        return
    qsl = runner.query_start_loc.np
    table = runner.input_batch.block_table[0]
    bs = table.block_size
    block_table = table.block_table.np
    positions = None  # host copy (CPU: the tensor itself), read once
    for req_id, toks in spec.items():
        tree = drafter.trees.get(req_id)
        n = len(toks)
        if tree is None or n == 0:
            continue
        if n > len(tree) or not np.array_equal(np.asarray(toks), tree.tokens[:n]):
            # not the tree drafted last (e.g. vLLM skipped drafting near
            # max_model_len and scheduled older tokens): verify as a chain
            step.stats["fallbacks"] += 1
            continue
        parents = tree.parents[:n]
        row = runner.input_batch.req_id_to_index[req_id]
        # (counted for chains too: vLLM verifies the draft for this reason)
        why = _falls_back(runner, req_id, row, n)
        if why:
            step.stats["fallbacks"] += 1
            key = "fallback:" + why
            step.stats[key] = step.stats.get(key, 0) + 1
            continue
        chain = Draft(np.asarray(toks), parents).is_chain
        if chain and not drafter.route_chains:
            continue
        if positions is None:
            positions = runner.positions[: scheduler_output.total_num_scheduled_tokens].cpu()
        root_row = int(qsl[row + 1]) - n - 1
        base = int(positions[root_row])
        d = depths(parents)
        runner.positions[root_row + 1: root_row + 1 + n] = torch.from_numpy(
            (base + d).astype(np.int64)).to(runner.positions.device)
        tr = tree_request(req_id, row, root_row, base, parents, toks, block_table[row], bs,
                          dense=runner.positions.device.type != "cuda")
        tr.chain = chain
        state = runner.requests[req_id]
        tr.stop_levels, tr.stop_ids = stop_tokens_to_mask(state.sampling_params,
                                                          len(state.output_token_ids))
        params = state.sampling_params
        tr.greedy = params.temperature < 1e-5   # vLLM's greedy threshold (_SAMPLING_EPS)
        tr.temperature, tr.top_k, tr.top_p = params.temperature, max(params.top_k, 0), \
            params.top_p
        step.requests.append(tr)
    attended = [tr for tr in step.requests if not tr.chain]
    step.attended = bool(attended)
    # (every decoder layer is ours: checked when the model loaded, step_state)
    if runner.positions.device.type == "cuda":
        if attended:
            step.flash = build_flash_args(attended, runner.positions.device)
    else:
        step.groups = build_groups(attended)


def tree_request(req_id: str, row: int, root_row: int, base: int, parents: np.ndarray,
                 toks, block_row: np.ndarray, block_size: int,
                 dense: bool = True) -> TreeRequest:
    """A tree request whose root is at position ``base`` and whose node i's KV
    is at position base + 1 + i; ``block_row`` is its row of the block table.
    ``dense``: also build the slots of the whole context and the [n, context]
    mask the CPU path's SDPA needs (O(context) host work per step; the CUDA
    kernel reads the block table and an ancestor bitmask instead)."""
    n = len(parents)
    slots = mask = None
    if dense:
        length = base + 1 + n
        pos = np.arange(length)
        slots = torch.from_numpy(
            block_row[pos // block_size].astype(np.int64) * block_size + pos % block_size)
        m = np.zeros((n, length), dtype=bool)
        m[:, : base + 1] = True
        m[:, base + 1:] = ancestor_mask(parents)
        mask = torch.from_numpy(m)
    return TreeRequest(req_id, row, root_row, base, parents, np.asarray(toks, dtype=np.int64),
                       slots, mask, block_row=block_row, block_size=block_size)


def build_flash_args(requests: list[TreeRequest], device) -> FlashTreeArgs:
    """Kernel arguments for the CUDA path: built on the host once per step and
    copied to ``device`` in one transfer."""
    from ...kernels.tree_attention_triton import MAX_TREE_NODES, ancestor_bits_from_parents

    r = len(requests)
    n_max = max(tr.parents.size for tr in requests)
    if n_max > MAX_TREE_NODES:
        raise NotImplementedError(
            f"vllm_specplug tree verification on CUDA supports at most {MAX_TREE_NODES} "
            f"draft nodes per request (int64 ancestor bitmask), got {n_max}")
    host = torch.zeros(4 * r + r * n_max, dtype=torch.int64)
    cols = host[: 4 * r].view(4, r)
    bits = host[4 * r:].view(r, n_max)
    for i, tr in enumerate(requests):
        n = tr.parents.size
        cols[:, i] = torch.tensor([tr.row, tr.base + 1, n, tr.root_row + 1])
        bits[i, :n] = ancestor_bits_from_parents(tr.parents)
    dev = host.to(device)
    return FlashTreeArgs(rows=dev[:r], prefix_lens=dev[r: 2 * r], node_counts=dev[2 * r: 3 * r],
                         query_start=dev[3 * r: 4 * r], ancestor_bits=dev[4 * r:].view(r, n_max))


# Requests per batched attention call; sorted by length so padding stays small.
GROUP_SIZE = 32

#: Working memory of one CPU tree-attention call (one layer, one group of
#: requests), in bytes: the keys are attended in blocks small enough that the
#: block's tensors (``_pair_bytes`` per request and key) fit, whatever the
#: contexts' lengths (``tree_attention``).
BLOCK_BYTES = 64 << 20


def build_groups(requests: list[TreeRequest]) -> list[AttentionGroup]:
    """Index tensors for batched tree attention, computed once per step. Per
    group: the KV slots padded to its longest request (8 bytes per request
    and key), and the [N, N] ancestor masks; never an [N, context] mask."""
    groups = []
    order = sorted(requests, key=lambda tr: tr.slots.numel())
    for start in range(0, len(order), GROUP_SIZE):
        part = order[start: start + GROUP_SIZE]
        r = len(part)
        n_max = max(tr.parents.size for tr in part)
        lengths = [tr.slots.numel() for tr in part]
        l_max = lengths[-1]
        slots = torch.zeros(r, l_max, dtype=torch.long)
        ancestors = torch.zeros(r, n_max, n_max, dtype=torch.bool)
        rows = torch.zeros(r, n_max, dtype=torch.long)
        valid = torch.zeros(r, n_max, dtype=torch.bool)
        for i, tr in enumerate(part):
            n, length = tr.parents.size, lengths[i]
            slots[i, :length] = tr.slots
            slots[i, length:] = tr.slots[0]
            ancestors[i, :n, :n] = tr.mask[:, tr.base + 1:]
            rows[i, :n] = torch.arange(tr.root_row + 1, tr.root_row + 1 + n)
            rows[i, n:] = tr.root_row + 1
            valid[i, :n] = True
        rows, valid = rows.view(-1), valid.view(-1)
        row_slice = (slice(part[0].root_row + 1, part[0].root_row + 1 + n_max)
                     if r == 1 else None)
        groups.append(AttentionGroup(
            slots.view(-1), rows, valid, rows[valid], (r, n_max, l_max), row_slice,
            lengths=lengths, prefix=torch.tensor([tr.base + 1 for tr in part]),
            nodes=torch.tensor([tr.parents.size for tr in part]), ancestors=ancestors))
    return groups


def _pair_bytes(num_heads: int, num_kv_heads: int, head_size: int, n: int,
                blocks: bool) -> int:
    """Bytes one (request, key) pair may allocate in ``tree_attention``,
    counted high (4 bytes a cache value). One SDPA call (``blocks`` False):
    the key and value as gathered and in the query's dtype, the mask per
    query row (bools, and SDPA's additive float32 copy) and its making. Key
    blocks: the key and value as gathered, in float32 and as contiguous
    copies, the score and its exponential per query row (float32), the
    block's mask per node row and its making."""
    kv = 2 * num_kv_heads * head_size * 4
    rows = num_heads // num_kv_heads * n
    if not blocks:
        return 2 * kv + 5 * rows + 4 * n + 32
    return 3 * kv + 4 * num_heads * n + 8 * n + 32


def tree_attention(impl, query: torch.Tensor, kv_cache: torch.Tensor,
                   output: torch.Tensor, step: StepTrees, gather=cpu_kv.gather) -> None:
    """Recompute the draft rows of tree requests under their ancestor masks
    (CPU path; ``gather`` reads the cache, ``cpu_kv.gather`` for vLLM's CPU
    layout), group by group of ``step``.

    Memory: a group whose R requests times L keys fit ``BLOCK_BYTES``
    (``_pair_bytes`` per request and key) is attended in one SDPA call, as
    before; a longer one in blocks of keys with an online softmax (running
    maximum, denominator and weighted values per query row, in float32), a
    block holding at most ``BLOCK_BYTES // _pair_bytes`` (request, key)
    pairs and only the requests that still have keys there. So the keys and
    values gathered at once, the scores and the mask are O(``BLOCK_BYTES``)
    whatever the contexts; what grows with them is the group's slot index (8
    bytes per request and key, built once a step) and the per-row
    accumulators, O(R * heads * N * head_size), none with the context. One
    long request grouped with short ones costs its own keys only: a short
    request leaves the blocks after its last key."""
    num_heads, num_kv_heads, d = impl.num_heads, impl.num_kv_heads, impl.head_size
    rep = num_heads // num_kv_heads
    out2d = output.view(output.shape[0], -1)
    for g in step.groups:
        r, n, length = g.shape
        q = query[g.row_slice] if g.row_slice is not None else query[g.rows]
        # Query head h uses KV head h // rep: fold each KV head's rep query
        # heads into rows instead of repeating K and V.
        q = (q.reshape(r, n, num_kv_heads, rep, d).permute(0, 2, 3, 1, 4)
             .reshape(r, num_kv_heads, rep * n, d))
        if r * length * _pair_bytes(num_heads, num_kv_heads, d, n, False) <= BLOCK_BYTES:
            k, v = gather(kv_cache, g.slots)                 # [R * L, Hkv, D]
            k = k.view(r, length, num_kv_heads, d).transpose(1, 2)  # [R, Hkv, L, D]
            v = v.view(r, length, num_kv_heads, d).transpose(1, 2)
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k.to(q.dtype), v.to(q.dtype), attn_mask=g.mask_for(rep), scale=impl.scale)
        else:
            out = _attend_blocks(q, kv_cache, g, gather, impl.scale,
                                 _pair_bytes(num_heads, num_kv_heads, d, n, True))
        out = (out.view(r, num_kv_heads, rep, n, d).permute(0, 3, 1, 2, 4)
               .reshape(r * n, num_heads * d).to(output.dtype))
        if g.row_slice is not None:
            out2d[g.row_slice] = out
        else:
            out2d[g.out_rows] = out[g.valid]


def _attend_blocks(q: torch.Tensor, kv_cache: torch.Tensor, g: AttentionGroup, gather,
                   scale: float, pair: int) -> torch.Tensor:
    """Group ``g``'s attention (``q``: [R, Hkv, rep * N, D]) over its keys in
    blocks of at most ``BLOCK_BYTES // pair`` (request, key) pairs, with an
    online softmax; float32 [R, Hkv, rep * N, D]."""
    r, n, length = g.shape
    _, kv_heads, rows, d = q.shape
    rep = rows // n
    qf = q.float()
    neg = float("-inf")
    best = torch.full((r, kv_heads, rows, 1), neg)   # running maximum score
    total = torch.zeros(r, kv_heads, rows, 1)        # running sum of exp(score - best)
    acc = torch.zeros(r, kv_heads, rows, d)          # running sum of exp(...) * value
    slots = g.slots.view(r, length)
    budget = max(1, BLOCK_BYTES // pair)
    start = first = 0
    while start < length:
        while g.lengths[first] <= start:   # ascending: these requests have no key left
            first += 1
        live = r - first
        stop = min(length, start + max(1, budget // live))
        width = stop - start
        k, v = gather(kv_cache, slots[first:, start:stop].reshape(-1))  # [live * width, Hkv, D]
        k = k.view(live, width, kv_heads, d).transpose(1, 2).float()
        v = v.view(live, width, kv_heads, d).transpose(1, 2).float()
        s = torch.matmul(qf[first:], k.transpose(-1, -2)).mul_(scale)  # [live, Hkv, rows, width]
        drop = ~g.block_mask(first, start, stop)                        # [live, N, width]
        s.view(live, kv_heads, rep, n, width).masked_fill_(drop[:, None, None], neg)
        was = best[first:]
        now = torch.maximum(was, s.amax(dim=-1, keepdim=True))
        shift = now.masked_fill(now == neg, 0.0)   # a row with no key yet: nothing to scale
        s.sub_(shift).exp_()
        fade = (was - shift).exp_()
        total[first:].mul_(fade).add_(s.sum(dim=-1, keepdim=True))
        acc[first:].mul_(fade).add_(torch.matmul(s, v))
        best[first:] = now
        start = stop
    return acc / total.clamp_min(torch.finfo(torch.float32).tiny)


def flash_tree_attention(impl, query: torch.Tensor, kv_cache: torch.Tensor,
                         batch_block_table: torch.Tensor, output: torch.Tensor,
                         args: FlashTreeArgs) -> None:
    """CUDA path: recompute the draft rows of tree requests with the Triton
    paged tree-attention kernel, in place in ``output``. ``kv_cache`` is the
    layer's FlashAttention cache and ``batch_block_table`` the block table of
    its attention metadata (one row per batch row, in the cache's blocks);
    ``args`` the step's kernel arguments (``StepTrees.flash``)."""
    from ...kernels.tree_attention_triton import paged_tree_attention

    q = query.view(-1, impl.num_heads, impl.head_size)
    out = output.view(-1, impl.num_heads, impl.head_size)
    k_cache, v_cache = cuda_kv.split_kv(kv_cache)
    paged_tree_attention(q, k_cache, v_cache, args.block_table(batch_block_table),
                         args.prefix_lens, args.node_counts, args.query_start,
                         args.ancestor_bits, impl.scale, out=out, check_inputs=False)


def _processed_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float
                     ) -> np.ndarray:
    """Target distributions as plain sampling would use them: temperature,
    then vLLM's own top-k/top-p filter (``apply_top_k_top_p_pytorch``, the
    same call its sampler makes, so ties at the cut fall alike)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    x = logits.float() / max(temperature, 1e-6)
    rows, vocab = x.shape
    k = torch.full((rows,), top_k, dtype=torch.long) if 0 < top_k < vocab else None
    p = torch.full((rows,), top_p, dtype=torch.float32) if top_p < 1.0 else None
    x = apply_top_k_top_p_pytorch(x, k, p)   # in place on our own copy
    return torch.softmax(x, dim=-1).double().numpy()


def _rng_for(sm, row: int, default: np.random.Generator) -> np.random.Generator:
    gen = sm.generators.get(row) if sm.generators else None
    if gen is None:
        return default
    seed = int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device))
    return np.random.default_rng(seed)


def tree_logits(logits: torch.Tensor, spec_meta, step: StepTrees) -> list[torch.Tensor | None]:
    """What acceptance needs of each tree request's logits rows (root, then one
    per node), taken before vLLM's sampler may process ``logits`` in place:
    greedy requests only the argmax of each row (int64 [n + 1], computed where
    the logits are, after the min_tokens mask), sampled ones the rows (float32
    [n + 1, vocab] on the host). ``step.stats['host_bytes']`` counts what is
    copied. A request whose copy raises gets None and its fault is kept in
    ``step.row_faults`` for ``accept_trees``."""
    cu = spec_meta.cu_num_sampled_tokens.cpu().numpy()
    out: list[torch.Tensor | None] = []
    for tr in step.requests:
        try:
            first = int(cu[tr.row - 1]) if tr.row > 0 else 0
            rows = logits[first: first + tr.parents.size + 1].detach()
            if tr.greedy:
                if tr.stop_levels:
                    rows = rows.clone()
                    mask_stop_tokens(rows, tr)
                got = rows.argmax(dim=-1).cpu()
            else:
                got = rows.float().cpu().clone()
                if tr.stop_levels:
                    mask_stop_tokens(got, tr)
        except Exception as e:  # noqa: BLE001 - one request's fault stays its own
            step.row_faults[tr.req_id] = ("tree_logits", e)
            out.append(None)
            continue
        step.stats["host_bytes"] = (step.stats.get("host_bytes", 0)
                                    + got.numel() * got.element_size())
        out.append(got)
    return out


def accept_trees(runner, rows_per_request: list[torch.Tensor | None], sampler_output,
                 seeded: Mapping[int, Any] | None = None) -> None:
    """Replace tree requests' outputs with tree acceptance, then compact KV.
    ``seeded``: batch row -> its generator's state before the step (the
    generators are at that state); those requests replay plain decoding's
    draws (``seeded.replay_row``).

    Faults are contained (docs/architecture.md, "Faults"): a request whose
    logits copy, scorer (a third-party one included: its result must be a
    path of the draft and a token of the vocabulary) or seeded replay raises
    loses its drafts, this step and after (``verify_fault``); a failure of
    tree attention (``StepTrees.fail_attention``) or of the KV compaction
    costs the step's drafts of the requests it touched. Either way the row
    gets plain decoding's next token (``_plain_token``) with no draft
    accepted: the root's logits row never depends on what failed, and the
    draft slots a partial compaction wrote are free again once no draft is
    accepted. Anything else that raises here costs every tree request its
    drafts for the step (``tree_acceptance``), never the engine."""
    from .seeded import write_row

    seeded = seeded or {}
    out = sampler_output.sampled_token_ids
    drafter = runner.drafter
    step = drafter.step
    # vLLM's own token at each row's first position: its verification of the
    # root's row, distributed as plain decoding's next token whatever the
    # draft (the last fallback; a copy on the device, read only after a fault)
    firsts = out[:, 0].clone()
    try:
        _accept_trees(runner, drafter, step, rows_per_request, out, firsts, seeded)
    except Exception as e:  # noqa: BLE001 - the last guard: no tree draft accepted this step
        drafter.containment.shared_fault("tree_acceptance", e)
        gens = runner.input_batch.sampling_metadata.generators
        for tr in step.requests:
            if tr.row in seeded:
                gens[tr.row].set_state(seeded[tr.row])
            write_row(out, tr.row, [int(firsts[tr.row])])
            step.accepted_paths[tr.req_id] = []


def _accept_trees(runner, drafter, step: StepTrees, rows_per_request, out: torch.Tensor,
                  firsts: torch.Tensor, seeded: Mapping[int, Any]) -> None:
    from .seeded import write_row

    broken = step.attention_error
    if broken is not None:
        drafter.containment.shared_fault("tree_attention", broken)
    src: list[int] = []
    dst: list[int] = []
    compacted: list[tuple[TreeRequest, torch.Tensor | None]] = []
    for tr, rows in zip(step.requests, rows_per_request):
        n = tr.parents.size
        draft = Draft(tr.tokens, tr.parents)
        fault = step.row_faults.get(tr.req_id)
        acc = None
        # (a chain's rows are vLLM's causal attention's: tree attention's
        # failure leaves them right)
        if fault is None and (broken is None or tr.chain):
            replay = not tr.greedy and tr.row in seeded
            try:
                acc = _acceptance(runner, tr, draft, rows, replay)
                check_acceptance(acc, draft, None if tr.greedy else rows.shape[-1])
            except Exception as e:  # noqa: BLE001 - one request's fault stays its own
                fault, acc = ("seeded_replay" if replay else "tree_scorer", e), None
        if fault is not None:
            drafter.verify_fault(tr.req_id, *fault)
        if acc is None:
            acc = Acceptance([], _plain_token(runner, tr, rows, firsts, seeded))
            step.stats["fault_rows"] = step.stats.get("fault_rows", 0) + 1
        step.accepted_paths[tr.req_id] = [int(j) for j in acc.path]
        write_row(out, tr.row, acc.tokens(draft))
        moves = compaction_moves(acc.path)
        if moves:
            src += tr.slots_of([tr.base + 1 + s for s, _ in moves])
            dst += tr.slots_of([tr.base + 1 + t for _, t in moves])
            compacted.append((tr, rows))
            step.stats["compacted"] += 1
        step.stats["tree_steps"] += 1
        step.stats["tree_nodes"] += n
        step.stats["tree_accepted"] += len(acc.path)
    if not src:
        return
    try:  # requests own disjoint slots: one move per layer for the whole batch
        for kv in _distinct(runner.kv_caches):
            kv_module(kv).move(kv, src, dst)
    except Exception as e:  # noqa: BLE001 - a shared step: these rows accept no draft
        # the moves read and write draft slots only, free again with no draft accepted
        drafter.containment.shared_fault("tree_compaction", e)
        for tr, rows in compacted:
            step.stats["tree_accepted"] -= len(step.accepted_paths[tr.req_id])
            step.accepted_paths[tr.req_id] = []
            write_row(out, tr.row, [_plain_token(runner, tr, rows, firsts, seeded)])
            step.stats["fault_rows"] = step.stats.get("fault_rows", 0) + 1


def _acceptance(runner, tr: TreeRequest, draft: Draft, rows: torch.Tensor,
                replay: bool) -> Acceptance:
    """The request's accepted path and bonus token: greedy from the rows'
    argmaxes, seeded (``replay``) by replaying its generator's draws, else by
    the configured scorer (lossless rejection sampling by default)."""
    from .seeded import replay_row

    step = runner.drafter.step
    if tr.greedy:
        return _GREEDY.accept_argmax(draft, rows.numpy())
    if replay:
        acc = replay_row(runner, tr.row, draft, rows)
        step.stats["seeded_tree_steps"] = step.stats.get("seeded_tree_steps", 0) + 1
        return acc
    sm = runner.input_batch.sampling_metadata
    probs = _processed_probs(rows, tr.temperature, tr.top_k, tr.top_p)
    if not np.isfinite(probs.sum(axis=-1)).all():
        # (NaN or inf logits: no acceptance rule means anything on them)
        raise FloatingPointError("the target's distribution has NaN or inf in rows "
                                 f"{np.flatnonzero(~np.isfinite(probs.sum(axis=-1))).tolist()}")
    return (runner.drafter.scorer or _REJECTION).accept(draft, probs, None,
                                                        _rng_for(sm, tr.row, step.rng))


def check_acceptance(acc: Acceptance, draft: Draft, vocab: int | None) -> None:
    """Raise ``ValueError`` unless ``acc`` is a path of ``draft`` down from
    its root and its bonus a token below ``vocab`` (None: unchecked): what a
    scorer returns reaches vLLM's output and the KV compaction only then."""
    parents = draft.parent_array()
    above = -1
    for j in acc.path:
        j = int(j)
        if not (0 <= j < parents.size and int(parents[j]) == above):
            raise ValueError(f"the scorer's accepted path {list(acc.path)} is not a path "
                             f"of the draft from its root (parents {parents.tolist()})")
        above = j
    bonus = int(acc.bonus)
    if bonus < 0 or (vocab is not None and bonus >= vocab):
        raise ValueError(f"the scorer's bonus token {bonus} is not in the vocabulary "
                         f"(0 .. {vocab})")


def _plain_token(runner, tr: TreeRequest, rows: torch.Tensor | None, firsts: torch.Tensor,
                 seeded: Mapping[int, Any]) -> int:
    """Plain decoding's next token for a tree request that accepts no draft:
    greedy, the argmax of the root's row (min_tokens applied); seeded, its
    generator's next draw from the root's row, replayed from the step's
    start; otherwise, or when that raises too (or the rows are missing),
    vLLM's own token at the row's first position (``firsts``: its rejection
    sampler's verification of the root's row, distributed as plain
    decoding's token; a seeded request's generator is then left at the
    step's start, so its seed no longer gives plain decoding's text)."""
    from .seeded import replay_row

    try:
        if rows is not None and tr.greedy:
            return int(rows[0])
        if rows is not None and tr.row in seeded:
            runner.input_batch.sampling_metadata.generators[tr.row].set_state(seeded[tr.row])
            return int(replay_row(runner, tr.row, Draft.empty(), rows[:1]).bonus)
    except Exception:  # noqa: BLE001 - the fault was counted; vLLM's own token below
        logger.debug("vllm_specplug: plain decoding's token for request %s from its root row "
                     "failed too; vLLM's own token is kept", tr.req_id, exc_info=True)
        if tr.row in seeded:
            runner.input_batch.sampling_metadata.generators[tr.row].set_state(seeded[tr.row])
    return int(firsts[tr.row])


def mask_stop_tokens(rows: torch.Tensor, tr: TreeRequest) -> None:
    """min_tokens: -inf for the stop tokens in the rows (root, then one per
    node) whose depth is below ``tr.stop_levels``, in place."""
    level = np.concatenate([[0], depths(tr.parents)])
    masked = torch.from_numpy(np.flatnonzero(level < tr.stop_levels))
    ids = torch.tensor(tr.stop_ids, dtype=torch.long)
    rows[masked.unsqueeze(1), ids.unsqueeze(0)] = float("-inf")


def kv_module(kv_cache: torch.Tensor):
    """The reader/mover of a layer's KV cache: ``cpu_kv`` or ``cuda_kv``."""
    return cuda_kv if cuda_kv.layout_of(kv_cache) == cuda_kv.FLASH else cpu_kv


def _distinct(caches):
    """Each cache once (layers that share a KV cache must be moved only once)."""
    seen = set()
    for kv in caches:
        key = (kv.data_ptr(), tuple(kv.shape), kv.stride())
        if key not in seen:
            seen.add(key)
            yield kv


# ---------------------------------------------------------------- patches

def make_prepare_inputs(original):
    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        result = original(self, scheduler_output, *args, **kwargs)
        drafter = our_drafter(self)
        if drafter is None or not drafter.trees:
            prepare_tree_requests(self, scheduler_output)   # (clears the step, no tree)
            return result
        total = scheduler_output.total_num_scheduled_tokens
        positions = self.positions[:total].clone()   # vLLM's, before tree rows are rewritten
        try:
            prepare_tree_requests(self, scheduler_output)
        except Exception as e:  # noqa: BLE001 - a shared step: vLLM verifies the drafts as chains
            # vLLM's positions back and no tree request: every draft is verified
            # by vLLM's chain path with causal attention, lossless as for a
            # request that falls back
            self.positions[:total] = positions
            drafter.step.clear()
            drafter.containment.shared_fault("tree_prepare", e)
        return result

    return _prepare_inputs
