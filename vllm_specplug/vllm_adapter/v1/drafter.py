"""The ``custom_class`` drafter vLLM builds in each worker for our methods.

It turns vLLM's row-indexed call into per-request proposer calls:

* a request's state is (re)built from the runner's token array when it is new,
  or when its token count or last token no longer match what we saw (after a
  preemption by recomputation, or a step the drafter did not see);
* otherwise only the newly committed tokens are observed;
* requests that left the batch (finished, aborted, preempted) are freed.

Faults (docs/architecture.md, "Faults"): an exception in a proposer hook
costs its request's drafts, never the engine. The request decodes without
drafts for the rest of its life (still lossless: it proposes nothing), its
state is freed, the error is logged once with a traceback and counted
(``stats()["faults"]``). A fault in a step shared by the batch (step timing,
batch-aware budget, a target hook's features) gives no drafts for that step.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ...budget import (SAVE_EVERY, AcceptanceCalibration, ExplorationYield, StepCostModel,
                      DrainValuation, allocate_batch_exploring, expected_accepted, load_prior,
                      save_fit, subset)
from ... import faults, malloc_trim
from ...config import ADDITIONAL_CONFIG_KEY, ISOLATION_KEY, build_proposer
from ...goodput import GoodputController, RequestBackoff
from ...proposers.base import Draft, OutputEnd, start_request
from ...tree import depths
from ...warmup import enabled as warmup_enabled
from ...warmup import warm_up
from . import stats_export, tenancy
from .queue_state import waiting_of
from .drafter_state import DrafterState
from .request_state import FieldView, RequestRecords, StepBudget
from .step_state import StepTrees, bind_tree_layers

logger = logging.getLogger("vllm_specplug")

# In batch steps, up to this share of a step's time (the decoding rows' cost)
# buys draft nodes the batch-aware budget would cut, so acceptance estimates
# that start (or fall) below the bar keep learning: at worst a batch runs this
# much slower than without them, and less once explored nodes are seen not to
# pay (``budget.ExplorationYield``: down to a tenth of it). Unspent time
# carries over for at most EXPLORE_CARRY steps.
EXPLORE_SHARE = 0.05
EXPLORE_CARRY = 16
#: at most this many requests remembered as preempted (``RequestRecord.preempted``);
#: one dropped beyond it only skips ``Proposer.complete`` at its finish
MAX_PREEMPTED = 1 << 16


def step_cost_cache_path(vllm_config: Any, tree: bool = False) -> Path | None:
    """Where this engine's step-cost fit is cached: one file per machine
    (CPU or GPU name), model, dtype, parallel layout and verification path
    (``tree``: drafts verified through our tree attention, whose tokens
    cost more than a chain's in vLLM's own kernel), in
    ``<cache root>/step_cost``, or in the folder ``VLLM_SPECPLUG_STEP_COST_CACHE``
    names (the tests use a temporary one). None when disabled with
    ``VLLM_SPECPLUG_STEP_COST_CACHE=0``."""
    setting = os.environ.get("VLLM_SPECPLUG_STEP_COST_CACHE", "1")
    if setting == "0":
        return None
    from ...models import cache_root

    try:
        import torch

        device = (torch.cuda.get_device_name() if torch.cuda.is_available()
                  else f"cpu-{platform.machine()}-{os.cpu_count()}-{_cpu_model()}")
    except Exception:  # noqa: BLE001 - no device name: no cache
        return None
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    key = "|".join(str(x) for x in (
        device, mc.model, mc.dtype, pc.tensor_parallel_size, pc.pipeline_parallel_size))
    if tree:  # chain engines keep the keys they had
        key += "|tree"
    folder = cache_root() / "step_cost" if setting == "1" else Path(setting)
    return folder / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


class SpecPlugDrafter(DrafterState):
    def __init__(self, vllm_config: Any) -> None:
        from . import install_tree_patches, install_worker_patches

        plugin = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if plugin is None:
            raise RuntimeError(
                "vllm_specplug's drafter was selected without its configuration; select a "
                "method by name, e.g. --speculative-config '{\"method\": \"sam\"}', instead of "
                "naming the drafter class in speculative_config['model']")
        from ... import __version__

        configured = plugin.get("version")
        if configured is not None and configured != __version__:
            raise RuntimeError(
                f"vllm-specplug version mismatch: the engine was configured by vllm-specplug "
                f"{configured}, but this worker (host {platform.node()}) has {__version__}; "
                f"install the same vllm-specplug version on every node")
        self.plugin = plugin
        self.vllm_config = vllm_config
        self.method = plugin["method"]
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.proposer = build_proposer(plugin)
        # the method's numba kernels compile (or load from the cache) now, at
        # engine start, not in the first requests (vllm_specplug.warmup)
        self.warmup_seconds = warm_up(plugin)
        # glibc's free memory given back while serving (vllm_specplug.malloc_trim)
        self.malloc_trim = malloc_trim.from_env()
        # The acceptance rule for temperature > 0 (None: lossless rejection
        # sampling; chains then go through vLLM's own rejection sampler).
        # Any other rule sees chains too: they are verified on the tree path.
        self.scorer = None
        if plugin.get("acceptance"):
            from ...scorers.registry import build_scorer

            self.scorer = build_scorer(plugin["acceptance"])
        self.route_chains = self.scorer is not None
        # req_id -> all the drafter keeps for the request, one record each
        # (request_state: created when it is scheduled, freed when it
        # finishes); ``trees`` (what the tree runtime reads) and the budgets'
        # per-request entries (calibration, backoff) are its fields
        self.requests = RequestRecords()
        self.trees = FieldView(self.requests, "tree")
        # which requests share cross-request memory (tenancy, docs/security.md):
        # the mode, and whether a scheduler output was seen (salts recorded)
        self.isolation = plugin.get(ISOLATION_KEY, "salt")
        self._scheduled = False
        # the rows, budgets and shared faults of the step (StepBudget)
        self.budget = StepBudget()
        # The model runner (set by the runner patch each step), for proposers
        # that read the runner's block table and KV cache (del).
        self.runner = None
        self.target_model = None
        # the object a target-driving proposer drafts through (del, eagle2)
        self.target_hook = None
        # faults contained (see the module doc): counts, and the requests
        # decoding without drafts after a fault
        self.containment = faults.Containment(self.method)
        # the proposer hook being called (named in the fault's log line)
        self._hook = ""
        # batch-aware budget steps and the draft nodes they proposed and kept
        # (and draft nodes dropped because they lie past the request's max_tokens)
        self.batch_stats = {"steps": 0, "disabled_steps": 0, "nodes_proposed": 0,
                            "nodes_kept": 0, "nodes_explored": 0, "nodes_past_max_tokens": 0}
        # the drafter's own time (proposing, budgets, rank agreement): calls,
        # batch rows and seconds, so its overhead can be set against steps
        self.propose_time = {"calls": 0, "rows": 0, "seconds": 0.0, "draft_tokens": 0}
        # accepted against expected tokens of the drafts kept in batch steps
        self.calibration = AcceptanceCalibration(FieldView(self.requests, "expected"))
        self.exploration = ExplorationYield(FieldView(self.requests, "explored"))
        # whether the batch drains (nothing waits; finished slots not
        # refilled), and what a row's accepted token is worth then
        self.drain = DrainValuation()
        # Target top-k of the step just verified (set by the _sample patch):
        # req_id -> TargetTopK, consumed by the next propose().
        self.target_topk_k = (int(self.proposer.target_topk_k)
                              if self.proposer.wants_target_topk else 0)
        self.pending_topk: dict = {}
        # This engine's tree step state; its attention layers are bound to it
        # in load_model (no module-level state: two engines never share one).
        self.step = StepTrees()
        # Step cost against tokens verified, from consecutive decode steps.
        self._cost_cache = step_cost_cache_path(
            vllm_config, tree=bool(self.proposer.drafts_trees or self.route_chains))
        cached = load_prior(self._cost_cache) if self._cost_cache else None
        self.step_cost = cached or StepCostModel()
        self.step_cost_from_cache = cached is not None
        # measured goodput cuts drafts that do not pay, engine-wide and per
        # request (vllm_specplug.goodput); per-request caps from extra_args
        on = plugin.get("goodput", "off") == "on"
        self.goodput = GoodputController(enabled=on)
        self.backoff = RequestBackoff(enabled=on, rows=FieldView(self.requests, "backoff"))
        # True: tensor parallel, group looked up at the first step; None: one rank.
        self._tp = True if vllm_config.parallel_config.tensor_parallel_size > 1 else None
        self.faults = None
        self.inject_faults(os.environ.get(faults.ENV, ""))
        install_worker_patches()
        if self.proposer.drafts_trees or self.route_chains:
            install_tree_patches(vllm_config)

    def inject_faults(self, spec: str) -> None:
        """Arm fault injection (``vllm_specplug.faults``): at construction
        from ``VLLM_SPECPLUG_INJECT_FAULT``; tests may arm more later (through
        ``collective_rpc``), calls then counted from the arming."""
        injector = faults.Injector([s for s in faults.parse(spec)
                                    if s.method in ("*", self.method)])
        if not injector.hooks:
            return
        self.faults = injector
        injector.arm_proposer(self.proposer)
        injector.wrap(self, "_time_step", "step_cost")
        injector.wrap(self, "_fit_to_batch", "budget")
        if self.target_hook is not None:
            injector.arm_target_hook(self.target_hook)

    # vLLM's CPU runner calls this unconditionally; model-free methods ignore it.
    def load_model(self, target_model: Any) -> None:
        self.target_model = target_model
        self.warm_up_gemms(target_model)
        if self.proposer.drafts_trees or self.route_chains:
            # the model's layers exist now; every decoder attention layer must
            # be ours (else refused here, before any request)
            from vllm.v1.attention.backend import AttentionType

            bind_tree_layers(self.vllm_config.compilation_config.static_forward_context,
                             self.step, AttentionType.DECODER)
        # A proposer that runs the target (e.g. del) names an adapter factory
        # ("module:function"); its hook object is bound here, at engine start.
        factory = self.proposer.target_hook
        if factory:
            import importlib

            module, _, attr = factory.partition(":")
            hook = getattr(importlib.import_module(module), attr)(self, target_model)
            self.proposer.bind_target(hook)
            self.target_hook = hook
            if self.faults is not None:
                self.faults.arm_target_hook(hook)

    def warm_up_gemms(self, target_model: Any) -> None:
        """On CPU, vLLM's GEMM primitives for every row count a verify step of
        this method can have are built now, not in the first requests
        (``cpu_warmup``); a failure costs latency only, so it is logged."""
        if not warmup_enabled():
            return
        from .cpu_warmup import token_counts, warm_cpu_gemms

        try:
            layers, seconds = warm_cpu_gemms(target_model, self.vllm_config.model_config.dtype,
                                             token_counts(self.k))
        except Exception:  # noqa: BLE001 - latency only, never the engine
            logger.warning("vllm_specplug: warming the CPU GEMM kernels failed; the first "
                           "requests may build them", exc_info=True)
            return
        if layers:
            logger.info("vllm_specplug: CPU GEMM kernels of %d layers warmed for %d row counts "
                        "in %.2f s", layers, len(token_counts(self.k)), seconds)

    def begin_step(self, req_ids: Sequence[str], scheduler_output: Any,
                   hidden_states: Any = None, sampled_token_ids: Any = None,
                   aux_hidden_states: Any = None) -> None:
        """Called by the runner patch before vLLM asks for drafts: the batch's
        request ids by row and, for hooks that read them (eagle2), the
        target's hidden states of this step."""
        self.budget.row_req_ids = req_ids
        if self.target_hook is not None and isinstance(sampled_token_ids, list):
            try:
                self.target_hook.begin_step(self.runner, hidden_states, sampled_token_ids, req_ids,
                        scheduler_output, aux_hidden_states=aux_hidden_states)
            except Exception as e:  # noqa: BLE001 - a shared step: no drafts this step
                self.containment.shared_fault("target_begin_step", e)
                self.budget.fault = True

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec,
                token_ids_cpu, slot_mappings: Any = None) -> list[list[int]]:
        req_ids = self.budget.row_req_ids
        if req_ids is None:
            raise RuntimeError(
                "vllm_specplug: the runner patch GPUModelRunner.propose_draft_token_ids was "
                "not applied; is the installed vLLM supported?")
        self.budget.row_req_ids = None
        started = time.perf_counter()
        pending, self.pending_topk = self.pending_topk, {}
        step_fault, self.budget.fault = self.budget.fault, False
        decoding = sum(1 for s in sampled_token_ids if s)
        try:
            self._time_step(req_ids, sampled_token_ids)
            # a row's own trade-off: its tokens against its share of the step
            self.proposer.relative_token_cost = self.step_cost.row_token_cost(decoding)
        except Exception as e:  # noqa: BLE001 - a shared step: no drafts this step
            self.containment.shared_fault("step_cost", e)
            self.budget.last = None
            step_fault = True
        # at disable_by_batch_size decoding rows or more nothing is drafted:
        # proposers only follow their requests' tokens this step (so after a
        # fault in a shared part of the step)
        limit = self.plugin.get("disable_by_batch_size")
        disabled = limit is not None and decoding >= limit
        if disabled:
            self.batch_stats["disabled_steps"] += 1
        disabled = disabled or step_fault
        proposed: list[Draft] = []
        live = set()
        for row, sampled in enumerate(sampled_token_ids):
            req_id = req_ids[row]
            live.add(req_id)
            # partial prefill or discarded row; a request that faulted
            if not sampled or req_id in self.containment:
                proposed.append(Draft.empty())
                continue
            try:
                self._hook = "adapter"
                left = self._tokens_left(req_id, int(num_tokens_no_spec[row]))
                proposed.append(self._propose_row(req_id, row, int(num_tokens_no_spec[row]),
                                                  token_ids_cpu, pending.get(req_id),
                                                  draft=not disabled, left=left))
            except Exception as e:  # noqa: BLE001 - one request's fault stays its own
                self._request_fault(req_id, e)
                proposed.append(Draft.empty())
        for req_id in [r for r in self.requests.running() if r not in live]:
            self.requests.preempt(req_id, MAX_PREEMPTED)
            self._forget(req_id)
        self.budget.req_ids = req_ids
        try:
            proposed = self._fit_to_batch(proposed, decoding, num_tokens_no_spec)
            proposed = self._goodput_caps(req_ids, sampled_token_ids, proposed)
        except Exception as e:  # noqa: BLE001 - a shared step: no drafts this step
            self.containment.shared_fault("budget", e)
            proposed = [self._cut(req_ids[row], d, Draft.empty()) if len(d) else d
                        for row, d in enumerate(proposed)]
        drafts: list[list[int]] = []
        for row, draft in enumerate(proposed):
            self._remember_tree(req_ids[row], draft)
            drafts.append(draft.tokens.tolist())
        drafts = self._agree_across_ranks(req_ids[: len(drafts)], drafts)
        if self.budget.last is not None:
            self.budget.last = (self.budget.last[0], sum(len(d) for d in drafts),
                                self.budget.last[2])
        self.propose_time["calls"] += 1
        self.propose_time["rows"] += len(sampled_token_ids)
        self.propose_time["draft_tokens"] += sum(len(d) for d in drafts)
        self.propose_time["seconds"] += time.perf_counter() - started
        stats_export.maybe_write(self)  # VLLM_SPECPLUG_STATS_FILE, see stats_export
        return drafts

    def _agree_across_ranks(self, req_ids: Sequence[str], drafts: list[list[int]]):
        """Under tensor parallelism every rank runs its own drafter, but what
        a proposer drafts may depend on per-rank measurements (step timings
        behind ``"auto"`` budgets) or on a per-rank failure. The scheduler
        verifies rank 0's drafts on every rank, so every rank adopts rank 0's
        drafts and trees for this step (one small broadcast per step)."""
        if self._tp is None:
            return drafts
        if self._tp is True:
            from vllm.distributed import get_tp_group

            self._tp = get_tp_group()
        mine = None
        if self._tp.rank_in_group == 0:
            mine = (drafts, {r: (self.trees[r].tokens.tolist(), self.trees[r].parents.tolist())
                             for r in req_ids if r in self.trees})
        drafts, trees = self._tp.broadcast_object(mine, src=0)
        for r in req_ids:
            if r in trees:
                tokens, parents = trees[r]
                self.trees[r] = Draft(tokens, parents)
            else:
                self.trees.pop(r, None)
        return drafts

    def _time_step(self, req_ids: Sequence[str], sampled_token_ids) -> None:
        """Feed the step cost model: the time since the last call is one step
        that verified (rows + drafts proposed last call) tokens, when both
        calls saw the same requests, all decoding."""
        now = time.perf_counter()
        key = tuple(req_ids[: len(sampled_token_ids)])
        decoding = all(sampled_token_ids)
        last = self.budget.last
        if decoding and last is not None and last[0] == key:
            self.step_cost.add(len(key) + last[1], now - last[2], rows=len(key))
            if self.goodput.enabled:
                # the step's committed tokens per second against a step
                # without drafts at these rows (what plain decoding would do)
                a, b = self.step_cost.fit(len(key))
                committed = sum(len(s) for s in sampled_token_ids[: len(key)])
                self.goodput.record(
                    committed / len(key) * (a + b * len(key)) / (now - last[2]), now - last[2])
            if self._cost_cache and self.step_cost.samples % SAVE_EVERY == 0:
                try:
                    save_fit(self.step_cost, self._cost_cache)
                except OSError as e:
                    logger.warning("vllm_specplug: cannot cache the step cost in %s: %s",
                                   self._cost_cache, e)
                    self._cost_cache = None
        self.budget.last = (key, 0, now) if decoding else None

    def _propose_row(self, req_id: str, row: int, n: int, token_ids_cpu,
                     topk=None, draft: bool = True, left: int | None = None) -> Draft:
        """The proposer follows the row's newly committed tokens (or starts
        the request), then drafts (when ``draft``), within max_tokens
        (``left``, ``_tokens_left``; None: no bound). The caller has set
        ``_hook`` to "adapter"."""
        rec = self.requests.get(req_id)
        seen = None if rec is None else rec.seen
        if (seen is not None and seen[0] <= n
                and int(token_ids_cpu[row, seen[0] - 1]) == seen[1]):
            if n > seen[0]:  # the last step committed n - seen[0] tokens (one not drafted)
                rec.committed += n - seen[0]
                rec.steps += 1
                self.calibration.settle(req_id, n - seen[0] - 1)
                self.exploration.settle(req_id, n - seen[0] - 1)
                self.backoff.settle(req_id, n - seen[0] - 1)
            if n > seen[0] or topk is not None:
                self._hook = "observe"
                self.proposer.observe(req_id, token_ids_cpu[row, seen[0]:n].tolist(), topk)
        else:
            self.calibration.forget(req_id)
            self.exploration.forget(req_id)
            if seen is not None:
                self._hook = "finish"
                self.proposer.finish(req_id)
            self._hook = "start"
            rec = self.requests.record(req_id)
            info = tenancy.request_info_of(self.runner, req_id, self.isolation,
                                           self._scheduled, rec.salt)
            if self.runner is not None:   # only what its user receives may be stored
                info = replace(info, output_end=OutputEnd.of(
                    self.runner.requests[req_id].sampling_params))
            rec.cap = tenancy.draft_cap(self.runner, req_id)
            rec.preempted = False
            rec.committed = rec.steps = 0
            start_request(self.proposer, req_id, token_ids_cpu[row, :n].tolist(), info)
            if topk is not None:
                self._hook = "observe"
                self.proposer.observe(req_id, [], topk)
        self.requests.started(req_id, (n, int(token_ids_cpu[row, n - 1])))
        if not draft:
            return Draft.empty()
        self._hook = "propose"
        draft = self.proposer.propose(req_id, self.k)
        self._hook = "adapter"
        if len(draft) > self.k:  # a prefix of a topological order keeps parents
            draft = subset(draft, np.arange(len(draft)) < self.k)
        if len(draft):
            room = self.k if left is None else left
            if room < self.k:
                # a chain keeps its first ``room`` tokens, a tree its nodes at
                # depth <= room (ancestors are shallower: it stays a tree)
                keep = (np.arange(len(draft)) < room if draft.is_chain
                        else depths(draft.parent_array()) <= room)
                if not keep.all():
                    kept = subset(draft, keep)
                    self._hook = "draft_cut"
                    self.proposer.draft_cut(req_id, kept)
                    self.batch_stats["nodes_past_max_tokens"] += len(draft) - len(kept)
                    draft = kept
        return draft

    def _tokens_left(self, req_id: str, n: int) -> int | None:
        """How many more tokens the request may commit after this step's
        own, ``max_tokens - generated - 1``: the deepest draft position that
        can still be committed (a request with ``max_tokens`` m and g tokens
        generated commits at most m - g more, the last of them the step's
        own bonus or recovered token). None without a bound (or without vLLM's runner: unit
        tests). vLLM's scheduler caps drafts at max_model_len, not at
        max_tokens, so without this cut the last step of a well-predicted
        request verifies (and counts as accepted) tokens the output then
        drops."""
        if self.runner is None:
            return None
        state = self.runner.requests[req_id]
        params = state.sampling_params
        if params is None or params.max_tokens is None:
            return None
        return max(params.max_tokens - (n - state.num_prompt_tokens) - 1, 0)

    def _steps_left(self, req_id: str, n: int) -> float:
        """The request's expected steps left: its tokens left over its tokens
        a step so far (inf without a bound)."""
        left = self._tokens_left(req_id, n)
        if left is None:
            return float("inf")
        rec = self.requests.get(req_id)
        pace = 1.0 if rec is None else (rec.committed + 1) / (rec.steps + 1)
        return (left + 1) / pace

    def _fit_to_batch(self, drafts: list[Draft], decoding: int, num_tokens) -> list[Draft]:
        """Batch-aware budgets (``disable_by_batch_size`` is applied before
        proposing, in ``propose``): with ``batch_budget`` "auto" and two or
        more decoding requests, the batch's nodes are shared out by expected
        tokens per second (``budget.allocate_batch``), or, in a draining
        batch, by what each row's tokens save (``DrainValuation``; every row
        counts, a partial prefill too: it finishes late). ``num_tokens``:
        each row's tokens so far (the runner's ``num_tokens_no_spec``)."""
        proposed = sum(len(d) for d in drafts)
        if not proposed:   # nothing drafted (disable_by_batch_size: see propose)
            return drafts
        stats = self.batch_stats
        mode = self.plugin.get("batch_budget", "auto")
        if mode == "off" or decoding < 2:
            return drafts
        a, b = self.step_cost.fit(decoding)
        # nodes EXPLORE_SHARE of this step's time buys (a unitless count, so
        # the carried credit survives the cost fit's change of scale), scaled
        # by what exploring has been buying (the first node's bar: the least
        # a node must be worth)
        bar = decoding * b / (a + b * decoding) if b > 0 else 0.0
        self.budget.explore_bar = bar
        share = (EXPLORE_SHARE * self.exploration.factor(bar) * (a / b + decoding)
                 if b > 0 else float(proposed))
        self.budget.explore_nodes = min(self.budget.explore_nodes + share, EXPLORE_CARRY * share)
        req_ids = self.budget.req_ids
        values = None
        if self.plugin.get("batch_drain", "auto") == "auto" and self.drain.draining:
            c0, c_row, _ = self.step_cost.coefficients()
            remaining = [self._steps_left(r, int(num_tokens[row]))
                         for row, r in enumerate(req_ids[: len(drafts)])]
            values = self.drain.values(float(c0), float(c_row), remaining)
            self.drain.drain_steps += 1
        masks: list = []
        out, explored = allocate_batch_exploring(drafts, a, b, decoding,
                                                 scale=self.calibration.ratio,
                                                 explore=int(self.budget.explore_nodes),
                                                 explored_masks=masks, row_values=values)
        self.budget.explore_nodes -= explored
        stats["steps"] += 1
        stats["nodes_explored"] += explored
        for row, (before, after) in enumerate(zip(drafts, out)):
            if len(after) < len(before):
                out[row] = after = self._cut(req_ids[row], before, after)
            if len(after) and after.scores is not None:
                self.calibration.expect(req_ids[row], expected_accepted(after))
            self._expect_explored(req_ids[row], after, masks[row])
        kept = sum(len(d) for d in out)
        stats["nodes_proposed"] += proposed
        stats["nodes_kept"] += kept
        return out

    def _expect_explored(self, req_id: str, draft: Draft, explored) -> None:
        """Tell ``exploration`` how deep a row's kept draft reaches on its
        merit and with its explored nodes (``explored``: a mask over the
        draft's nodes; a draft the proposer's ``draft_cut`` emptied has none)."""
        if len(explored) != len(draft) or not explored.any():
            self.exploration.forget(req_id)
            return
        d = depths(draft.parent_array())
        merit = int(d[~explored].max()) if (~explored).any() else 0
        self.exploration.expect(req_id, merit, int(d[explored].max()), int(explored.sum()))

    def _goodput_caps(self, req_ids: Sequence[str], sampled_token_ids,
                      proposed: list[Draft]) -> list[Draft]:
        """Each decoding row's draft cut to what the goodput controller's
        level, the request's backoff and its own ``specplug_max_draft``
        allow (a prefix of the nodes: parents come first, so it is a tree).
        With the controller off and no request's own cap (the default)
        nothing is cut, so the per-row loop is skipped."""
        if not self.goodput.enabled and not self.requests.any("cap"):
            return proposed
        scale = self.goodput.scale
        out = []
        for row, d in enumerate(proposed):
            req_id = req_ids[row]
            if not sampled_token_ids[row] or req_id in self.containment:
                out.append(d)
                continue
            n = len(d)
            cap = self.backoff.cap(req_id, self.goodput.cap(n, scale))
            rec = self.requests.get(req_id)
            if rec is not None and rec.cap is not None:
                cap = min(cap, rec.cap)
            if cap < n:
                d = self._cut(req_id, d, subset(d, np.arange(n) < cap))
            self.backoff.drafted(req_id, len(d))
            out.append(d)
        return out

    def _cut(self, req_id: str, draft: Draft, kept: Draft) -> Draft:
        """``kept`` of ``draft``, the proposer told (``draft_cut``); no draft
        when that raises (the request's fault)."""
        try:
            self._hook = "draft_cut"
            self.proposer.draft_cut(req_id, kept)
            return kept
        except Exception as e:  # noqa: BLE001 - one request's fault stays its own
            self._request_fault(req_id, e)
            return Draft.empty()

    def _remember_tree(self, req_id: str, draft: Draft) -> None:
        if len(draft) and (self.route_chains or not draft.is_chain):
            self.trees[req_id] = Draft(draft.tokens, draft.parent_array())
        else:
            self.trees.pop(req_id, None)

    def note_scheduler_output(self, scheduler_output: Any) -> None:
        """Called by the runner patch at the start of every step: keep the
        ``cache_salt`` of the step's new requests (``tenancy``)."""
        if scheduler_output is not None:   # None: driven without vLLM's scheduler (unit tests)
            self._scheduled = True
            new = tenancy.new_request_salts(scheduler_output)
            # before the new requests' records: the requests that ran
            running = self.requests.running()
            finished = scheduler_output.finished_req_ids
            done = sum(1 for r in running if r in finished)
            self.drain.note_step(waiting_of(scheduler_output), len(new), done,
                                 len(running) - done)
            for req_id, salt in new:
                self.requests.record(req_id).salt = salt
        # a step that schedules nothing: vLLM runs one to free the last
        # finished requests; every rank sees the same scheduler output
        self.budget.idle = (scheduler_output is not None
                            and scheduler_output.total_num_scheduled_tokens == 0)

    def after_update_states(self) -> None:
        """Called by the runner patch once ``_update_states`` has freed the
        step's finished requests. In a step that schedules nothing, glibc's
        free memory goes back (``malloc_trim``): never inside a step that
        runs the model, and on every rank in the same step (issue 45 item 4)."""
        if self.budget.idle:
            self.budget.idle = False
            self.malloc_trim.maybe()

    def finish_request(self, req_id: str) -> None:
        """The request finished or was aborted (runner hook; preempted requests
        only leave the batch and are freed by ``_forget``): its record goes,
        whole, then the proposer completes (and finishes) it."""
        rec = self.requests.pop(req_id, None)
        if self.containment.finished(req_id):
            # its state was freed at the fault; complete() lets the proposer
            # drop what it keeps past a finish (sam: the prompt length)
            try:
                self.proposer.complete(req_id)
            except Exception:  # noqa: BLE001 - the request's fault was counted
                logger.debug("vllm_specplug: %s's complete raised for request %s after "
                             "its fault", self.method, req_id, exc_info=True)
            return
        if rec is None:
            return
        if rec.preempted and rec.seen is None:
            # freed when it left the batch, now finished or aborted: the
            # proposer drops what it kept over the preemption (sam: the
            # prompt length)
            self._complete(req_id)
            return
        if rec.seen is not None and self._complete(req_id):
            self._forget(req_id, finished=True)

    def _complete(self, req_id: str) -> bool:
        """``proposer.complete``; False when it raised (the request's fault,
        its state freed)."""
        try:
            self._hook = "complete"
            self.proposer.complete(req_id)
            return True
        except Exception as e:  # noqa: BLE001 - one request's fault stays its own
            self._request_fault(req_id, e, finished=True)
            return False

    def _forget(self, req_id: str, finished: bool = False) -> None:
        """It left the batch (preempted; ``finished``: it finished): its
        running state goes (``RequestRecord.leave``), then the proposer's
        (``finish``); its record stays until it finishes."""
        self.requests.leave(req_id)
        try:
            self._hook = "finish"
            self.proposer.finish(req_id)
        except Exception as e:  # noqa: BLE001 - one request's fault stays its own
            self._request_fault(req_id, e, finished=finished)
        stats_export.maybe_write(self, freed=True)

    # ------------------------------------------------------------------ faults
    def _request_fault(self, req_id: str, error: BaseException,
                       finished: bool = False) -> None:
        """A proposer hook raised for ``req_id``: it decodes without drafts
        from now on (``finished``: it just finished), its state is freed (a
        ``finish`` that raises is not called again); logged once, counted."""
        hook, self._hook = self._hook or "adapter", ""
        self.containment.request_fault(req_id, hook, error, finished)
        self.requests.leave(req_id)
        if hook != "finish":
            try:
                self.proposer.finish(req_id)
            except Exception:  # noqa: BLE001 - counted once, above
                logger.debug("vllm_specplug: %s's finish also raised for request %s",
                             self.method, req_id, exc_info=True)

    # ------------------------------------------------------------ introspection
    def stats(self) -> dict[str, int]:
        c0, c_row, c_draft = (float(v) for v in self.step_cost.coefficients())
        out = {"active_requests": self.proposer.active_requests(),
               "state_bytes": self.proposer.state_nbytes(),
               "errors": self.containment.errors, "trees_held": len(self.trees),
               "faults": self.containment.stats(),
               "batch_budget": dict(self.batch_stats), "drain": self.drain.stats(),
               "propose_time": dict(self.propose_time),
               "goodput": self.goodput.stats(), "backoff": self.backoff.stats(),
               "calibration": self.calibration.stats(),
               "exploration": self.exploration.stats(self.budget.explore_bar),
               "step_cost": {"samples": self.step_cost.samples, "c0_s": c0,
                             "row_s": c_row, "draft_s": c_draft,
                             "from_cache": self.step_cost_from_cache,
                             "cache_dropped": self.step_cost.prior_dropped,
                             "steering": self.step_cost.steering,
                             "relative_token_cost":
                             float(self.step_cost.relative_token_cost(1))}}
        out["proposer"] = self.proposer.debug_stats()
        # entries of each structure that grows with traffic (docs/architecture.md, "Bounds")
        # (the drafter's own: fields of its request records, request_state)
        count = self.requests.count
        out["sizes"] = {"drafter_requests": count("seen"), "drafter_trees": count("tree"),
                        "drafter_salts": count("salt"),
                        "drafter_preempted": count("preempted"),
                        "backoff_requests": count("backoff"),
                        "request_caps": count("cap"),
                        "calibration_pending": count("expected"),
                        "exploration_pending": count("explored"),
                        "drain_open": len(self.drain.open),
                        "pending_topk": len(self.pending_topk),
                        **self.proposer.structure_sizes()}
        out["malloc_trim"] = self.malloc_trim.stats()
        if self.proposer.drafts_trees or self.route_chains:
            out["tree"] = dict(self.step.stats)
        return out
