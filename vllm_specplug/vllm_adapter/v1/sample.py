"""Worker: our wrapper of ``GPUModelRunner._sample`` (applied for every method).

Three jobs, in this order:

1. Target top-k hook: for proposers that want it (Token Recycling; later
   EAGLE-2 reranking and typical acceptance), the target's top-k next tokens
   at every position scored this step (each request's last committed token
   and every draft node, rejected ones included) are handed to the drafter,
   which passes them to ``Proposer.observe`` before the next proposal. Taken
   from the raw logits before vLLM's sampler may change them in place.
2. Steps in which no request of the batch has a draft: vLLM 0.32 still runs
   its rejection sampler, whose top-k path (``apply_top_k_only``) raises on
   the empty draft-logits tensor whenever a request uses ``top_k`` and kills
   the engine (it happens with vLLM's own ``ngram`` too). Such steps are
   sampled with vLLM's plain sampler, which is what the rejection sampler
   would have computed for the bonus tokens.
3. Tree requests: vLLM's rejection sampler runs, then each tree request's row
   is replaced by tree acceptance and its KV compacted (``tree_runtime``).
4. Seeded sampled requests (``seeded``): their generators' states are saved
   before vLLM's rejection sampler draws from them and restored after it;
   then each such row (tree or chain) is replaced by the replay of plain
   decoding's draws, so its text is plain decoding's with that seed.

Faults in 3 and 4 are contained (docs/architecture.md, "Faults"): a tree
request whose scoring raises (its scorer, a NaN distribution, seeded replay)
accepts no draft and gets plain decoding's next token from its root row
(``tree_runtime.accept_trees``), a failed tree attention does that for the
step's trees, a seeded chain row whose replay raises keeps vLLM's own
verification; the engine and the other requests go on.
"""
from __future__ import annotations

import numpy as np
import torch

from ...proposers.base import TargetTopK


def _target_topk(runner, logits: torch.Tensor, spec_meta, k: int) -> dict[str, TargetTopK]:
    """Per request: input token and top-k of every scored position."""
    n_rows = logits.shape[0]
    x = logits.detach().float()
    vals, ids = torch.topk(x, k, dim=-1)
    logprobs = (vals - torch.logsumexp(x, dim=-1, keepdim=True)).cpu().numpy()
    ids = ids.cpu().numpy().astype(np.int32)
    inputs = runner.input_ids.gpu[spec_meta.logits_indices[:n_rows]].cpu().numpy()
    cu = spec_meta.cu_num_sampled_tokens.cpu().numpy()
    out: dict[str, TargetTopK] = {}
    start = 0
    for row, req_id in enumerate(runner.input_batch.req_ids[: cu.size]):
        end = int(cu[row])
        out[req_id] = TargetTopK(inputs[start:end].astype(np.int32), ids[start:end],
                                 logprobs[start:end])
        start = end
    return out


def make_sample(original):
    def _sample(self, logits, spec_decode_metadata):
        from . import seeded, tree_runtime
        from .runner import our_drafter

        drafter = our_drafter(self)
        if drafter is None:
            return original(self, logits, spec_decode_metadata)
        step = drafter.step
        step.accepted_paths = {}
        if spec_decode_metadata is None:
            step.clear()
            return original(self, logits, spec_decode_metadata)
        topk_k = drafter.target_topk_k
        if topk_k:
            drafter.pending_topk = _target_topk(self, logits, spec_decode_metadata, topk_k)
        if spec_decode_metadata.max_spec_len == 0:
            step.clear()
            self.input_batch.update_async_output_token_ids()
            return self.sampler(logits=logits[spec_decode_metadata.bonus_logits_indices],
                                sampling_metadata=self.input_batch.sampling_metadata,
                                predict_bonus_token=True)
        rows = None
        if step.requests:
            rows = tree_runtime.tree_logits(logits, spec_decode_metadata, step)
        # seeded rows: their generators' states before vLLM's sampler draws
        try:
            seeded_rows = seeded.seeded_rows(self, spec_decode_metadata)
        except Exception as e:  # noqa: BLE001 - a shared step: vLLM's own verification
            drafter.containment.shared_fault("seeded_replay", e)
            seeded_rows = []
        gens = self.input_batch.sampling_metadata.generators
        saved = {row: gens[row].get_state() for row in seeded_rows}
        sampler_output = original(self, logits, spec_decode_metadata)
        # (and after them: where vLLM's own verification of a row leaves it)
        drawn = {row: gens[row].get_state() for row in saved}
        for row, state in saved.items():
            gens[row].set_state(state)
        tree_rows = set()
        if rows is not None:
            tree_runtime.accept_trees(self, rows, sampler_output, seeded=saved)
            tree_rows = {tr.row for tr in step.requests}
        chains = [row for row in seeded_rows if row not in tree_rows]
        if chains:
            _replay_chains(self, drafter, logits, spec_decode_metadata, chains, sampler_output,
                           drawn)
        step.clear()
        return sampler_output

    return _sample


def _replay_chains(runner, drafter, logits, spec_meta, chains: list[int], sampler_output,
                   drawn: dict) -> None:
    """Seeded chain rows replaced by the replay of plain decoding's draws
    (``seeded.replay_chains``), faults contained: a row whose replay raises
    keeps vLLM's own verification (lossless; its generator where vLLM's draws
    left it) and its request decodes without drafts from then on; if the
    logprobs cannot be recomputed for the replaced rows, every chain row goes
    back to vLLM's verification for the step."""
    from . import seeded

    out = sampler_output.sampled_token_ids
    gens = runner.input_batch.sampling_metadata.generators
    vllms = {row: out[row].clone() for row in chains}

    def fault(row: int, error: BaseException) -> None:
        gens[row].set_state(drawn[row])
        drafter.verify_fault(runner.input_batch.req_ids[row], "seeded_replay", error)

    done = seeded.replay_chains(runner, logits, spec_meta, chains, out, on_fault=fault)
    try:
        if done:
            seeded.recompute_logprobs(runner, logits, spec_meta, sampler_output)
    except Exception as e:  # noqa: BLE001 - a shared step: vLLM's verification stands
        drafter.containment.shared_fault("seeded_replay", e)
        for row in done:
            out[row] = vllms[row]
            gens[row].set_state(drawn[row])
        done = {}
    step = drafter.step
    step.stats["seeded_chain_steps"] = step.stats.get("seeded_chain_steps", 0) + len(done)


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                           replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """``x[b]`` repeated for each of request b's tokens (``cu_num_tokens`` is
    cumulative), values equal to ``replace_from`` replaced by ``replace_to``:
    the semantics of vLLM's ``expand_batch_to_tokens``, in plain torch."""
    counts = torch.diff(cu_num_tokens.long(),
                        prepend=torch.zeros(1, dtype=torch.long, device=cu_num_tokens.device))
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    if replace_from != replace_to:
        out = torch.where(out == replace_from, torch.as_tensor(replace_to, dtype=out.dtype),
                          out)
    return out


def make_expand_batch_to_tokens(original):
    return expand_batch_to_tokens
