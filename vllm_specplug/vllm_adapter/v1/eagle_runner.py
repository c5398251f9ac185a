"""EAGLE head inside vLLM's worker (EAGLE-2 dynamic trees), worker side.

:class:`EagleRunner` implements ``proposers.eagle2.EagleDraftHook``. It
holds the EAGLE-1 head (``vllm_specplug.eagle.head``) and, per request, the
head's own KV cache: dense tensors owned by the plugin, not vLLM's paged
cache (vLLM's CPU attention cannot mask draft trees, and vLLM keeps no draft
KV for ``custom_class`` drafters).

Features. The head reads the target's final hidden states (after its final
norm: what vLLM's model forward returns). Each step the runner patch hands
this step's ``hidden_states`` to :meth:`EagleRunner.begin_step`, which keeps,
per request, the rows at committed positions: every prompt row of a prefill
chunk; for a decode step the last committed token's row and the accepted
draft rows (the accepted tree path, recorded by ``tree_runtime``, or the
first accepted rows of a chain). The head's input at position ``p`` is
``(embed(token[p + 1]), feature[p])``, added once ``token[p + 1]`` is
committed. Prompt positions served from vLLM's prefix cache have no feature
this time: the head's context then lacks them (drafts get worse, output
does not change).

Drafting. :meth:`root` runs the pending inputs through the head (appending
their keys and values to the request's cache) and returns the top-k of the
head's prediction after the last committed token; :meth:`expand` feeds
draft nodes (each with its parent's head output as its feature, position
= last committed feature's position + depth) under an ancestor mask and
returns their top-k children. Draft nodes' keys and values live only until
the next :meth:`root`.

Embedding and LM head. An EAGLE-1 head shares the target's: plain local
copies of the weights are used (gathered once across tensor-parallel ranks
at load time), so the head runs on each rank without collectives: a rank can
never hang waiting for another, and rank 0's drafts are adopted by every
rank (``SpecPlugDrafter._agree_across_ranks``). Its drafts are restricted to
the head folder's draft vocabulary (``draft_vocab.json``, FR-Spec style):
the LM head matmul over 49k tokens was most of a head call on CPU.

EAGLE-3 heads (``eagle.head3``) fuse the target's residual stream at three
auxiliary layers: the runner patch
``GPUModelRunner._setup_eagle3_aux_hidden_state_outputs`` makes the target
return them (``aux_layers``), ``begin_step`` fuses the kept rows, and the
head's own norm and LM head give log-probs over its ``d2t`` draft vocabulary.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ...options import SpecPlugConfigError
from ...proposers.base import TargetHook

logger = logging.getLogger("vllm_specplug")


@dataclass
class _HeadState:
    """One request's head cache and drafting state."""
    k: torch.Tensor                 # [kvh, cap, d]
    v: torch.Tensor
    n: int = 0                      # cached entries
    positions: list = field(default_factory=list)   # position of each cached entry
    last_pos: int = -1              # position of the last cached entry's feature
    last_hidden: torch.Tensor | None = None   # head output of the last cached entry
    # inputs waiting for root(): (next token, feature row, position)
    pend_tokens: list = field(default_factory=list)
    pend_feats: list = field(default_factory=list)
    pend_pos: list = field(default_factory=list)
    # this step's draft nodes fed so far
    d_k: torch.Tensor | None = None
    d_v: torch.Tensor | None = None
    d_hidden: torch.Tensor | None = None
    d_parents: list = field(default_factory=list)
    d_depth: list = field(default_factory=list)

    def nbytes(self) -> int:
        return int(self.k.numel() * self.k.element_size() * 2)


class EagleRunner(TargetHook):
    """Runs an EAGLE head (EAGLE-1 or EAGLE-3) against a loaded vLLM target model."""

    def __init__(self, drafter: Any, model: Any, head_path: str) -> None:
        from ...eagle.loading import load_head

        # the module layout is probed: no embedding is refused, naming it
        inner = getattr(model, "model", None)
        embed = getattr(inner, "embed_tokens", None)
        if embed is None or getattr(embed, "weight", None) is None:
            raise SpecPlugConfigError(
                f"speculative method 'eagle2' needs the target's token embedding "
                f"(model.embed_tokens); {type(model).__name__} has none")
        weight = embed.weight
        self.device = weight.device
        self.dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
        hf = drafter.vllm_config.model_config.hf_text_config
        vocab = int(hf.vocab_size)
        hidden = int(weight.shape[1])
        layers = hf.num_hidden_layers
        self.head, self.config = load_head(head_path, hidden_size=hidden, vocab_size=vocab,
                                           dtype=self.dtype,
                                           num_target_layers=int(layers) if layers else None)
        self.head.to(self.device).eval()
        self.vocab_size = vocab
        #: "eagle1" (target's final hidden states, target's LM head) or "eagle3"
        #: (fused auxiliary layers, the head's own norm/LM head over its
        #: draft vocabulary)
        self.kind = self.head.kind
        #: target layers whose hidden states the head fuses (EAGLE-3), read
        #: by the runner patch ``GPUModelRunner._setup_eagle3_aux_hidden_state_outputs``
        self.aux_layers = tuple(self.head.needs_aux_layers) if self.kind == "eagle3" else None
        emb = _full_vocab(weight)
        lm = model.lm_head
        # a quantized LM head has no plain weight (refused below, naming it)
        lm_weight = getattr(lm, "weight", None)
        tied = lm is embed or lm_weight is weight
        if not tied and (lm_weight is None or lm_weight.dim() != 2
                         or lm_weight.shape[1] != hidden):
            raise SpecPlugConfigError(
                f"speculative method 'eagle2': the target's LM head weight has shape "
                f"{None if lm_weight is None else tuple(lm_weight.shape)}, expected "
                f"[vocab, {hidden}] (quantized or repacked "
                f"LM heads are not supported)")
        self.embed_weight = emb[:vocab]
        # EAGLE-1 heads (eagle/head.py) have no embedding of their own; an
        # EAGLE-3 head's is None unless its folder holds one
        own_embed = getattr(self.head, "embed_tokens", None)
        if own_embed is not None:
            self.embed_weight = own_embed.weight
        self.head_weight = self.embed_weight if tied else _full_vocab(lm_weight)[:vocab]
        # the draft vocabulary (FR-Spec): the LM head restricted to frequent tokens
        from ...eagle.draft_vocab import DraftVocabError, choose_draft_vocab

        setting = int(drafter.plugin["options"].get("draft_vocab", 0))
        try:
            ids = None if self.kind == "eagle3" else choose_draft_vocab(head_path, setting,
                                                                         vocab)
        except DraftVocabError as e:
            raise SpecPlugConfigError(f"speculative_config['draft_vocab']: {e}") from None
        self.draft_ids = None if ids is None else torch.as_tensor(ids, device=self.device)
        self.draft_weight = self.head_weight if ids is None else \
            self.head_weight.index_select(0, self.draft_ids).contiguous()
        self.kvh = int(self.config.num_key_value_heads)
        self.hd = int(self.config.head_dim)
        self.drafter = drafter
        self.states: dict[str, _HeadState] = {}
        #: recent root() calls (context tokens, cached positions, top-k), for
        #: tests; None: not recorded
        self.recent: list | None = None
        self.counts = {"head_calls": 0, "head_rows": 0, "catch_up_rows": 0,
                       "features_kept": 0, "seconds": 0.0}
        # measured seconds of one expand() call (decayed mean), for call_cost
        self._expand_seconds: float | None = None

    @property
    def call_cost(self) -> float:
        """One expand() call's cost relative to a target step (measured)."""
        if self._expand_seconds is None:
            return 0.0
        step = self.drafter.step_cost
        a = float(step.fit()[0]) if step.samples else 0.0
        return self._expand_seconds / a if a > 1e-4 else 0.0

    # ------------------------------------------------------------- features
    def begin_step(self, runner: Any, hidden_states: torch.Tensor | None,
                   sampled_token_ids: list, req_ids: list, scheduler_output: Any,
                   aux_hidden_states: Any = None) -> None:
        """Keep this step's features at committed positions, per request
        (EAGLE-3: the auxiliary layers' hidden states, fused by the head)."""
        paths = self.drafter.step.take_accepted_paths()
        # requests no longer in the batch (finished before drafting, aborted,
        # preempted: a resumed request is recomputed, its features come again)
        live = set(req_ids)
        for gone in [r for r in self.states if r not in live]:
            del self.states[gone]
        if hidden_states is None or not sampled_token_ids:
            return
        qsl = runner.query_start_loc.np
        positions = runner.positions[: int(qsl[len(sampled_token_ids)])].cpu().numpy()
        batch = runner.input_batch
        spec = scheduler_output.scheduled_spec_decode_tokens or {}
        rows_all: list[int] = []
        owners: list[tuple[_HeadState, list[int], list[int]]] = []
        for i, sampled in enumerate(sampled_token_ids):
            req_id = req_ids[i]
            start, end = int(qsl[i]), int(qsl[i + 1])
            if end <= start:
                continue
            n_draft = len(spec.get(req_id, ()))
            root_row = end - n_draft - 1
            rows = list(range(start, root_row + 1))
            if n_draft:
                if req_id in paths:
                    rows += [root_row + 1 + j for j in paths[req_id]]
                elif sampled:
                    rows += list(range(root_row + 1, root_row + len(sampled)))
            n_tokens = int(batch.num_tokens_no_spec[i])
            tokens = batch.token_ids_cpu[i]
            keep_rows, next_tokens = [], []
            for r in rows:
                p = int(positions[r])
                if p + 1 < n_tokens:
                    keep_rows.append(r)
                    next_tokens.append(int(tokens[p + 1]))
            if not keep_rows:
                continue
            state = self.states.get(req_id)
            if state is None:
                state = self.states[req_id] = self._new_state()
            pos = [int(positions[r]) for r in keep_rows]
            owners.append((state, next_tokens, pos))
            rows_all += keep_rows
        if not rows_all:
            return
        index = torch.as_tensor(rows_all, dtype=torch.long, device=hidden_states.device)
        if self.kind == "eagle3":
            if not aux_hidden_states:
                raise RuntimeError("eagle2: the EAGLE-3 head needs the target's auxiliary "
                                   "hidden states, but the runner passed none")
            with torch.inference_mode():
                aux = torch.cat([a.index_select(0, index) for a in aux_hidden_states], dim=-1)
                feats = self.head.fuse(aux.to(self.device, self.dtype))
        else:
            feats = hidden_states.index_select(0, index).to(self.device, self.dtype)
        at = 0
        for state, next_tokens, pos in owners:
            m = len(pos)
            state.pend_tokens += next_tokens
            state.pend_feats.append(feats[at: at + m])
            state.pend_pos += pos
            at += m
        self.counts["features_kept"] += len(rows_all)

    def _new_state(self) -> _HeadState:
        cap = 256
        z = torch.zeros(self.kvh, cap, self.hd, dtype=self.dtype, device=self.device)
        return _HeadState(k=z, v=z.clone())

    # ---------------------------------------------------------------- hook
    @torch.inference_mode()
    def root(self, req_id: str, k: int) -> tuple[np.ndarray, np.ndarray]:
        t0 = time.perf_counter()
        state = self.states.get(req_id)
        empty = (np.zeros(0, np.int32), np.zeros(0, np.float32))
        if state is None:
            return empty
        if state.pend_tokens:
            self._catch_up(state)
        state.d_k = state.d_v = state.d_hidden = None
        state.d_parents, state.d_depth = [], []
        if state.last_hidden is None:
            return empty
        ids, lps = self._topk(state.last_hidden[None], k)
        self.counts["seconds"] += time.perf_counter() - t0
        if self.recent is not None:
            batch = self.drafter.runner.input_batch
            row = batch.req_id_to_index[req_id]
            n_tokens = int(batch.num_tokens_no_spec[row])
            self.recent.append({"req_id": req_id,
                                "context": batch.token_ids_cpu[row, :n_tokens].tolist(),
                                "positions": list(state.positions),
                                "ids": ids[0].tolist(), "logprobs": lps[0].tolist()})
            del self.recent[:-256]
        return ids[0], lps[0]

    @torch.inference_mode()
    def expand(self, req_id: str, tokens: np.ndarray, parents: np.ndarray, k: int
               ) -> tuple[np.ndarray, np.ndarray]:
        t0 = time.perf_counter()
        state = self.states[req_id]
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        parents = np.asarray(parents, dtype=np.int64).reshape(-1)
        m = tokens.size
        fed = len(state.d_parents)
        if m == 0:
            return np.zeros((0, k), np.int32), np.zeros((0, k), np.float32)
        if state.last_hidden is None:
            raise RuntimeError(f"eagle2: expand() before a successful root() for {req_id}")
        if np.any(parents >= fed + np.arange(m)) or np.any(parents < -1):
            raise ValueError("eagle2: expand() parents must index nodes fed earlier (or -1)")
        depth = []
        for j, p in enumerate(parents.tolist()):
            if p < 0:
                depth.append(1)
            elif p < fed:
                depth.append(state.d_depth[p] + 1)
            else:
                depth.append(depth[p - fed] + 1)
        feats = []
        for p in parents.tolist():
            if p < 0:
                feats.append(state.last_hidden)
            elif p < fed:
                feats.append(state.d_hidden[p])
            else:
                raise ValueError("eagle2: a node's parent must be fed in an earlier call")
        feat = torch.stack(feats)
        # ancestor mask over [committed cache | earlier draft nodes | these nodes]
        all_parents = state.d_parents + parents.tolist()
        total = fed + m
        anc = np.zeros((m, total), dtype=bool)
        for j in range(m):
            x = fed + j
            while x >= 0:
                anc[j, x] = True
                x = all_parents[x]
        mask = torch.ones(m, state.n + total, dtype=torch.bool, device=self.device)
        mask[:, state.n:] = torch.from_numpy(anc).to(self.device)
        past_k = state.k[:, : state.n]
        past_v = state.v[:, : state.n]
        if state.d_k is not None:
            past_k = torch.cat([past_k, state.d_k], dim=1)
            past_v = torch.cat([past_v, state.d_v], dim=1)
        pos = torch.as_tensor([state.last_pos + d for d in depth], dtype=torch.long,
                              device=self.device)
        emb = F.embedding(torch.as_tensor(tokens, device=self.device), self.embed_weight)
        hidden, nk, nv = self.head(emb, feat, pos, past_k, past_v, mask)
        state.d_k = nk if state.d_k is None else torch.cat([state.d_k, nk], dim=1)
        state.d_v = nv if state.d_v is None else torch.cat([state.d_v, nv], dim=1)
        state.d_hidden = hidden if state.d_hidden is None else torch.cat(
            [state.d_hidden, hidden])
        state.d_parents += parents.tolist()
        state.d_depth += depth
        out = self._topk(hidden, k)
        dt = time.perf_counter() - t0
        self.counts["seconds"] += dt
        self._expand_seconds = dt if self._expand_seconds is None else (
            0.9 * self._expand_seconds + 0.1 * dt)
        return out

    def release(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    def active_requests(self) -> int:
        return len(self.states)

    def state_nbytes(self) -> int:
        return sum(s.nbytes() for s in self.states.values())

    def stats(self) -> dict:
        out = dict(self.counts)
        out["seconds"] = round(out["seconds"], 3)
        out["requests"] = len(self.states)
        return out

    # -------------------------------------------------------------- helpers
    def _catch_up(self, state: _HeadState) -> None:
        tokens = torch.as_tensor(state.pend_tokens, dtype=torch.long, device=self.device)
        feats = torch.cat(state.pend_feats) if len(state.pend_feats) > 1 else state.pend_feats[0]
        pos = torch.as_tensor(state.pend_pos, dtype=torch.long, device=self.device)
        state.pend_tokens, state.pend_feats, state.pend_pos = [], [], []
        m = tokens.numel()
        emb = F.embedding(tokens, self.embed_weight)
        hidden, nk, nv = self.head(emb, feats, pos, state.k[:, : state.n],
                                   state.v[:, : state.n], None)
        need = state.n + m
        if need > state.k.shape[1]:
            cap = max(need, 2 * state.k.shape[1])
            for name in ("k", "v"):
                old = getattr(state, name)
                new = torch.zeros(self.kvh, cap, self.hd, dtype=old.dtype, device=old.device)
                new[:, : state.n] = old[:, : state.n]
                setattr(state, name, new)
        state.k[:, state.n: need] = nk
        state.v[:, state.n: need] = nv
        state.n = need
        state.positions += pos.tolist()
        state.last_pos = int(pos[-1])
        state.last_hidden = hidden[-1]
        self.counts["head_calls"] += 1
        self.counts["catch_up_rows"] += m

    def _topk(self, hidden: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        if self.kind == "eagle3":
            lp = self.head.logits(hidden)  # log-probs over the target's vocabulary
            vals, ids = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
        else:
            # over the draft vocabulary (the whole one when draft_ids is None);
            # log-probs normalised over it
            logits = F.linear(hidden, self.draft_weight).float()
            lp = torch.log_softmax(logits, dim=-1)
            vals, ids = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
            if self.draft_ids is not None:
                ids = self.draft_ids[ids]
        self.counts["head_calls"] += 1
        self.counts["head_rows"] += int(hidden.shape[0])
        return ids.cpu().numpy().astype(np.int32), vals.cpu().numpy().astype(np.float32)


def _full_vocab(weight: torch.Tensor) -> torch.Tensor:
    """The whole [vocab, hidden] matrix on this rank (vocab-sharded weights
    are gathered once across tensor-parallel ranks)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        tp = get_tensor_model_parallel_world_size()
    except Exception:  # noqa: BLE001 - no distributed state: one rank
        tp = 1
    if tp == 1:
        return weight.detach()
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(weight.detach().contiguous(), dim=0)


def make_eagle_hook(drafter: Any, target_model: Any) -> EagleRunner:
    """The ``Eagle2Proposer.target_hook`` factory (called from ``drafter.load_model``)."""
    path = drafter.plugin["options"].get("model")
    if not path:
        raise SpecPlugConfigError(
            "speculative method 'eagle2' needs the EAGLE head folder: add \"model\": "
            "\"path/to/head\" to --speculative-config")
    runner = EagleRunner(drafter, target_model, path)
    logger.info("vllm_specplug eagle2: EAGLE head from %s on %s (%s)", path,
                type(target_model).__name__, runner.dtype)
    return runner
