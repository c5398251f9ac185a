"""``SamSpeculator``: the plugin's pure ``sam`` proposer behind vLLM 0.34's
``BaseSpeculator`` interface (Model Runner V2).

Each step, after vLLM wrote the step's sampled tokens into
``req_states.all_token_ids`` / ``total_len``, ``propose`` gets the batch:

* one gather on the device and one copy to the host per step, of a small
  ``[num_reqs, 3 + K + 2]`` block per batch row: the request's token count,
  its sampled count this step, its last sampled token, and its newest
  ``K + 2`` tokens (the K + 1 a step can commit and one to check continuity).
  A request's full history is copied once, when it is new to the speculator
  (a new request, a re-added one after preemption, or one whose newest tokens
  do not continue what the proposer saw);
* the proposer follows the newly committed tokens (``observe``), or starts
  the request from its history (``start``); a ``-1`` (an async placeholder
  that is not a token yet) ends what it takes this step, and the row gets no
  draft until the tokens are known;
* drafts of up to the step's K tokens, cut at the request's ``max_tokens``
  (``req_states.max_seq_len``), padded to K with the request's last sampled
  token (as vLLM's own suffix speculator does: every slot is verified,
  filler is simply rejected); rows still prefilling (nothing sampled) are
  all filler;
* ``draft_token_confidence_probs``: sam's learned acceptance per draft
  position (0 for filler), read by vLLM's adaptive verification when on.

Every one of the step's K slots is verified whether it holds a draft or
filler, so sam's cost-based draft length has nothing to save here: the
proposer's ``relative_token_cost`` is 0 and it drafts as far as it can
(up to K). With no per-rank timing in the drafts, every tensor-parallel rank
drafts the same tokens from the same history, without a broadcast.

``on_requests_finished`` completes finished requests (their outputs go to
sam's global store before the next draft, with ``isolation`` "none": vLLM
0.34's speculators cannot tell tenants apart, so by default requests share
no memory; see ``config.plugin_config``), ``add_request`` forgets what a
reused request-state slot held, ``reset_state`` forgets everything learned
(vLLM calls it after the warm-up requests).
"""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

from ... import faults, malloc_trim
from ...config import build_proposer
from ...proposers.base import Draft, RequestInfo, start_request
from ...warmup import warm_up
from .config import plugin_config

logger = logging.getLogger("vllm_specplug")

#: Columns of the per-step host block before the newest tokens.
_TOTAL, _SAMPLED, _LAST = 0, 1, 2
_HEAD = 3


class SamSpeculator(BaseSpeculator):
    def __init__(self, vllm_config: Any, device: torch.device, req_states: Any) -> None:
        spec = vllm_config.speculative_config
        self.plugin = plugin_config(spec)
        self.method = self.plugin["method"]
        # cross-request memory (docs/security.md): "none": one for every
        # request; "request" (the default on 0.34): none (config.plugin_config)
        self.tenant = () if self.plugin["isolation"] == "none" else None
        self.k = int(spec.num_speculative_tokens)
        self.device = device
        self.req_states = req_states
        max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.proposer = self._new_proposer()
        # numba kernels compile now, not in the first requests (docs/architecture.md,
        # "Cold start")
        warm_up(self.plugin)
        # faults contained (docs/architecture.md, "Faults"): a request whose
        # proposer call raised decodes without drafts for the rest of its life
        self.containment = faults.Containment(self.method)
        # glibc's free memory given back while serving (vllm_specplug.malloc_trim)
        self.malloc_trim = malloc_trim.from_env()
        # newest tokens copied per row: a step commits at most K + 1, plus one
        # already seen to check that they continue it
        self.window = self.k + 2
        self._cols = torch.arange(-self.window, 0, device=device)
        self.drafts = torch.zeros((max_num_reqs, self.k), dtype=torch.int64, device=device)
        self.draft_token_confidence_probs = torch.zeros(
            (max_num_reqs, self.k), dtype=torch.float32, device=device)
        # request-state slot -> (req_id, tokens the proposer has, last of them)
        self._rows: dict[int, tuple[str, int, int]] = {}
        # req_id -> its slot, for requests the proposer holds
        self._slots: dict[str, int] = {}
        self.stats = {"steps": 0, "rows": 0, "drafted_rows": 0, "draft_tokens": 0,
                      "starts": 0, "placeholder_rows": 0, "host_seconds": 0.0,
                      "copy_seconds": 0.0}

    def _new_proposer(self):
        proposer = build_proposer(self.plugin)
        # every slot of the step's K is verified: longer drafts cost nothing more
        proposer.relative_token_cost = 0.0
        return proposer

    # ------------------------------------------------------------ vLLM hooks
    def init_cudagraph_manager(self, cudagraph_mode: Any) -> None:
        del cudagraph_mode   # no device work to capture

    def capture(self) -> None:
        return None

    def add_request(self, req_index: int) -> None:
        """Slot ``req_index`` holds a new (or re-added) request: what the
        proposer kept for the slot's previous request is freed (a request
        preempted from it left without a hook)."""
        held = self._rows.pop(req_index, None)
        if held is not None:
            self._forget(held[0])

    def on_requests_finished(self, finished_req_ids) -> None:
        """Finished or aborted requests (not preempted): the tokens not yet
        followed are read (their slots are still readable), then the
        proposer completes them (sam's global store takes their outputs, in
        request-id order, before the next draft)."""
        for req_id in sorted(finished_req_ids):
            self.containment.finished(req_id)
            slot = self._slots.get(req_id)
            if slot is None:
                continue
            try:
                if self.req_states.req_id_to_index.get(req_id) == slot:
                    self._catch_up(slot)
                self.proposer.complete(req_id)
            except Exception as e:  # noqa: BLE001 - the store misses one document
                self.containment.request_fault(req_id, "complete", e, finished=True)
            self._rows.pop(slot, None)
            self._forget(req_id)
        if not self._slots:           # no request left: an idle moment to trim
            self.malloc_trim.maybe(idle=True)

    def reset_state(self) -> None:
        """Forget everything learned (global store, acceptance statistics)."""
        self.proposer = self._new_proposer()
        self._rows.clear()
        self._slots.clear()

    # --------------------------------------------------------------- drafting
    @torch.inference_mode()
    def propose(self, input_batch: Any, attn_metadata: Any, slot_mappings: Any,
                last_hidden_states: Any, aux_hidden_states: Any, num_sampled: torch.Tensor,
                num_rejected: torch.Tensor, last_sampled: torch.Tensor,
                next_prefill_tokens: Any, temperature: Any, seeds: Any,
                dp_sync_state: Any = None, dummy_run: bool = False,
                skip_attn_for_dummy_run: bool = False, mm_inputs: Any = None,
                is_profile: bool = False,
                num_speculative_tokens: int | None = None) -> torch.Tensor:
        num_reqs = input_batch.num_reqs
        if dummy_run or num_reqs == 0:
            return self.drafts[:num_reqs]
        started = time.perf_counter()
        block = self._step_block(input_batch.idx_mapping, num_sampled, last_sampled)
        copied = time.perf_counter()
        budget = self.k if num_speculative_tokens is None else min(
            int(num_speculative_tokens), self.k)
        slots = input_batch.idx_mapping_np
        out = np.repeat(block[:, _LAST:_LAST + 1], self.k, axis=1)
        conf = np.zeros((num_reqs, self.k), dtype=np.float32)
        for row in range(num_reqs):
            req_id = input_batch.req_ids[row]
            slot = int(slots[row])
            if req_id in self.containment:
                continue          # faulted earlier: filler only, for the rest of its life
            try:
                draft = self._propose_row(req_id, slot, block[row], budget)
            except Exception as e:  # noqa: BLE001 - one request's failure stays its own
                self.containment.request_fault(req_id, "propose", e)
                self._rows.pop(slot, None)
                self._forget(req_id)
                continue
            n = len(draft)
            if n:
                out[row, :n] = draft.tokens
                if draft.scores is not None:
                    conf[row, :n] = draft.scores
                self.stats["drafted_rows"] += 1
                self.stats["draft_tokens"] += n
        self.drafts[:num_reqs].copy_(torch.from_numpy(out))
        self.draft_token_confidence_probs[:num_reqs].copy_(torch.from_numpy(conf))
        self.stats["steps"] += 1
        self.stats["rows"] += num_reqs
        self.stats["copy_seconds"] += copied - started
        self.stats["host_seconds"] += time.perf_counter() - started
        self.malloc_trim.maybe(idle=False)
        return self.drafts[:num_reqs]

    def _step_block(self, idx_mapping: torch.Tensor, num_sampled: torch.Tensor,
                    last_sampled: torch.Tensor) -> np.ndarray:
        """``[num_reqs, 3 + window]`` int64 on the host: token count, sampled
        count, last sampled token and the newest ``window`` tokens of each
        batch row (-2 before a request's first token). One gather, one copy."""
        rs = self.req_states
        idx = idx_mapping.long()
        total = rs.total_len.gpu[idx].long()
        positions = total[:, None] + self._cols[None, :]
        tokens = rs.all_token_ids.gpu[idx[:, None], positions.clamp(min=0)].long()
        tokens = torch.where(positions >= 0, tokens, -2)
        head = torch.stack([total, num_sampled.long(), last_sampled.view(-1)[idx].long()], 1)
        return torch.cat([head, tokens], 1).cpu().numpy()

    def _history(self, slot: int, start: int, end: int) -> np.ndarray:
        """Tokens ``start:end`` of the request in ``slot`` (one copy)."""
        return self.req_states.all_token_ids.gpu[slot, start:end].cpu().numpy()

    def _follow(self, req_id: str, slot: int, total: int, window: np.ndarray | None) -> bool:
        """Bring the proposer up to the slot's ``total`` tokens: observe the
        new ones (from ``window``, the newest tokens, when they continue what
        it saw) or start the request from its whole history. Returns False
        when a placeholder (-1) stops it short of ``total``."""
        held = self._rows.get(slot)
        if held is not None and held[0] != req_id:   # the slot changed hands unseen
            self._forget(held[0])
            held = None
        new = None
        if held is not None and 1 <= held[1] <= total:
            seen, last = held[1], held[2]
            if window is not None and total - seen < self.window:
                check = window[self.window - (total - seen) - 1]
                if check == last:
                    new = window[self.window - (total - seen):]
            if new is None:
                got = self._history(slot, seen - 1, total)
                if got[0] == last:
                    new = got[1:]
        if new is not None:
            stop = _placeholder(new)
            if stop:
                self.proposer.observe(req_id, new[:stop].tolist())
            if stop < len(new):
                self._rows[slot] = (req_id, seen + stop, int(new[stop - 1]) if stop else last)
                return False
            self._rows[slot] = (req_id, total, int(new[-1]) if len(new) else last)
            return True
        history = self._history(slot, 0, total)
        stop = _placeholder(history)
        if req_id in self._slots:
            self._rows.pop(self._slots[req_id], None)
            self.proposer.finish(req_id)
        info = RequestInfo(tenant=self.tenant,
                           num_prompt_tokens=int(self.req_states.prompt_len.np[slot]))
        start_request(self.proposer, req_id, history[:stop].tolist(), info)
        self.stats["starts"] += 1
        self._slots[req_id] = slot
        self._rows[slot] = (req_id, stop, int(history[stop - 1]) if stop else -2)
        return stop == total

    def _catch_up(self, slot: int) -> None:
        req_id = self._rows[slot][0]
        total = int(self.req_states.total_len.gpu[slot])
        self._follow(req_id, slot, total, None)

    def _propose_row(self, req_id: str, slot: int, block: np.ndarray, budget: int) -> Draft:
        """Follow the row's tokens and draft up to ``budget`` tokens, cut at
        max_tokens (as the V1 adapter's drafter does). A row still
        prefilling (nothing sampled this step) is not followed yet: the
        proposer starts at the request's first sampled token, as on V1."""
        if int(block[_SAMPLED]) <= 0:
            return Draft.empty()
        total = int(block[_TOTAL])
        if not self._follow(req_id, slot, total, block[_HEAD:]):
            self.stats["placeholder_rows"] += 1
            return Draft.empty()
        if budget <= 0:
            return Draft.empty()
        draft = self.proposer.propose(req_id, budget)
        # the deepest position that can still be committed within max_tokens
        room = max(int(self.req_states.max_seq_len[slot]) - total - 1, 0)
        if len(draft) > room:
            draft = Draft(draft.tokens[:room], None,
                          None if draft.scores is None else draft.scores[:room])
            self.proposer.draft_cut(req_id, draft)
        return draft

    def _forget(self, req_id: str) -> None:
        slot = self._slots.pop(req_id, None)
        if slot is not None and self._rows.get(slot, ("",))[0] == req_id:
            del self._rows[slot]
        try:
            self.proposer.finish(req_id)
        except Exception as e:  # noqa: BLE001 - freeing one request never stops the engine
            self.containment.request_fault(req_id, "finish", e, finished=True)


def _placeholder(tokens: np.ndarray) -> int:
    """Index of the first -1 (a token not known yet), or ``len(tokens)``."""
    hits = np.flatnonzero(tokens == -1)
    return int(hits[0]) if hits.size else len(tokens)
