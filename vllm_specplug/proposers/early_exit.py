"""DEL: early-exit self-speculation with a dynamic exit layer and draft length.

The target model drafts for itself: its first ``L`` decoder layers, then its
final norm and LM head, autoregressively for up to ``d`` tokens (greedy). The
full model verifies. DEL (Zarch et al., arXiv 2504.05598) chooses ``(L, d)``
per request and step:

* **Shadow tokens.** While the first draft token of a step goes through the
  layers, the LM head is also applied at every *candidate* exit layer
  (``del_min_layer..del_max_layer`` every ``del_layer_step``): each predicts
  the token after the last committed one. Next step the target's committed
  token there says whether each layer's draft would have been accepted. The
  chosen layer's later draft positions add samples for that layer too.
* **Acceptance estimate** ``a_L``: the hit rate of layer L over the request's
  last ``del_window`` samples, shrunk towards the rate over all requests
  (``PRIOR_WEIGHT`` pseudo-samples), so a new request starts from what the
  engine learned.
* **Selection**: ``(L, d)`` maximising tokens per layer-equivalent of compute

      TPL(L, d) = [(1 - a_L^(d+1)) / (1 - a_L)] / (d * (L + h) + N + h)

  with ``N`` the model's layers and ``h`` the LM head's cost in layers
  (``del_head_cost``; ``0`` is the paper's formula; the default ``-1`` takes
  the ratio of the LM head's to one layer's weights, since on a CPU, where a
  step is memory bound, SmolLM2-135M's LM head costs about 8 of its 30
  layers). When no pair beats plain decoding (``1 / (N + h)``) the step
  drafts nothing, except on probe steps.
* **Confidence stop**: drafting stops before a token whose probability under
  the draft is below ``del_confidence``.
* **Probing**: candidate layers deeper than the chosen one cost extra layers;
  they are run only on every ``del_probe_every``-th step of a request (and on
  its first). Shallower ones cost only LM-head rows: all candidate rows go
  through the LM head in one matrix product (memory bound: nearly the price
  of one row). While no layer pays, a probe is pure exploration cost, so the
  interval doubles after each probe that found nothing worth drafting, up to
  ``del_probe_max`` steps, and falls back to ``del_probe_every`` as soon as a
  layer pays. The interval is shared: a new request starts from the one the
  engine last reached (so on a model where early exit never pays, new
  requests do not each probe from scratch).

A fixed ``del_exit_layer`` (> 0) turns all of this off: every step drafts
``num_speculative_tokens`` tokens from that layer (cut by ``del_confidence``
if it is above 0).

This module is vLLM-free. The model is reached through an
:class:`ExitDraftHook` that the vLLM adapter
(``vllm_specplug.vllm_adapter.v1.early_exit_runner``) binds when the target is
loaded; unit tests bind a fake.
"""
from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, Sequence

import numpy as np

from ..folders import model_config
from ..options import Option, SpecPlugConfigError
from .base import Draft, Proposer, TargetTopK

logger = logging.getLogger("vllm_specplug")

#: Log the chosen (L, d) distribution every this many proposals.
LOG_EVERY = 2000

#: Model classes whose decoder layers the adapter's early-exit runner knows
#: how to run piecewise (``vllm_adapter.early_exit_runner``).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")

#: Weight, in samples, of the all-requests acceptance rate in a request's estimate.
PRIOR_WEIGHT = 4.0
#: All-requests rate of a layer never sampled (optimistic, so it gets tried).
UNSEEN_RATE = 0.5
#: Half-life, in samples, of the all-requests rates (an exponential average).
GLOBAL_HORIZON = 256


@dataclass
class ExitDraft:
    """What one early-exit drafting pass produced."""

    #: Greedy draft tokens from the exit layer (cut at the confidence threshold).
    tokens: list[int]
    #: Candidate layer -> the token its hidden state predicts after the last
    #: committed token (shadow tokens).
    shadows: dict[int, int] = field(default_factory=dict)
    #: Draft probability of each token (for stats), optional.
    confidences: list[float] = field(default_factory=list)


class ExitDraftHook(Protocol):
    """The target model as DEL needs it (implemented by the vLLM adapter)."""

    #: Decoder layers of the target.
    num_layers: int
    #: The LM head's cost in decoder-layer equivalents.
    head_cost: float

    def draft(self, req_id: str, token: int, position: int, exit_layer: int,
              max_tokens: int, threshold: float, shadow_layers: Sequence[int]) -> ExitDraft:
        """Draft up to ``max_tokens`` tokens after ``token`` (the last committed
        token, at ``position``; its KV is not cached yet) with the first
        ``exit_layer`` layers; stop before a token whose probability is below
        ``threshold``. Also return the shadow token of each of
        ``shadow_layers`` for the first draft position."""


def expected_tokens(a: float, d: int) -> float:
    """Expected tokens per step from a chain of ``d`` drafts each accepted
    with probability ``a`` (bonus token included): (1 - a^(d+1)) / (1 - a)."""
    a = min(max(float(a), 0.0), 1.0)
    if a >= 1.0 - 1e-9:
        return float(d + 1)
    return (1.0 - a ** (d + 1)) / (1.0 - a)


def tpl(a: float, exit_layer: int, d: int, num_layers: int, head_cost: float = 0.0) -> float:
    """Tokens per layer-equivalent of compute of drafting ``d`` tokens from
    layer ``exit_layer`` then verifying: DEL's TPL(L, d) (``head_cost`` 0 is
    the paper's formula; ``d`` 0 is plain decoding)."""
    cost = d * (exit_layer + head_cost) + num_layers + head_cost
    return expected_tokens(a, d) / cost


def choose_exit(rates: dict[int, float], num_layers: int, max_tokens: int,
                head_cost: float = 0.0) -> tuple[int, int, float]:
    """The ``(L, d, TPL)`` maximising TPL over candidate layers ``rates``
    (layer -> acceptance estimate) and ``d`` in 1..max_tokens; ``(0, 0,
    plain TPL)`` when none beats plain decoding. Ties go to the shallower
    layer, then the shorter draft."""
    best = (0, 0, tpl(0.0, 0, 0, num_layers, head_cost))
    for layer in sorted(rates):
        for d in range(1, max_tokens + 1):
            t = tpl(rates[layer], layer, d, num_layers, head_cost)
            if t > best[2] * (1 + 1e-12):
                best = (layer, d, t)
    return best


def candidate_layers(num_layers: int, min_layer: int, max_layer: int, step: int) -> list[int]:
    """Candidate exit layers: min..max (0: half the model) every ``step``,
    always including max; at most ``num_layers - 1``."""
    hi = max_layer if max_layer > 0 else max(num_layers // 2, min_layer)
    hi = min(hi, num_layers - 1)
    if min_layer > hi:
        return []
    layers = list(range(min_layer, hi + 1, step))
    if layers[-1] != hi:
        layers.append(hi)
    return layers


class _Request:
    __slots__ = ("n", "last", "steps", "window", "pending", "interval", "next_probe")

    def __init__(self, token_ids: Sequence[int], window: int, interval: int,
                 first_probe: int) -> None:
        self.n = len(token_ids)
        self.last = int(token_ids[-1]) if token_ids else -1
        self.steps = 0
        # probe schedule: steps between probes, and the step of the next one
        self.interval = interval
        self.next_probe = first_probe
        self.window: dict[int, deque] = {}
        # (exit layer, draft tokens, shadows) of the last draft proposed
        self.pending: tuple[int, list[int], dict[int, int]] | None = None


class DelProposer(Proposer):
    name: ClassVar[str] = "del"
    default_num_speculative_tokens: ClassVar[int] = 4
    # Every rank must draft in lockstep (the layers all-reduce). They do: the
    # hidden states after each all-reduce and the all-gathered logits are the
    # same on every rank, and the controller uses no timings
    # (tests/test_engine_tp.py runs it at TP=2).
    supports_tensor_parallel: ClassVar[bool] = True
    #: The adapter factory that binds this proposer to the loaded target
    #: (``bind_target``); the drafter calls it from ``load_model``.
    target_hook: ClassVar[str] = "vllm_specplug.vllm_adapter.v1.early_exit_runner:make_exit_hook"
    options: ClassVar[tuple[Option, ...]] = (
        Option("del_exit_layer", int, 0,
               "fixed exit layer L (draft with the first L layers, num_speculative_tokens "
               "tokens per step); 0: choose L and the draft length per request (DEL)",
               minimum=0, maximum=1024),
        Option("del_min_layer", int, 2, "shallowest candidate exit layer", minimum=1,
               maximum=1024),
        Option("del_max_layer", int, 0,
               "deepest candidate exit layer; 0: half the model's layers", minimum=0,
               maximum=1024),
        Option("del_layer_step", int, 2, "candidate exit layers every this many layers",
               minimum=1, maximum=1024),
        Option("del_window", int, 32,
               "acceptance estimates per layer over a request's last this many samples",
               minimum=1, maximum=100000),
        Option("del_confidence", float, 0.3,
               "stop drafting before a token whose draft probability is below this "
               "(0: never)", minimum=0.0, maximum=1.0),
        Option("del_head_cost", float, -1.0,
               "the LM head's cost in decoder layers in TPL; 0: the paper's formula; "
               "-1: from the model's weights (LM head / one layer)", minimum=-1.0,
               maximum=10000.0),
        Option("del_probe_every", int, 4,
               "run the candidate layers deeper than the chosen one (shadow tokens) on "
               "every this-many-th step of a request", minimum=1, maximum=100000),
        Option("del_probe_max", int, 64,
               "while no exit layer pays, the probe interval doubles after each probe, up "
               "to this many steps (del_probe_every: never back off)", minimum=1,
               maximum=100000),
    )

    @classmethod
    def check_options(cls, num_speculative_tokens: int, options: dict) -> None:
        lo, hi = options.get("del_min_layer", 2), options.get("del_max_layer", 0)
        if hi and lo > hi:
            raise SpecPlugConfigError(
                f"speculative_config['del_min_layer'] ({lo}) must be <= "
                f"speculative_config['del_max_layer'] ({hi}); 0 for del_max_layer means "
                f"half the model's layers")
        every, most = options.get("del_probe_every", 4), options.get("del_probe_max", 64)
        if most < every:
            raise SpecPlugConfigError(
                f"speculative_config['del_probe_max'] ({most}) must be >= "
                f"speculative_config['del_probe_every'] ({every})")
        if options.get("del_head_cost", -1.0) < 0 and options.get("del_head_cost", -1.0) != -1:
            raise SpecPlugConfigError(
                "speculative_config['del_head_cost'] must be >= 0, or -1 (from the model's "
                f"weights), got {options['del_head_cost']!r}")

    @classmethod
    def check_model(cls, options: dict, tokenizer: str) -> None:
        """Layer options against the model's ``config.json`` when the model is a
        local folder (the adapter checks again, against the loaded model)."""
        cfg = model_config(tokenizer)
        if cfg is None:
            return
        archs = cfg.get("architectures") or []
        if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise SpecPlugConfigError(unsupported_message(", ".join(map(str, archs))))
        cfg = cfg.get("text_config", cfg)
        if isinstance(cfg.get("num_hidden_layers"), int):
            check_layers(options, cfg["num_hidden_layers"])

    def __init__(self, num_speculative_tokens: int, del_exit_layer: int = 0,
                 del_min_layer: int = 2, del_max_layer: int = 0, del_layer_step: int = 2,
                 del_window: int = 32, del_confidence: float = 0.3,
                 del_head_cost: float = -1.0, del_probe_every: int = 4,
                 del_probe_max: int = 64) -> None:
        self.k = int(num_speculative_tokens)
        self.exit_layer = int(del_exit_layer)
        self.min_layer = int(del_min_layer)
        self.max_layer = int(del_max_layer)
        self.layer_step = int(del_layer_step)
        self.window = int(del_window)
        self.threshold = float(del_confidence)
        self.head_cost_option = float(del_head_cost)
        self.probe_every = int(del_probe_every)
        self.probe_max = max(int(del_probe_max), self.probe_every)
        # the probe interval the engine last reached (new requests start there)
        self._shared_interval = self.probe_every
        self.hook: ExitDraftHook | None = None
        self.num_layers = 0
        self.head_cost = 0.0
        self.candidates: list[int] = []
        self._requests: dict[str, _Request] = {}
        # all-requests acceptance per layer: exponentially weighted (hits, samples)
        self._global: dict[int, list[float]] = {}
        self.chosen_layer: Counter = Counter()
        self.chosen_length: Counter = Counter()
        self.drafted_length: Counter = Counter()
        self.counts = {"steps": 0, "drafts": 0, "draft_tokens": 0, "accepted": 0,
                       "probes": 0, "skipped": 0, "unbound": 0}

    # ------------------------------------------------------------------ binding
    def bind_target(self, hook: ExitDraftHook) -> None:
        """Attach the model (the adapter calls this once the target is loaded)."""
        check_layers({"del_exit_layer": self.exit_layer, "del_min_layer": self.min_layer,
                      "del_max_layer": self.max_layer}, int(hook.num_layers))
        self.hook = hook
        self.num_layers = int(hook.num_layers)
        self.head_cost = (float(hook.head_cost) if self.head_cost_option < 0
                          else self.head_cost_option)
        self.candidates = ([] if self.exit_layer else
                           candidate_layers(self.num_layers, self.min_layer, self.max_layer,
                                            self.layer_step))

    # ------------------------------------------------------------------ estimates
    def rate(self, req: _Request | None, layer: int) -> float:
        """Acceptance estimate of ``layer`` for a request: its windowed hit
        rate shrunk towards the all-requests rate."""
        g = self._global.get(layer)
        prior = UNSEEN_RATE if g is None or g[1] <= 0 else g[0] / g[1]
        w = req.window.get(layer) if req is not None else None
        hits, n = (sum(w), len(w)) if w else (0, 0)
        return (hits + PRIOR_WEIGHT * prior) / (n + PRIOR_WEIGHT)

    def rates(self, req: _Request | None) -> dict[int, float]:
        return {layer: self.rate(req, layer) for layer in self.candidates}

    def _sample(self, req: _Request, layer: int, hit: bool) -> None:
        w = req.window.get(layer)
        if w is None:
            w = req.window[layer] = deque(maxlen=self.window)
        w.append(1 if hit else 0)
        g = self._global.setdefault(layer, [0.0, 0.0])
        decay = 0.5 ** (1.0 / GLOBAL_HORIZON)
        g[0] = g[0] * decay + (1.0 if hit else 0.0)
        g[1] = g[1] * decay + 1.0

    # ------------------------------------------------------------------ life cycle
    def start(self, req_id: str, token_ids: Sequence[int]) -> None:
        interval = self._shared_interval
        # backed off: the engine learned nothing pays, so skip the first probe too
        first = 0 if interval <= self.probe_every else interval
        self._requests[req_id] = _Request(token_ids, self.window, interval, first)

    def observe(self, req_id: str, committed_ids: Sequence[int],
                target_topk: TargetTopK | None = None) -> None:
        req = self._requests[req_id]
        if not committed_ids:
            return
        pending, req.pending = req.pending, None
        if pending is not None:
            layer, tokens, shadows = pending
            first = int(committed_ids[0])
            for c, tok in shadows.items():
                if c != layer or not tokens:
                    self._sample(req, c, tok == first)
            if tokens:
                a = 0
                while (a < len(tokens) and a < len(committed_ids) - 1
                       and tokens[a] == committed_ids[a]):
                    a += 1
                self.counts["accepted"] += a
                if layer in self.candidates or not self.candidates:
                    # every compared draft position is a sample of layer L
                    for i in range(min(len(tokens), a + 1)):
                        self._sample(req, layer, i < a)
        req.n += len(committed_ids)
        req.last = int(committed_ids[-1])

    def plan(self, req_id: str, budget: int) -> tuple[int, int, bool]:
        """``(exit layer, draft length, probe)`` for this step (0 length: no
        draft; a probe still runs one pass for the shadow tokens)."""
        req = self._requests[req_id]
        k = min(budget, self.k)
        if self.exit_layer:
            return self.exit_layer, k, False
        probe = req.steps >= req.next_probe
        layer, d, _ = choose_exit(self.rates(req), self.num_layers, k, self.head_cost)
        if probe:
            # back off while nothing pays; probe at the base rate once something does
            req.interval = (self.probe_every if d else
                            min(2 * req.interval, self.probe_max))
            req.next_probe = req.steps + req.interval
            self._shared_interval = req.interval
            if d == 0:
                # nothing pays: probe with one token from the best-looking layer
                rates = self.rates(req)
                layer = max(rates, key=lambda c: (rates[c], -c)) if rates else 0
                d = 1 if layer else 0
        return layer, d, probe

    def propose(self, req_id: str, budget: int) -> Draft:
        req = self._requests[req_id]
        self.counts["steps"] += 1
        if self.hook is None:
            self.counts["unbound"] += 1
            return Draft.empty()
        if min(budget, self.k) <= 0 or req.n == 0:
            return Draft.empty()
        layer, d, probe = self.plan(req_id, budget)
        req.steps += 1
        if d == 0:
            self.counts["skipped"] += 1
            return Draft.empty()
        shadows = [c for c in self.candidates if probe or c <= layer]
        if probe:
            self.counts["probes"] += 1
        out = self.hook.draft(req_id, req.last, req.n - 1, layer, d, self.threshold, shadows)
        tokens = [int(t) for t in out.tokens[:d]]
        req.pending = (layer, tokens, {int(c): int(t) for c, t in out.shadows.items()})
        self.chosen_layer[layer] += 1
        self.chosen_length[d] += 1
        if self.counts["steps"] % LOG_EVERY == 0:
            logger.info("vllm_specplug del: exit layers %s, draft lengths %s, accepted %d of "
                        "%d draft tokens", dict(self.chosen_layer), dict(self.chosen_length),
                        self.counts["accepted"], self.counts["draft_tokens"])
        self.drafted_length[len(tokens)] += 1
        if tokens:
            self.counts["drafts"] += 1
            self.counts["draft_tokens"] += len(tokens)
        return Draft.chain(tokens)

    def draft_cut(self, req_id: str, kept: Draft) -> None:
        """The adapter verifies only ``kept`` (a prefix): the rest is not scored."""
        req = self._requests.get(req_id)
        if req is not None and req.pending is not None:
            layer, tokens, shadows = req.pending
            n = len(kept)
            self.counts["draft_tokens"] -= len(tokens) - n
            if n == 0 and tokens:
                self.counts["drafts"] -= 1
            req.pending = (layer, tokens[:n], shadows)

    def finish(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def active_requests(self) -> int:
        return len(self._requests)

    def state_nbytes(self) -> int:
        return sum(64 + 8 * sum(len(w) for w in r.window.values())
                   for r in self._requests.values())

    def debug_stats(self) -> dict:
        """Chosen L and d distributions and per-layer acceptance (all requests),
        for logs and the benchmark JSON."""
        return {
            "exit_layer": {str(k): v for k, v in sorted(self.chosen_layer.items())},
            "draft_length_planned": {str(k): v for k, v in sorted(self.chosen_length.items())},
            "draft_length": {str(k): v for k, v in sorted(self.drafted_length.items())},
            "layer_acceptance": {str(c): round(g[0] / g[1], 4)
                                 for c, g in sorted(self._global.items()) if g[1] > 0},
            "num_layers": self.num_layers, "head_cost": round(self.head_cost, 3),
            "candidates": list(self.candidates), "probe_interval": self._shared_interval,
            **self.counts,
            "model": (self.hook.stats() if hasattr(self.hook, "stats") else {}),
        }


def check_layers(options: dict, num_layers: int) -> None:
    """Layer options against a model of ``num_layers`` decoder layers."""
    fixed = int(options.get("del_exit_layer", 0) or 0)
    if fixed and fixed >= num_layers:
        raise SpecPlugConfigError(
            f"speculative_config['del_exit_layer'] = {fixed}, but the model has "
            f"{num_layers} decoder layers; give 1..{num_layers - 1} (0: dynamic)")
    lo = int(options.get("del_min_layer", 2))
    if not fixed and lo >= num_layers:
        raise SpecPlugConfigError(
            f"speculative_config['del_min_layer'] = {lo}, but the model has {num_layers} "
            f"decoder layers; give 1..{num_layers - 1}")


def unsupported_message(arch: str) -> str:
    return (f"speculative method 'del' runs the target's first layers itself and supports "
            f"the architectures {', '.join(SUPPORTED_ARCHITECTURES)}; this model is {arch}")
