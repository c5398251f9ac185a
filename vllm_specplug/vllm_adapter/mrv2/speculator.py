"""``SamSpeculator``: the plugin's pure ``sam`` proposer behind vLLM 0.34's
``BaseSpeculator`` interface (Model Runner V2), without ever waiting for the
device in ``propose``.

vLLM 0.34 schedules asynchronously: when ``propose(t)`` runs on the host, the
device may still be computing step t, and a copy of step t's tokens to the
host would stall it. vLLM's own ``ngram`` and ``suffix`` draft in device
kernels; ``sam``'s automata live on the host. So the host drafts one step
late and the device finishes the job:

* ``propose(t)`` enqueues an asynchronous copy (pinned memory, non-blocking)
  of each row's token count and newest ``K + 2`` tokens; the host reads it
  at ``propose(t + 1)`` (its copy finished long before; an unfinished one is
  never waited for: its rows draft nothing that step).
* The host brings the proposer up to what it knows (the tokens committed
  through step t - 1) and drafts, per row, a chain ``C`` of up to
  ``2K + 1`` tokens starting at position ``base`` (the tokens it knows): long
  enough to hold the ``m <= K + 1`` tokens step t commits and K more.
* A few device ops (no host round trip) compare the row's committed tokens
  at ``base .. total - 1`` with ``C[:m]``: where they agree, the draft is
  ``C[m : m + K]``; elsewhere it is filler (the last sampled token, as
  vLLM's own ``suffix`` pads). After a rejection the committed correction is
  seldom in ``C``, so that row pads for a step; this is what the lag costs
  (results/mrv2/README.md measures it against the synchronous design).
* A request new to the speculator (new, resumed after preemption, or out of
  step) gets its history by the same kind of asynchronous copy, and its
  automaton is built at most ``BUILD_TOKENS_PER_STEP`` tokens a step, so a
  32k-token prompt delays its own drafts by a few steps, never the batch's.

Drafts stop at the request's ``max_tokens`` and never hold an id outside the
target's vocabulary. Under tensor parallelism only the first rank of the TP
group drafts, and the others receive its drafts (one broadcast of
``[rows, K]`` on the device, no host sync), so a fault on one rank cannot make
the ranks verify different tokens. ``draft_token_confidence_probs`` are
sam's learned acceptance per position (0 for filler), used when the speculative
config's ``enable_adaptive_verification`` is on (vLLM allows it with full
CUDA graphs only).

``on_requests_finished`` completes finished requests (their outputs go to
sam's global store, with ``isolation`` "none"), ``add_request`` forgets what a
reused request-state slot held, ``reset_state`` forgets everything learned.
No malloc trim runs here: every hook of an MRV2 speculator runs inside a
step.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

from ... import faults
from ...config import build_proposer
from ...proposers.base import Draft, RequestInfo, start_request
from ...proposers.sam import SamProposer
from ...proposers.token_recycling import load_matrix
from ...warmup import warm_up
from .config import plugin_config
from .recycling import DeviceRecycling

logger = logging.getLogger("vllm_specplug")

#: Host tokens of automaton building a step, over all new requests (sam's
#: automaton costs 5-7 us a token: about 10-15 ms at most a step).
BUILD_TOKENS_PER_STEP = 2048
#: Concurrent history copies in flight (each up to max_model_len tokens).
HISTORY_SLOTS = 4
#: n-gram sizes of the device's re-anchoring (rows whose chain missed the
#: committed tokens), longest first.
REANCHOR_NGRAM = (3, 2, 1)
#: Tokens of finished outputs kept on the device for re-anchoring (a ring:
#: the oldest are overwritten), with isolation "none" only.
CORPUS_TOKENS = 1 << 17


@dataclass
class _Req:
    """What the speculator keeps for one request: its request-state slot,
    how many of its tokens the proposer has (``seen``) and the last of them.
    While ``job`` is set the request is being (re)built from its history."""
    slot: int
    seen: int = 0
    last: int = -1
    job: "_Job | None" = None


@dataclass
class _Job:
    """A history copy to the host: tokens ``[0, end)`` of a slot land in
    staging row ``row``; ``done`` of them are in the proposer; ``tail`` holds
    tokens after ``end`` seen in step blocks meanwhile."""
    row: int
    end: int
    event: Any
    done: int = 0
    tail: list[int] = field(default_factory=list)
    broken: bool = False    # a gap in the tail: start again


@dataclass
class _Block:
    """The step block copied at one step: rows' request ids and slots, and
    the host buffer its copy lands in."""
    req_ids: list[str]
    slots: np.ndarray
    buf: int
    event: Any
    read: set[str] = field(default_factory=set)   # rows already followed


#: Methods whose chain comes from sam on the host (the rest of this module).
HOST_SAM = ("sam", "sam_tr")
#: Methods that draft Token Recycling's chain on the device (recycling.py).
DEVICE_TR = ("token_recycling", "sam_tr")


class SamSpeculator(BaseSpeculator):
    """``sam``, ``token_recycling`` and ``sam_tr`` on Model Runner V2 (see the
    module doc; Token Recycling's part: ``recycling.py``). ``sam_tr`` drafts
    sam's chain where sam's match is at least ``sam_tr_threshold`` tokens long
    (as the V1 hybrid switches) and Token Recycling's chain otherwise."""

    def __init__(self, vllm_config: Any, device: torch.device, req_states: Any) -> None:
        spec = vllm_config.speculative_config
        self.plugin = plugin_config(spec)
        self.method = self.plugin["method"]
        options = self.plugin["options"]
        self.threshold = int(options.get("sam_tr_threshold", 0))
        # cross-request memory (docs/security.md): "none": one for every
        # request; "request" (the default on 0.34): none (config.plugin_config)
        self.tenant = () if self.plugin["isolation"] == "none" else None
        self.k = int(spec.num_speculative_tokens)
        self.enable_adaptive_verification = bool(spec.enable_adaptive_verification)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        self.device = device
        self.req_states = req_states
        max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        max_model_len = vllm_config.model_config.max_model_len
        # only the first rank of a tensor-parallel group drafts (the others
        # take its drafts: the ranks always verify the same tokens)
        self.tp_group = None
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            from vllm.distributed import get_tp_group

            self.tp_group = get_tp_group()
        self.drafting_rank = self.tp_group is None or self.tp_group.rank_in_group == 0
        # the host's chain: the tokens a step can commit (K + 1), then K
        self.span = 2 * self.k + 1
        self.proposer = self._new_proposer()
        # numba kernels compile now, not in the first requests
        if self.proposer is not None:
            warm_up(self._sam_plugin())
        self.recycling = None
        if self.method in DEVICE_TR:
            warm = (load_matrix(options["tr_matrix"], 1)
                    if options.get("tr_matrix") else None)
            self.recycling = DeviceRecycling(
                vocab_size=self.vocab_size, max_num_reqs=vllm_config.scheduler_config.max_num_seqs,
                device=device, shared=self.tenant == (), warm=warm,
                prompt_bigrams=bool(options["tr_prompt_bigrams"]))
        self.containment = faults.Containment(self.method)
        # newest tokens per row in a step block: what a step commits, and one
        # the proposer has already, to check they continue what it saw
        self.window = self.k + 2
        # pinned host buffers and events on a GPU; on a CPU device copies are
        # synchronous and nothing is ever in flight
        self._cuda = device.type == "cuda"

        def host(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, pin_memory=self._cuda)

        # device outputs
        self.drafts = torch.zeros((max_num_reqs, self.k), dtype=torch.int64, device=device)
        self.draft_token_confidence_probs = torch.zeros(
            (max_num_reqs, self.k), dtype=torch.float32, device=device)
        # step blocks: [rows, 1 + window] (token count, newest tokens), two
        # host buffers used in turn
        self._block_host = [host(max_num_reqs, 1 + self.window) for _ in range(2)]
        self._block_np = [b.numpy() for b in self._block_host]
        self._block_cols = torch.arange(-self.window, 0, device=device)
        self._next_buf = 0
        self._pending: _Block | None = None
        # candidates: chain, its base position, its length, its confidences
        # (host in turn, then device)
        self._cand_host = [(host(max_num_reqs, self.span), host(max_num_reqs, 4),
                            host(max_num_reqs, self.span, dtype=torch.float32))
                           for _ in range(2)]
        self._cand_np = [tuple(t.numpy() for t in bufs) for bufs in self._cand_host]
        self._cand_events: list[Any] = [None, None]
        self._cand = torch.zeros((max_num_reqs, self.span), dtype=torch.int64, device=device)
        # per row: base, chain length, max_seq_len, sam's match long (sam_tr)
        self._cand_meta = torch.zeros((max_num_reqs, 4), dtype=torch.int64, device=device)
        self._cand_conf = torch.zeros((max_num_reqs, self.span), dtype=torch.float32,
                                      device=device)
        self._span_cols = torch.arange(self.span, device=device)
        self._k_cols = torch.arange(self.k, device=device)
        # history copies
        self._stage = host(HISTORY_SLOTS, max_model_len, dtype=torch.int32)
        self._stage_np = self._stage.numpy()
        self._free_stage = list(range(HISTORY_SLOTS))
        self._reqs: dict[str, _Req] = {}
        self._slot_req: dict[int, str] = {}
        # finished outputs on the device, for re-anchoring (requests share
        # them only where sam's global store is shared: isolation "none")
        self._ring = self._ring_age = None
        self._ring_pos = self._ring_count = 0
        if self.tenant == () and self.proposer is not None and self.proposer.stores is not None:
            self._ring = torch.full((CORPUS_TOKENS,), -9, dtype=torch.int64, device=device)
            self._ring_age = torch.full((CORPUS_TOKENS,), -1, dtype=torch.int64, device=device)
        self.stats = {"steps": 0, "rows": 0, "candidate_rows": 0, "candidate_tokens": 0,
                      "starts": 0, "history_copies": 0, "build_tokens": 0,
                      "blocks_not_ready": 0, "corpus_tokens": 0, "device_op_seconds": 0.0,
                      "host_seconds": 0.0,
                      "max_host_seconds": 0.0}

    def _sam_plugin(self) -> dict[str, Any]:
        """sam's plugin config: the method's own, or sam's part of sam_tr's."""
        if self.method == "sam":
            return self.plugin
        names = {o.name for o in SamProposer.options}
        plugin = {k: v for k, v in self.plugin.items() if k != "auto_budget"}
        return {**plugin, "method": "sam",
                "options": {k: v for k, v in self.plugin["options"].items() if k in names}}

    def _new_proposer(self):
        """The host's sam (None for Token Recycling alone, all on the device)."""
        if self.method not in HOST_SAM:
            return None
        # the chain is ``span`` tokens long (the proposer caps drafts at its K)
        proposer = build_proposer({**self._sam_plugin(), "num_speculative_tokens": self.span})
        # every slot of the step's K is verified: longer drafts cost nothing more
        proposer.relative_token_cost = 0.0
        return proposer

    def bind_target(self, model: Any) -> None:
        """The target module (GPUModelRunner.load_model's patch hands it over):
        Token Recycling scores the step's hidden states with its lm_head."""
        if self.recycling is not None:
            self.recycling.bind(model)

    # ------------------------------------------------------------ vLLM hooks
    def init_cudagraph_manager(self, cudagraph_mode: Any) -> None:
        del cudagraph_mode   # no device work to capture

    def capture(self) -> None:
        return None

    def add_request(self, req_index: int) -> None:
        """Slot ``req_index`` holds a new (or re-added) request: what the
        speculator kept for the slot's previous request is freed (a request
        preempted from it left without a hook)."""
        req_id = self._slot_req.get(req_index)
        if req_id is not None:
            self._forget(req_id)
        if self.recycling is not None:
            self.recycling.reset_slot(req_index)

    def on_requests_finished(self, finished_req_ids) -> None:
        """Finished or aborted requests (not preempted): the last step block
        is read if its copy is done (never waited for), then the proposer
        completes each (sam's global store takes their outputs, in request-id
        order, before the next draft)."""
        if self.drafting_rank:
            self._drain(only=set(finished_req_ids))
        for req_id in sorted(finished_req_ids):
            self.containment.finished(req_id)
            req = self._reqs.get(req_id)
            if req is None:
                continue
            if req.job is None and self.proposer is not None:
                try:
                    self.proposer.complete(req_id)
                    if self._ring is not None:
                        self._to_corpus(req)
                except Exception as e:  # noqa: BLE001 - the store misses one document
                    self.containment.request_fault(req_id, "complete", e, finished=True)
            self._forget(req_id)

    def reset_state(self) -> None:
        """Forget everything learned (global store, acceptance statistics)."""
        self.proposer = self._new_proposer()
        for req_id in list(self._reqs):
            self._forget(req_id, finish=False)
        self._pending = None
        if self.recycling is not None:
            self.recycling.reset()
        if self._ring is not None:
            self._ring.fill_(-9)
            self._ring_age.fill_(-1)
            self._ring_pos = self._ring_count = self.stats["corpus_tokens"] = 0

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
        n = input_batch.num_reqs
        if dummy_run or n == 0:
            return self.drafts[:n]
        started = time.perf_counter()
        if self.recycling is not None:
            # every rank (the target's compute_logits gathers across TP ranks)
            self.recycling.learn(input_batch, last_hidden_states,
                                 self.req_states.prompt_len.gpu)
        if self.drafting_rank:
            idx = input_batch.idx_mapping.long()
            total = self.req_states.total_len.gpu[idx].long()   # each row's tokens now
            if self.proposer is not None:
                self._drain()                               # step t - 1's block
                self._stage_block(idx, total, input_batch)  # step t's, read next step
                self._build()                               # new requests' automata
            buf = self._candidates(input_batch)
            ops = time.perf_counter()
            self._select(idx, total, n, num_sampled, last_sampled, buf)
            # enqueued on a GPU (launches only); run inline on a CPU device
            self.stats["device_op_seconds"] += time.perf_counter() - ops
        if self.tp_group is not None:
            self.tp_group.broadcast(self.drafts[:n], src=0)
            self.tp_group.broadcast(self.draft_token_confidence_probs[:n], src=0)
        spent = time.perf_counter() - started
        self.stats["steps"] += 1
        self.stats["rows"] += n
        self.stats["host_seconds"] += spent
        self.stats["max_host_seconds"] = max(self.stats["max_host_seconds"], spent)
        return self.drafts[:n]

    def _ready(self, event: Any) -> bool:
        return event is None or event.query()

    def _record(self) -> Any:
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _stage_block(self, idx: torch.Tensor, total: torch.Tensor, input_batch: Any) -> None:
        """Enqueue this step's block to the host: per row, its token count and
        its newest ``window`` tokens (-2 before a request's first token)."""
        rs = self.req_states
        n = input_batch.num_reqs
        positions = total[:, None] + self._block_cols[None, :]
        tokens = rs.all_token_ids.gpu[idx[:, None], positions.clamp(min=0)].long()
        tokens = torch.where(positions >= 0, tokens, -2)
        buf = self._next_buf
        self._next_buf ^= 1
        self._block_host[buf][:n].copy_(torch.cat([total[:, None], tokens], 1),
                                        non_blocking=True)
        self._pending = _Block(list(input_batch.req_ids), np.array(input_batch.idx_mapping_np),
                               buf, self._record())

    def _drain(self, only: set[str] | None = None) -> None:
        """Bring the proposer up to the last step block, if its copy is done
        (``only``: just these requests' rows; the others are read later)."""
        block = self._pending
        if block is None:
            return
        if not self._ready(block.event):
            self.stats["blocks_not_ready"] += 1
            return
        if only is None:
            self._pending = None
        rows = self._block_np[block.buf]
        slot_of = self.req_states.req_id_to_index
        for row, req_id in enumerate(block.req_ids):
            if req_id in block.read or (only is not None and req_id not in only):
                continue
            block.read.add(req_id)
            # a request preempted since (its slot freed or given to another)
            if req_id in self.containment or slot_of.get(req_id) != int(block.slots[row]):
                continue
            try:
                self._follow(req_id, int(block.slots[row]), rows[row])
            except Exception as e:  # noqa: BLE001 - one request's failure stays its own
                self._fault(req_id, "observe", e)

    def _follow(self, req_id: str, slot: int, row: np.ndarray) -> None:
        total, window = int(row[0]), row[1:]
        req = self._reqs.get(req_id)
        if req is not None and req.slot != slot:     # re-added elsewhere
            self._forget(req_id)
            req = None
        if req is None:
            self._schedule_history(req_id, slot, total)
            return
        if req.job is not None:                      # building: keep the newest tokens
            job = req.job
            have = job.end + len(job.tail)
            new = total - have
            if 0 < new < self.window:
                job.tail.extend(int(t) for t in window[self.window - new:])
            elif new >= self.window:
                job.broken = True
            return
        new = total - req.seen
        if new <= 0:
            return
        if new < self.window and window[self.window - new - 1] == req.last:
            tokens = window[self.window - new:]
            self.proposer.observe(req_id, tokens.tolist())
            req.seen, req.last = total, int(tokens[-1])
            return
        # out of step (a gap the window does not cover): start again from history
        self._forget(req_id)
        self._schedule_history(req_id, slot, total)

    def _schedule_history(self, req_id: str, slot: int, end: int) -> None:
        """Enqueue a copy of the slot's tokens ``[0, end)`` to the host."""
        if not self._free_stage or end <= 0:
            return                                   # a later step's block retries
        stage = self._free_stage.pop()
        rs = self.req_states
        self._stage[stage, :end].copy_(rs.all_token_ids.gpu[slot, :end], non_blocking=True)
        self._reqs[req_id] = _Req(slot, job=_Job(stage, end, self._record()))
        self._slot_req[slot] = req_id
        self.stats["history_copies"] += 1

    def _build(self) -> None:
        """Feed copied histories to the proposer, at most
        ``BUILD_TOKENS_PER_STEP`` tokens this step over all requests."""
        budget = BUILD_TOKENS_PER_STEP
        for req_id, req in list(self._reqs.items()):
            job = req.job
            if job is None or budget <= 0 or not self._ready(job.event):
                continue
            if job.broken:
                self._forget(req_id)
                continue
            try:
                take = min(budget, job.end - job.done)
                chunk = self._stage_np[job.row, job.done:job.done + take].tolist()
                if job.done == 0:
                    prompt = int(self.req_states.prompt_len.np[req.slot])
                    start_request(self.proposer, req_id, chunk,
                                  RequestInfo(tenant=self.tenant, num_prompt_tokens=prompt))
                    self.stats["starts"] += 1
                elif chunk:
                    self.proposer.observe(req_id, chunk)
                job.done += take
                budget -= take
                self.stats["build_tokens"] += take
                if job.done == job.end:
                    if job.tail:
                        self.proposer.observe(req_id, job.tail)
                    tokens = job.end + len(job.tail)
                    req.last = job.tail[-1] if job.tail else int(
                        self._stage_np[job.row, job.end - 1])
                    req.seen = tokens
                    req.job = None
                    self._free_stage.append(job.row)
            except Exception as e:  # noqa: BLE001
                self._fault(req_id, "start", e)

    def _candidates(self, input_batch: Any) -> int:
        """Each row's chain from what the proposer knows, to the device
        (asynchronously, from a host buffer not in use by a copy in flight).
        Returns the buffer's index, or -1 when none was free."""
        n = input_batch.num_reqs
        buf = self._next_buf     # the block took the other one this step
        if self.proposer is None:
            self._next_buf ^= 1  # no block: take turns here
        if not self._ready(self._cand_events[buf]):
            self.stats["blocks_not_ready"] += 1
            return -1
        chain, meta, conf = self._cand_np[buf]
        meta[:n] = 0
        meta[:n, 2] = self.req_states.max_seq_len[input_batch.idx_mapping_np[:n]]
        for row in range(n if self.proposer is not None else 0):
            req_id = input_batch.req_ids[row]
            req = self._reqs.get(req_id)
            if req is None or req.job is not None or req_id in self.containment:
                continue
            if req.slot != int(input_batch.idx_mapping_np[row]):
                continue
            try:
                draft = self._chain(req_id, req)
            except Exception as e:  # noqa: BLE001
                self._fault(req_id, "propose", e)
                continue
            m = len(draft)
            if m:
                chain[row, :m] = draft.tokens
                conf[row, :m] = 0.0 if draft.scores is None else draft.scores
                meta[row, :2] = (req.seen, m)
                if self.threshold:
                    meta[row, 3] = self.proposer.match_len(req_id) >= self.threshold
                self.stats["candidate_rows"] += 1
                self.stats["candidate_tokens"] += m
        hchain, hmeta, hconf = self._cand_host[buf]
        self._cand_meta[:n].copy_(hmeta[:n], non_blocking=True)
        if self.proposer is not None:   # Token Recycling alone: no host chain
            self._cand[:n].copy_(hchain[:n], non_blocking=True)
            self._cand_conf[:n].copy_(hconf[:n], non_blocking=True)
        self._cand_events[buf] = self._record()
        return buf

    def _chain(self, req_id: str, req: _Req) -> Draft:
        """The proposer's chain from the request's ``seen`` tokens, cut at
        ``max_tokens`` and at the first id outside the vocabulary."""
        # index i of the chain is position seen + i; a draft position p is
        # committable while p < max_seq_len - 1 (the step's own token last)
        room = int(self.req_states.max_seq_len[req.slot]) - 1 - req.seen
        budget = min(self.span, room)
        if budget <= 0:
            return Draft.empty()
        draft = self.proposer.propose(req_id, budget)
        tokens = draft.tokens
        bad = np.flatnonzero((tokens < 0) | (tokens >= self.vocab_size))
        keep = min(len(tokens), budget, int(bad[0]) if bad.size else len(tokens))
        if keep < len(tokens):
            draft = Draft(tokens[:keep], None,
                          None if draft.scores is None else draft.scores[:keep])
            self.proposer.draft_cut(req_id, draft)
        return draft

    def _select(self, idx: torch.Tensor, total: torch.Tensor, n: int,
                num_sampled: torch.Tensor, last_sampled: torch.Tensor, buf: int) -> None:
        """On the device: each row's draft is its chain after the tokens
        actually committed, where the chain holds them; filler elsewhere."""
        rs = self.req_states
        filler = last_sampled.view(-1)[idx].long()
        if buf < 0:
            self.drafts[:n] = filler[:, None]
            self.draft_token_confidence_probs[:n] = 0.0
            return
        chain = self._cand[:n]
        base, length = self._cand_meta[:n, 0], self._cand_meta[:n, 1]
        sampled = num_sampled.view(-1)[:n] > 0             # rows still prefilling: filler
        cols = torch.zeros((n, self.k), dtype=torch.long, device=filler.device)
        valid = torch.zeros((n, self.k), dtype=torch.bool, device=filler.device)
        hit = torch.zeros(n, dtype=torch.bool, device=filler.device)
        draft = filler[:, None].expand(n, self.k)
        if self.proposer is not None:
            m = total - base                                  # tokens committed since base
            positions = (base[:, None] + self._span_cols[None, :]).clamp(
                max=rs.all_token_ids.gpu.shape[1] - 1)
            committed = rs.all_token_ids.gpu[idx[:, None], positions].long()
            known = self._span_cols[None, :] < m[:, None]
            agree = ((committed == chain) | ~known).all(1)
            hit = agree & (length > m) & (m >= 0) & sampled
            cols = m[:, None] + self._k_cols[None, :]
            valid = hit[:, None] & (cols < length[:, None])
            cols = cols.clamp(0, self.span - 1)
            # where the chain misses the committed tokens (after a rejection,
            # mostly): re-anchor on the device, in the chain and the row's own
            # history, after the last earlier occurrence of its newest tokens
            back, back_valid = self._reanchor(idx, total, chain, length)
            back_valid &= (~hit & sampled)[:, None]
            draft = torch.where(valid, chain.gather(1, cols),
                                torch.where(back_valid, back, draft))
            valid = valid | back_valid
        if self.recycling is not None:
            limit, long_match = self._cand_meta[:n, 2], self._cand_meta[:n, 3] > 0
            # a draft at position total + j is committable while < max_seq_len - 1
            # (sam's host chain is cut there already)
            room = (total[:, None] + self._k_cols[None, :]) < (limit - 1)[:, None]
            tr, tr_valid = self.recycling.chain(idx, filler, self.k)
            # Token Recycling's chain, except (sam_tr) where sam's chain follows
            # a long match; sam's own otherwise only where TR knows nothing
            use_tr = tr_valid[:, 0] & sampled & ~(hit & long_match)
            draft = torch.where(use_tr[:, None], tr, draft)
            valid = torch.where(use_tr[:, None], tr_valid & room, valid)
            hit = hit & ~use_tr
        self.drafts[:n] = torch.where(valid, draft, filler[:, None])
        conf = self._cand_conf[:n].gather(1, cols)
        self.draft_token_confidence_probs[:n] = torch.where(valid & hit[:, None], conf, 0.0)

    def _reanchor(self, idx: torch.Tensor, total: torch.Tensor, chain: torch.Tensor,
                  length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, on the device: the K tokens after an earlier occurrence of
        the row's newest ``n`` tokens, for the largest ``n`` in
        ``REANCHOR_NGRAM`` that occurs (as vLLM's ngram drafts): the
        rightmost one in the row's history then its chain (the chain's wins a
        tie), else the newest one in the finished outputs' corpus; and which
        of those tokens exist. ``[rows, K]`` each."""
        history = self.req_states.all_token_ids.gpu[idx].long()      # [rows, L]
        rows, width = history.shape
        device = history.device
        hpos = torch.arange(width, device=device)
        history = torch.where(hpos[None, :] < total[:, None], history, -5)
        chain = torch.where(self._span_cols[None, :] < length[:, None], chain, -6)
        # one sentinel column last: a continuation clamped past the end reads it
        seq = torch.cat([history, chain, torch.full_like(chain[:, :1], -7)], 1)
        size_all = seq.shape[1]
        positions = torch.arange(size_all, device=device)
        # a match must leave a token after it in its part (in the history,
        # it ends before the row's newest token: not the query itself)
        limit = torch.where(positions[None, :] < width, (total - 1)[:, None],
                            (width + length - 1)[:, None])
        found = torch.zeros(rows, dtype=torch.bool, device=device)
        start = torch.zeros(rows, dtype=torch.long, device=device)
        in_corpus = torch.zeros(rows, dtype=torch.bool, device=device)
        ring = self._ring
        for size in REANCHOR_NGRAM:                                  # longest first
            query = seq.gather(1, (total[:, None] - size + torch.arange(
                size, device=device)[None, :]).clamp(min=0))
            span = size_all - size + 1
            match = positions[None, :span] + size <= limit[:, :span]
            for j in range(size):
                match &= seq[:, j:span + j] == query[:, j:j + 1]
            score = torch.where(match, positions[None, :span] + 1, 0).amax(1)
            take = (score > 0) & ~found & (total > size)
            start = torch.where(take, score - 1 + size, start)
            found |= take
            if ring is None:
                continue
            # the corpus: windows with a token after them, the newest wins
            span = ring.shape[0] - size
            match = (ring[None, size:size + span] >= 0).expand(rows, span).clone()
            for j in range(size):
                match &= ring[None, j:span + j] == query[:, j:j + 1]
            age, where = torch.where(match, self._ring_age[None, :span], -1).max(1)
            take = (age >= 0) & ~found & (total > size)
            start = torch.where(take, where + size, start)
            in_corpus |= take
            found |= take
        cols = (start[:, None] + self._k_cols[None, :]).clamp(max=size_all - 1)
        out = seq.gather(1, cols)
        ok = out >= 0
        if ring is not None:
            from_ring = ring[(start[:, None] + self._k_cols[None, :]) % ring.shape[0]]
            # a document's continuation stops at its end (a separator or unwritten)
            ring_ok = (from_ring >= 0).long().cumprod(1).bool()
            out = torch.where(in_corpus[:, None], from_ring, out)
            ok = torch.where(in_corpus[:, None], ring_ok, ok)
        return out, found[:, None] & ok

    def _to_corpus(self, req: _Req) -> None:
        """A finished request's output (still in its slot) appended to the
        corpus ring on the device, then a separator; oldest tokens overwritten."""
        ring = self._ring
        first = int(self.req_states.prompt_len.np[req.slot])
        end = req.seen
        size = ring.shape[0]
        first = max(first, end - (size - 1))
        n = end - first
        if n <= 0:
            return
        tokens = torch.cat([self.req_states.all_token_ids.gpu[req.slot, first:end].long(),
                            torch.full((1,), -8, dtype=torch.long, device=ring.device)])
        ages = torch.arange(self._ring_count, self._ring_count + n + 1, device=ring.device)
        ages[-1] = -1                                       # a separator is never matched
        self._ring_count += n + 1
        head = min(n + 1, size - self._ring_pos)
        ring[self._ring_pos:self._ring_pos + head] = tokens[:head]
        self._ring_age[self._ring_pos:self._ring_pos + head] = ages[:head]
        if head < n + 1:
            ring[:n + 1 - head] = tokens[head:]
            self._ring_age[:n + 1 - head] = ages[head:]
        self._ring_pos = (self._ring_pos + n + 1) % size
        self.stats["corpus_tokens"] = min(self.stats["corpus_tokens"] + n, size)

    def _fault(self, req_id: str, hook: str, error: BaseException) -> None:
        self.containment.request_fault(req_id, hook, error)
        self._forget(req_id)

    def _forget(self, req_id: str, finish: bool = True) -> None:
        req = self._reqs.pop(req_id, None)
        if req is None:
            return
        if self._slot_req.get(req.slot) == req_id:
            del self._slot_req[req.slot]
        if req.job is not None:
            self._free_stage.append(req.job.row)
            if req.job.done == 0:
                return                                # the proposer never saw it
        if not finish:
            return
        try:
            self.proposer.finish(req_id)
        except Exception as e:  # noqa: BLE001 - freeing one request never stops the engine
            self.containment.request_fault(req_id, "finish", e, finished=True)
