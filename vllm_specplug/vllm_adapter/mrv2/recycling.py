"""Token Recycling on vLLM 0.34's Model Runner V2, as chains, on the device.

Token Recycling (Luo et al., 2024) keeps, for each token t, the target's best
next tokens after t the last time the target scored a position whose input
was t, and drafts by walking that table from the request's newest token. On
MRV2 a step verifies one chain per request, so only each row's best
candidate matters: the table holds the target's top-1 (its argmax) per token,
and the draft is the best path ``t -> M[t] -> M[M[t]] ...``, K deep.

Everything runs on the device, with no host round trip:

* ``learn``: the target's logits at the positions the step scored (vLLM's
  ``logits_indices``: each row's verified positions), through the target's
  own ``compute_logits`` (one extra lm_head pass over those rows; the runner's
  own logits are not handed to speculators), then ``M[input] = argmax``.
  Prefilling rows also write their prompt's bigrams where the table knows
  nothing yet (``tr_prompt_bigrams``), into the request's own entries only
  (as the V1 proposer keeps them with the request): a prompt never reaches
  the shared table.
* ``chain``: K gathers from each row's newest committed token.

Memory across requests (docs/security.md): with isolation "none" every
request shares one table ``[vocab]``; otherwise (the default on 0.34, which
cannot tell tenants apart) each request-state slot has its own hashed table
of ``BUCKETS`` entries (token -> next), cleared when the slot is reassigned,
over the read-only warm-start matrix (``tr_matrix``) if one is given. A hash
collision overwrites an entry: it costs drafts, never correctness (vLLM
verifies every draft). With the shared table and ``tr_prompt_bigrams``, each
slot also has such a hashed table for its prompt's bigrams alone, read where
the shared table knows nothing (issue 45: prompts stay out of shared memory).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

#: Entries of a request's private table (token -> its best next token).
BUCKETS = 8192


class DeviceRecycling:
    """The Token Recycling table and its two device ops (see module doc)."""

    def __init__(self, *, vocab_size: int, max_num_reqs: int, device: torch.device,
                 shared: bool, warm: np.ndarray | None, prompt_bigrams: bool,
                 buckets: int = BUCKETS) -> None:
        self.vocab_size = int(vocab_size)
        self.shared = bool(shared)
        self.prompt_bigrams = bool(prompt_bigrams)
        self.buckets = int(buckets)
        self.compute_logits = None
        warm_col = None
        if warm is not None and warm.size:
            col = np.asarray(warm[:, 0], dtype=np.int64)[: self.vocab_size]
            col = np.where((col >= 0) & (col < self.vocab_size), col, -1)
            warm_col = torch.full((self.vocab_size,), -1, dtype=torch.int64, device=device)
            warm_col[: col.size] = torch.from_numpy(col).to(device)
        self.warm = warm_col
        self.table = self.keys = self.vals = None
        if self.shared:
            # one spare entry last: where masked-out writes go
            self.table = torch.full((self.vocab_size + 1,), -1, dtype=torch.int64,
                                    device=device)
            if warm_col is not None:
                self.table[: self.vocab_size] = warm_col
        if not self.shared or self.prompt_bigrams:
            # each slot's own entries: all it learns (private), or only its
            # prompt's bigrams (shared: they never enter the shared table)
            self.keys = torch.full((max_num_reqs, self.buckets + 1), -1, dtype=torch.int64,
                                   device=device)
            self.vals = torch.full_like(self.keys, -1)
        # device counters, read by stats() (never in a step)
        self.counters = torch.zeros(3, dtype=torch.int64, device=device)

    # ----------------------------------------------------------------- state
    def bind(self, model: Any) -> None:
        """The target module: its ``compute_logits`` scores hidden states."""
        compute = getattr(type(model), "compute_logits", None)
        if compute is None:
            raise RuntimeError(
                f"vllm_specplug: Token Recycling on vLLM 0.34 needs the target's "
                f"compute_logits, which {type(model).__name__} does not have")
        self.compute_logits = model.compute_logits

    def reset_slot(self, slot: int) -> None:
        if self.keys is not None:
            self.keys[slot] = -1

    def reset(self) -> None:
        if self.shared:
            self.table.fill_(-1)
            if self.warm is not None:
                self.table[: self.vocab_size] = self.warm
        if self.keys is not None:
            self.keys.fill_(-1)
        self.counters.zero_()

    def nbytes(self) -> int:
        tensors = [t for t in (self.table, self.keys, self.vals, self.warm) if t is not None]
        return int(sum(t.numel() * t.element_size() for t in tensors))

    def stats(self) -> dict[str, int]:
        learned, drafted_rows, drafted_tokens = (int(x) for x in self.counters.tolist())
        return {"tr_learned_positions": learned, "tr_rows": drafted_rows,
                "tr_tokens": drafted_tokens, "tr_table_bytes": self.nbytes()}

    # ------------------------------------------------------------ table ops
    def _lookup(self, slots: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        """The best next token after ``tok`` per row (-1: none known)."""
        ok = (tok >= 0) & (tok < self.vocab_size)
        safe = tok.clamp(0, self.vocab_size - 1)
        if self.shared:
            shared = torch.where(ok, self.table[safe], -1)
            if self.keys is None:
                return shared
            # where the shared table knows nothing: the slot's prompt bigram
            h = safe % self.buckets
            own = torch.where(ok & (self.keys[slots, h] == tok), self.vals[slots, h], -1)
            return torch.where(shared >= 0, shared, own)
        h = safe % self.buckets
        hit = ok & (self.keys[slots, h] == tok)
        out = self.vals[slots, h]
        fallback = self.warm[safe] if self.warm is not None else torch.full_like(tok, -1)
        return torch.where(hit, out, torch.where(ok, fallback, -1))

    def _write(self, slots: torch.Tensor, tok: torch.Tensor, nxt: torch.Tensor,
               mask: torch.Tensor, only_empty: bool, own: bool = False) -> None:
        """Entries ``tok -> nxt`` where ``mask`` (``only_empty``: where
        ``tok`` has no entry yet; ``own``: into the slots' own entries even
        when the table is shared). Among duplicates one write wins."""
        mask = mask & (tok >= 0) & (tok < self.vocab_size) & (nxt >= 0) \
            & (nxt < self.vocab_size)
        if only_empty:
            mask = mask & (self._lookup(slots, tok) < 0)
        # masked-out writes go to a spare last entry, never read (a boolean
        # index would wait for the device to learn how many entries are kept)
        if self.shared and not own:
            self.table[torch.where(mask, tok, self.vocab_size)] = nxt
            return
        h = torch.where(mask, tok % self.buckets, self.buckets)
        self.keys[slots, h] = tok
        self.vals[slots, h] = nxt

    def learn(self, input_batch: Any, hidden_states: torch.Tensor,
              prompt_len: torch.Tensor) -> None:
        """This step's lessons: prompt bigrams (``prompt_len``: per slot, on
        the device), then the target's argmax at every scored position."""
        if self.compute_logits is None:
            raise RuntimeError("vllm_specplug: Token Recycling has no target module "
                               "(GPUModelRunner.load_model's patch did not run)")
        ids = input_batch.input_ids
        n = int(input_batch.num_tokens)
        # (a batch with no prefilling row holds no prompt token: nothing to pair)
        if self.prompt_bigrams and input_batch.has_prefill and n > 1:
            # token i and i + 1 of one row, both in its prompt
            slots = self._token_slots(input_batch, n)
            pos = input_batch.positions[:n].long()
            pair = (slots[:-1] == slots[1:]) & (pos[1:] == pos[:-1] + 1) \
                & (pos[1:] < prompt_len[slots[1:]].long())
            self._write(slots[:-1], ids[:n - 1].long(), ids[1:n].long(), pair,
                        only_empty=True, own=True)
        where = input_batch.logits_indices
        logits = self.compute_logits(hidden_states[where])
        if logits is None:       # a tensor-parallel rank that does not draft
            return
        nxt = logits[:, : self.vocab_size].argmax(-1)
        slots = input_batch.expanded_idx_mapping[: where.shape[0]].long()
        self._write(slots, ids[where].long(), nxt, torch.ones_like(nxt, dtype=torch.bool),
                    only_empty=False)
        self.counters[0] += where.shape[0]

    def _token_slots(self, input_batch: Any, n: int) -> torch.Tensor:
        """The request-state slot of each of the batch's first ``n`` tokens."""
        starts = input_batch.query_start_loc[1: input_batch.num_reqs + 1]
        row = torch.searchsorted(starts, torch.arange(n, device=starts.device), right=True)
        return input_batch.idx_mapping.long()[row.clamp(max=input_batch.num_reqs - 1)]

    def chain(self, slots: torch.Tensor, last: torch.Tensor, k: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the best path of ``k`` tokens from ``last`` and which of
        them exist (a prefix): ``[rows, k]`` each."""
        out = torch.empty((last.shape[0], k), dtype=torch.int64, device=last.device)
        valid = torch.empty((last.shape[0], k), dtype=torch.bool, device=last.device)
        tok = last.long()
        ok = torch.ones_like(tok, dtype=torch.bool)
        for j in range(k):
            nxt = self._lookup(slots, tok)
            ok = ok & (nxt >= 0)
            out[:, j] = nxt
            valid[:, j] = ok
            tok = torch.where(ok, nxt, tok)
        self.counters[1] += valid[:, 0].sum()
        self.counters[2] += valid.sum()
        return out, valid
