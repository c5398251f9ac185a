"""Early-exit drafting with the loaded target's own layers (DEL), worker side.

:class:`EarlyExitRunner` implements ``proposers.early_exit.ExitDraftHook``
on a vLLM Llama or Qwen2 model: it runs the first ``L`` decoder layers
eagerly, module by module (never the compiled ``model.model.forward``),
with the target's weights (no copy), then the final norm and
``compute_logits``, one token at a time, greedy.

KV. vLLM's paged cache is never written: the draft must leave it exactly as
plain decoding would. For each layer < L the committed context's keys and
values are gathered from the request's blocks (``cpu_kv.gather`` /
``cuda_kv.gather``: positions 0..P-1 hold exactly what plain decoding
computed, and layer l's KV depends only on layers < l, so the truncated
model's KV for the context is the same), and the draft tokens' own keys and
values are kept in temporary tensors for the next draft token. The last
committed token (position P, the bonus token) is not in the cache yet: it is
the first input of the draft. Attention is plain matmul + softmax over
grouped-query heads (one query token at a time: no mask needed).

Why not LayerSkip's cache sharing (verification reusing the draft's KV for
layers < L)? vLLM computes every layer in one compiled forward over the
scheduled tokens; skipping the first L layers for draft rows would need a
second model forward path and rewriting vLLM's attention metadata. The
draft's context reads cost little next to the layers' weights.

Under tensor parallelism every rank runs the same drafting in lockstep: the
linear layers all-reduce, ``compute_logits`` all-gathers (vLLM's default),
so every rank sees the same logits and the controller, which depends only
on committed tokens and these logits, takes the same decisions (no timings).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import numpy as np
import torch

from ...options import SpecPlugConfigError
from ...proposers.base import TargetHook
from ...proposers.early_exit import SUPPORTED_ARCHITECTURES, ExitDraft, unsupported_message

logger = logging.getLogger("vllm_specplug")


class EarlyExitRunner(TargetHook):
    """Drafts from the first ``L`` layers of a loaded vLLM model."""

    def __init__(self, drafter: Any, model: Any) -> None:
        arch = type(model).__name__
        if arch not in SUPPORTED_ARCHITECTURES:
            raise SpecPlugConfigError(unsupported_message(arch))
        # the module layout is probed: a missing piece is refused, naming it
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if layers is None or not hasattr(inner, "norm") or not hasattr(model, "compute_logits"):
            raise SpecPlugConfigError(unsupported_message(arch + " (unexpected module layout)"))
        start, end = inner.start_layer, inner.end_layer
        if start != 0 or end != len(layers):
            raise SpecPlugConfigError(
                "speculative method 'del' needs every decoder layer in this worker; pipeline "
                "parallelism is not supported")
        for i, layer in enumerate(layers):
            attn = getattr(layer, "self_attn", None)
            missing = [n for n in ("input_layernorm", "post_attention_layernorm", "mlp")
                       if not hasattr(layer, n)]
            missing += [f"self_attn.{n}" for n in ("qkv_proj", "o_proj", "rotary_emb", "attn")
                        if not hasattr(attn, n)]
            if missing:
                raise SpecPlugConfigError(unsupported_message(
                    f"{arch} (layer {i} has no {', '.join(missing)})"))
            window = attn.attn.sliding_window
            if window not in (None, -1, 0):
                raise SpecPlugConfigError(
                    f"speculative method 'del' does not support sliding-window attention "
                    f"(layer {i}: window {window})")
        self.drafter = drafter
        self.model = model
        self.inner = inner
        self.layers = list(layers)
        self.num_layers = len(self.layers)
        self.head_cost = _head_cost(model, self.layers[0])
        #: recent drafts (dicts: context tokens, exit layer, tokens, shadows),
        #: for tests; None: not recorded
        self.recent: list | None = None
        self._slots: torch.Tensor | None = None
        # cost counters (reported in the drafter's stats; not used to decide,
        # so tensor-parallel ranks cannot diverge)
        self.counts = {"passes": 0, "layer_forwards": 0, "head_calls": 0, "head_rows": 0,
                       "draft_seconds": 0.0}

    # ------------------------------------------------------------------ runner
    def _request_slots(self, req_id: str, position: int) -> torch.Tensor:
        """Cache slots of positions 0..position-1 of a request."""
        runner = self.drafter.runner
        if runner is None:
            raise RuntimeError("vllm_specplug del: the drafter has no model runner yet")
        batch = runner.input_batch
        row = batch.req_id_to_index[req_id]
        n = int(batch.num_tokens_no_spec[row])
        if n != position + 1:
            raise RuntimeError(
                f"vllm_specplug del: request {req_id} has {n} tokens in the runner, the "
                f"proposer expected {position + 1}")
        table = batch.block_table[0]
        bs = int(table.block_size)
        pos = np.arange(position, dtype=np.int64)
        blocks = table.block_table.np[row][pos // bs].astype(np.int64)
        return torch.from_numpy(blocks * bs + pos % bs)

    def _kv_caches(self) -> list:
        caches = self.drafter.runner.kv_caches
        if len(caches) != self.num_layers:
            raise RuntimeError(
                f"vllm_specplug del: {len(caches)} KV caches for {self.num_layers} layers")
        return caches

    # ------------------------------------------------------------------ layers
    def _attention(self, layer_idx: int, attn: Any, positions: torch.Tensor,
                   h: torch.Tensor, ctx: dict, draft_kv: dict) -> torch.Tensor:
        qkv, _ = attn.qkv_proj(h)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        hq, hkv = attn.num_heads, attn.num_kv_heads
        d = attn.head_dim
        # Qwen2Attention sets qk_norm (per-head norm before RoPE); LlamaAttention
        # has no such attribute and no such norm (tests/test_adapter_targets.py
        # checks that Qwen2Attention still has it)
        if getattr(attn, "qk_norm", False):
            q = attn.q_norm(q.reshape(-1, hq, d)).reshape(-1, hq * d)
            k = attn.k_norm(k.reshape(-1, hkv, d)).reshape(-1, hkv * d)
        q, k = attn.rotary_emb(positions, q.contiguous(), k.contiguous())
        k = k.reshape(1, hkv, d)
        v = v.reshape(1, hkv, d).contiguous()
        own = draft_kv.setdefault(layer_idx, ([], []))
        own[0].append(k)
        own[1].append(v)
        if layer_idx not in ctx:
            ctx[layer_idx] = self._gather(layer_idx)
        ck, cv = ctx[layer_idx]
        keys = torch.cat([ck.to(k.dtype), *own[0]], dim=0)     # [S, Hkv, D]
        vals = torch.cat([cv.to(v.dtype), *own[1]], dim=0)
        g = hq // hkv
        qh = q.reshape(hkv, g, d)                                # q head j*g+i -> kv head j
        scores = torch.matmul(qh, keys.permute(1, 2, 0)) * attn.scaling   # [Hkv, G, S]
        probs = torch.softmax(scores.float(), dim=-1).to(vals.dtype)
        out = torch.matmul(probs, vals.transpose(0, 1))          # [Hkv, G, D]
        o, _ = attn.o_proj(out.reshape(1, hq * d))
        return o

    def _gather(self, layer_idx: int):
        from .tree_runtime import kv_module

        kv = self._kv_caches()[layer_idx]
        if self._slots.numel() == 0:
            shape = (0, kv.shape[1], kv.shape[3] // 2)
            empty = torch.empty(shape, dtype=kv.dtype, device=kv.device)
            return empty, empty
        return kv_module(kv).gather(kv, self._slots.to(kv.device))

    def _layer(self, i: int, positions, x, residual, ctx, draft_kv):
        layer = self.layers[i]
        if residual is None:
            residual = x
            h = layer.input_layernorm(x)
        else:
            h, residual = layer.input_layernorm(x, residual)
        h = self._attention(i, layer.self_attn, positions, h, ctx, draft_kv)
        h, residual = layer.post_attention_layernorm(h, residual)
        h = layer.mlp(h)
        return h, residual

    def _logits(self, states: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(states, dim=0)
        return self.model.compute_logits(self.inner.norm(x)).float()

    def stats(self) -> dict:
        c = dict(self.counts)
        c["draft_seconds"] = round(c["draft_seconds"], 3)
        c["ms_per_pass"] = round(1000 * self.counts["draft_seconds"] / max(1, c["passes"]), 2)
        return c

    # ------------------------------------------------------------------ hook
    @torch.inference_mode()
    def draft(self, req_id: str, token: int, position: int, exit_layer: int,
              max_tokens: int, threshold: float, shadow_layers: Sequence[int]) -> ExitDraft:
        if not 1 <= exit_layer < self.num_layers:
            raise ValueError(f"exit layer {exit_layer} outside 1..{self.num_layers - 1}")
        t0 = time.perf_counter()
        try:
            return self._draft(req_id, token, position, exit_layer, max_tokens, threshold,
                               shadow_layers)
        finally:
            self._slots = None
            self.counts["passes"] += 1
            self.counts["draft_seconds"] += time.perf_counter() - t0

    def _draft(self, req_id, token, position, exit_layer, max_tokens, threshold,
               shadow_layers) -> ExitDraft:
        self._slots = self._request_slots(req_id, position)
        first_kv = self._kv_caches()[0]
        device = first_kv.device
        if first_kv.device.type == "cpu":
            from . import cpu_kv

            isa = self.layers[0].self_attn.attn.isa  # set by vLLM's CPU attention backend
            cpu_kv.check_isa(isa)
        ctx: dict = {}
        draft_kv: dict = {}
        shadow_set = sorted({int(c) for c in shadow_layers if 1 <= int(c) < self.num_layers})
        depth = max([exit_layer, *shadow_set])
        tokens: list[int] = []
        confidences: list[float] = []
        shadows: dict[int, int] = {}
        cur = int(token)
        for step in range(max_tokens):
            pos = torch.tensor([position + step], dtype=torch.long, device=device)
            x = self.inner.embed_tokens(torch.tensor([cur], dtype=torch.long, device=device))
            residual = None
            states: list[torch.Tensor] = []
            names: list[int] = []
            last = depth if step == 0 else exit_layer
            for i in range(last):
                x, residual = self._layer(i, pos, x, residual, ctx, draft_kv)
                n = i + 1
                if n == exit_layer or (step == 0 and n in shadow_set):
                    states.append(x + residual)     # the residual stream after n layers
                    names.append(n)
            logits = self._logits(states)
            self.counts["layer_forwards"] += last
            self.counts["head_calls"] += 1
            self.counts["head_rows"] += len(states)
            ids = torch.argmax(logits, dim=-1).tolist()
            if step == 0:
                shadows = {n: int(t) for n, t in zip(names, ids) if n in shadow_set}
            row = names.index(exit_layer)
            tok = int(ids[row])
            conf = 1.0
            if threshold > 0:
                conf = float(torch.softmax(logits[row], dim=-1)[tok])
                if conf < threshold:
                    break
            tokens.append(tok)
            confidences.append(conf)
            cur = tok
            # layers >= exit_layer of the first pass are not needed again
            for i in range(exit_layer, last):
                draft_kv.pop(i, None)
        if self.recent is not None:
            batch = self.drafter.runner.input_batch
            row = batch.req_id_to_index[req_id]
            context = batch.token_ids_cpu[row, : position + 1].tolist()
            self.recent.append({"req_id": req_id, "context": context, "exit_layer": exit_layer,
                                "tokens": list(tokens), "shadows": dict(shadows),
                                "confidences": list(confidences)})
            del self.recent[:-512]
        return ExitDraft(tokens, shadows, confidences)


def _head_cost(model: Any, layer: Any) -> float:
    """The LM head's weights over one decoder layer's (this rank's shares)."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    weight = model.lm_head.weight
    # vLLM's linear layers know their shard's shape even where the CPU
    # backend repacked their weights (layer.parameters() then holds only the
    # norms: a ratio of ~24,576 instead of ~8 for SmolLM2 was seen)
    layer_params = sum(int(m.input_size_per_partition) * int(m.output_size_per_partition)
                       for m in layer.modules()
                       if isinstance(m, (ColumnParallelLinear, RowParallelLinear)))
    if layer_params == 0:
        layer_params = sum(p.numel() for p in layer.parameters())
    if layer_params == 0:
        return 0.0
    return float(weight.numel()) / float(layer_params)


def make_exit_hook(drafter: Any, target_model: Any) -> EarlyExitRunner:
    """The ``DelProposer.target_hook`` factory (called from ``drafter.load_model``)."""
    runner = EarlyExitRunner(drafter, target_model)
    logger.info("vllm_specplug del: early-exit drafting on %s (%d layers, LM head = %.1f "
                "layers)", type(target_model).__name__, runner.num_layers, runner.head_cost)
    return runner
