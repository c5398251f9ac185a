"""Seeded sampled requests: plain decoding's text, whatever was drafted.

Plain vLLM 0.32 samples a request that has a seed with the request's own
``torch.Generator``: at each output position its sampler turns the
processed logits into one draw of that generator (on CPU,
``forward_cpu``: one ``randint`` seeding ``fused_gumbel_argmax``; on other
devices ``random_sample``: one vocab-sized exponential vector ``q`` and
``argmax(probs / q)``). The token is a deterministic function of the
position's processed logits and of the generator's state, and each position
consumes one draw.

Verification replays exactly that (Gumbel/exponential-race sampling, so
lossless by construction): starting from the generator's state before the
step, the root row is sampled as plain decoding would sample it; a drafted
child with that token is accepted and its own row sampled with the next draw,
and so on; the first token no child carries is emitted and ends the step.
So the emitted tokens are plain decoding's, and after the step the generator
has made exactly (accepted + 1) draws, as plain decoding would have. For a
tree the draw at depth d is the d-th draw, taken from the row of the node
accepted at depth d - 1.

The rows are processed as plain decoding's sampler processes its one row
(``plain_logits``): float32, allowed token ids, bad words, the min_tokens
stop mask, penalties (each row with the output tokens it follows), the
temperature and vLLM's own top-k/top-p filter; each draw is then made by the
sampler's own ``topk_topp_sampler`` module with the generator (the same
code plain decoding runs, one row at a time).

Numerics: the target's logits of a verified position come from a forward
over the step's k + 1 tokens (or a tree's rows) instead of over one token;
floating-point rounding can differ from plain decoding's one-token forward,
and a token whose Gumbel race is won by a margin below that rounding can then
differ. On the CPU (float32) the engine tests find the texts identical; no
bound is claimed.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ...proposers.base import Draft
from ...scorers.base import Acceptance
from ...tree import children_lists
from .request_options import stop_tokens_to_mask


def accept_sampled(draft: Draft, sample_row: Callable[[int], int]) -> Acceptance:
    """Acceptance by replay: ``sample_row(row)`` is the token plain decoding
    samples from logits row ``row`` (0: the root, i + 1: node i) with the
    generator's next draw; it is called once per accepted depth plus once,
    in order, so the generator advances exactly as plain decoding's."""
    children = children_lists(draft.parent_array())
    path: list[int] = []
    row = 0
    while True:
        want = int(sample_row(row))
        nxt = next((c for c in children[row] if int(draft.tokens[c]) == want), None)
        if nxt is None:
            return Acceptance(path, want)
        path.append(nxt)
        row = nxt + 1


def row_prefixes(draft: Draft) -> list[list[int]]:
    """Per logits row (root, then node i): the drafted tokens it follows."""
    parents = draft.parent_array()
    out: list[list[int]] = [[]]
    for i, p in enumerate(parents):
        out.append(out[int(p) + 1] + [int(draft.tokens[i])])
    return out


def plain_logits(sm, row: int, params, output_token_ids: list[int], raw: torch.Tensor,
                 prefixes: list[list[int]]) -> torch.Tensor:
    """``raw`` ([m, vocab], one row per logits row of batch row ``row``, row j
    following ``prefixes[j]`` after the committed ``output_token_ids``)
    processed as vLLM 0.32's ``Sampler`` processes a plain decoding step's
    row, in its order; returns float32 logits ready for ``topk_topp_sampler``
    with no top-k/top-p left to apply."""
    from vllm.v1.sample.ops.bad_words import _apply_bad_words_single_batch
    from vllm.v1.sample.ops.penalties import apply_all_penalties
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    x = raw.to(torch.float32).clone()
    m = x.shape[0]
    pasts = [list(output_token_ids) + p for p in prefixes]
    if sm.allowed_token_ids_mask is not None:
        x.masked_fill_(sm.allowed_token_ids_mask[row], float("-inf"))
    bad = sm.bad_words_token_ids.get(row)
    if bad:
        for j in range(m):
            _apply_bad_words_single_batch(x[j], bad, pasts[j])
    levels, stop_ids = stop_tokens_to_mask(params, len(output_token_ids))
    if levels:
        rows = [j for j in range(m) if len(prefixes[j]) < levels]
        if rows:
            x[torch.tensor(rows).unsqueeze(1), torch.tensor(stop_ids).unsqueeze(0)] = \
                float("-inf")
    if not sm.no_penalties:
        x = apply_all_penalties(x, sm.prompt_token_ids[row].expand(m, -1),
                                sm.presence_penalties[row].expand(m),
                                sm.frequency_penalties[row].expand(m),
                                sm.repetition_penalties[row].expand(m), pasts)
    x.div_(sm.temperature[row].expand(m).unsqueeze(1))
    k = sm.top_k[row].expand(m) if sm.top_k is not None else None
    p = sm.top_p[row].expand(m) if sm.top_p is not None else None
    return apply_top_k_top_p(x, k, p)


def row_sampler(topk_topp_sampler, logits: torch.Tensor, generator: torch.Generator
                ) -> Callable[[int], int]:
    """``sample_row`` for ``accept_sampled``: row ``j`` of the processed
    ``logits`` sampled by vLLM's own sampler module with ``generator``."""
    def sample(j: int) -> int:
        tok, _ = topk_topp_sampler(logits[j: j + 1].clone(), {0: generator}, None, None)
        return int(tok[0])

    return sample


def replay_reason(params, processed_logprobs: bool) -> str | None:
    """Why a seeded request's drafts cannot be replayed (None: they can):
    vLLM's thinking-budget state follows its own verification; token-id
    logprobs, and logprobs of processed logits (``--logprobs-mode
    processed_*``), would need the rejection sampler's processed rows of the
    whole batch (``recompute_logprobs`` rebuilds raw ones only)."""
    if params.thinking_token_budget is not None:
        return "thinking token budget"
    if params.logprob_token_ids:
        return "logprob token ids"
    if params.logprobs is not None and processed_logprobs:
        return "processed logprobs"
    return None


def replay_row(runner, row: int, draft: Draft, raw: torch.Tensor) -> Acceptance:
    """Seeded acceptance of batch row ``row``'s ``draft`` from its raw logits
    rows (root first); the row's generator must be at its state before the
    step."""
    sm = runner.input_batch.sampling_metadata
    req_id = runner.input_batch.req_ids[row]
    state = runner.requests[req_id]
    gen = sm.generators[row]
    # (the tree path hands host copies; the generator and the sampling
    # metadata live on the runner's device)
    # (the request's own output list: vLLM fills sm.output_token_ids only
    # when a request of the batch has penalties or bad words)
    logits = plain_logits(sm, row, state.sampling_params, state.output_token_ids,
                          raw.to(gen.device), row_prefixes(draft))
    return accept_sampled(draft, row_sampler(runner.sampler.topk_topp_sampler, logits, gen))


def seeded_rows(runner, spec_meta) -> list[int]:
    """Batch rows with a seed, drafts this step and replayable options."""
    sm = runner.input_batch.sampling_metadata
    if not sm.generators:
        return []
    processed = runner.rejection_sampler.is_processed_logprobs_mode
    out = []
    for row in sorted(sm.generators):
        if row >= len(spec_meta.num_draft_tokens) or not spec_meta.num_draft_tokens[row]:
            continue
        params = runner.requests[runner.input_batch.req_ids[row]].sampling_params
        if replay_reason(params, processed) is None:
            out.append(row)
    return out


def recompute_logprobs(runner, logits: torch.Tensor, spec_meta, sampler_output) -> None:
    """The step's logprobs again, for the replaced rows' tokens: vLLM's
    rejection sampler gathered them for its own tokens. Raw logprobs modes
    only (``replay_reason``): they read the unprocessed logits, which vLLM's
    sampler left untouched (it indexes copies)."""
    sm = runner.input_batch.sampling_metadata
    if sampler_output.logprobs_tensors is None or sm.max_num_logprobs is None:
        return
    target = logits[spec_meta.target_logits_indices].to(torch.float32)
    bonus = logits[spec_meta.bonus_logits_indices].to(torch.float32)
    sampler_output.logprobs_tensors = runner.rejection_sampler._get_logprobs_tensors(
        sm.max_num_logprobs, spec_meta, logits, target, bonus,
        sampler_output.sampled_token_ids)


def replay_chains(runner, logits: torch.Tensor, spec_meta, rows: list[int], out: torch.Tensor,
                  on_fault: Callable[[int, BaseException], None] | None = None
                  ) -> dict[int, Acceptance]:
    """Seeded chain rows (verified by vLLM's rejection sampler, whose tokens
    ``out`` holds): each row replaced by its replayed acceptance. With
    ``on_fault``, a row whose replay raises is left as vLLM verified it and
    ``on_fault(row, error)`` called (else the error propagates)."""
    cu_sampled = spec_meta.cu_num_sampled_tokens.cpu().numpy()
    cu_draft = spec_meta.cu_num_draft_tokens.cpu().numpy()
    done = {}
    for row in rows:
        try:
            n = spec_meta.num_draft_tokens[row]
            first = int(cu_sampled[row - 1]) if row > 0 else 0
            d0 = int(cu_draft[row - 1]) if row > 0 else 0
            toks = spec_meta.draft_token_ids[d0: d0 + n].cpu().numpy()
            draft = Draft(toks, np.arange(-1, n - 1))
            acc = replay_row(runner, row, draft, logits[first: first + n + 1])
        except Exception as e:  # noqa: BLE001 - the caller contains it (on_fault)
            if on_fault is None:
                raise
            on_fault(row, e)
            continue
        write_row(out, row, acc.tokens(draft))
        done[row] = acc
    return done


def write_row(out: torch.Tensor, row: int, tokens: list[int]) -> None:
    """Row ``row`` of the sampler's [num_reqs, max_spec_len + 1] output:
    ``tokens`` then placeholders (-1), as vLLM's rejection sampler writes it."""
    out[row].fill_(-1)
    out[row, : len(tokens)] = torch.tensor(tokens, dtype=out.dtype)
