"""Acceptance curves that do not depend on the hardware (issue 20).

tau of each model-free method as a function of the number of draft tokens
or nodes it may put in one verify step (its budget ``n``), from the offline
greedy replay (``bench.simulate``) of recorded outputs of the target. A
verify-cost line ``cost(tokens) = a + b * tokens`` (the line
``vllm_specplug.budget.StepCostModel`` fits) turns a curve into an expected
speedup on a machine:

    speedup(n) = tau(n) * cost(1) / cost(1 + nodes per step at budget n)

where ``cost(1)`` is a plain decoding step and ``nodes per step`` is the
mean number of draft nodes the method actually verified per step (a method
may draft fewer than ``n``). Drafting time is not counted.

The baselines vLLM users already have are replayed here too, the way vLLM
0.32 drives them: ``suffix`` (Arctic Inference's ``SuffixDecodingCache``
with vLLM's parameters and its cross-request response cache) and ``ngram``
(vLLM's prompt-lookup rule). They are ``Proposer`` classes for the replay
only; they are not registered as plugin methods.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Sequence

import numpy as np

from ..proposers.base import Draft, Proposer, TargetTopK
from .simulate import accepted_length, replay_many, within_budget

BUDGETS = (1, 2, 4, 8, 16, 32, 64)


# ------------------------------------------------------------------ baselines

def ngram_draft(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM 0.32's ``ngram`` proposal (``_find_longest_matched_ngram_and_
    propose_tokens``): the longest n in [min_n, max_n] whose last n tokens
    occur earlier in ``tokens``; of those occurrences the earliest; the (up
    to) k tokens that followed it."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        pattern = list(tokens[total - n:])
        for j in range(0, total - n):
            if list(tokens[j:j + n]) == pattern:
                start = j + n
                return list(tokens[start:start + min(k, total - start)])
    return []


class NgramBaseline(Proposer):
    """vLLM's ``ngram`` (prompt lookup), as the benchmark configures it
    (``bench.engine.METHOD_CONFIGS``: min 2, max 5)."""

    name: ClassVar[str] = "ngram"

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 2,
                 prompt_lookup_max: int = 5) -> None:
        self.k = int(num_speculative_tokens)
        self.min_n, self.max_n = int(prompt_lookup_min), int(prompt_lookup_max)
        self._tokens: dict[str, list[int]] = {}

    def start(self, req_id, token_ids):
        self._tokens[req_id] = list(token_ids)

    def observe(self, req_id, committed_ids, target_topk: TargetTopK | None = None):
        self._tokens[req_id].extend(int(t) for t in committed_ids)

    def propose(self, req_id, budget):
        return Draft.chain(ngram_draft(self._tokens[req_id], self.min_n, self.max_n,
                                       min(budget, self.k)))

    def finish(self, req_id):
        self._tokens.pop(req_id, None)

    def active_requests(self):
        return len(self._tokens)


class SuffixBaseline(Proposer):
    """vLLM 0.32's ``suffix`` (``v1/spec_decode/suffix_decoding.py``):
    Arctic Inference's ``SuffixDecodingCache`` with vLLM's defaults (tree
    depth 24, at most 10,000 cached responses, spec factor 1.0, minimum
    token probability 0.1). As there, a request starts with its prompt, then
    every step adds the sampled tokens to its response (the first step: the
    prefill's token) and speculates from the last ``max_tree_depth`` tokens;
    a finished request is stopped and its response stays in the global
    cache for later requests."""

    name: ClassVar[str] = "suffix"

    def __init__(self, num_speculative_tokens: int, max_tree_depth: int = 24,
                 max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.k = int(num_speculative_tokens)
        self.depth = int(max_tree_depth)
        self.spec_factor = float(max_spec_factor)
        self.min_token_prob = float(min_token_prob)
        self.cache = SuffixDecodingCache(max_tree_depth=self.depth,
                                         max_cached_requests=max_cached_requests)
        self._tokens: dict[str, list[int]] = {}

    def start(self, req_id, token_ids):
        tokens = [int(t) for t in token_ids]
        if req_id in self.cache.active_requests:
            self.cache.stop_request(req_id)
        if req_id in self.cache.cached_requests:
            self.cache.evict_cached_response(req_id)
        # the prompt, then the prefill's sampled token as the response's first
        self.cache.start_request(req_id, tokens[:-1])
        self.cache.add_active_response(req_id, tokens[-1:])
        self._tokens[req_id] = tokens

    def observe(self, req_id, committed_ids, target_topk: TargetTopK | None = None):
        if committed_ids:
            ids = [int(t) for t in committed_ids]
            self.cache.add_active_response(req_id, ids)
            self._tokens[req_id].extend(ids)

    def propose(self, req_id, budget):
        tokens = self._tokens[req_id]
        draft = self.cache.speculate(req_id, tokens[-self.depth:],
                                     max_spec_tokens=min(budget, self.k),
                                     max_spec_factor=self.spec_factor,
                                     min_token_prob=self.min_token_prob)
        return Draft.chain(list(draft.token_ids))

    def finish(self, req_id):
        if self._tokens.pop(req_id, None) is not None:
            self.cache.stop_request(req_id)

    def active_requests(self):
        return len(self._tokens)


# ------------------------------------------------------------------ methods

def _sam(n: int, **opts) -> Proposer:
    from ..proposers.sam import SamProposer

    return SamProposer(n, **opts)


def _tr(n: int, **opts) -> Proposer:
    from ..proposers.token_recycling import TokenRecyclingProposer

    return TokenRecyclingProposer(n, **opts)


def _sam_tr(n: int, **opts) -> Proposer:
    from ..proposers.hybrid import SamTokenRecyclingProposer

    return SamTokenRecyclingProposer(n, **opts)


#: name -> (factory of a proposer with budget n, description)
METHODS: dict[str, tuple[Callable[[int], Proposer], str]] = {
    "ngram": (lambda n: NgramBaseline(n), "vLLM ngram (prompt lookup, n-gram 2-5)"),
    "suffix": (lambda n: SuffixBaseline(n), "vLLM suffix (Arctic Inference, vLLM defaults)"),
    "sam": (lambda n: _sam(n, sam_global_tokens=0), "sam without the global store"),
    "sam_global": (lambda n: _sam(n), "sam with the global store (default 500k tokens)"),
    "token_recycling": (lambda n: _tr(n), "token_recycling, fixed budget n (tree)"),
    "sam_tr": (lambda n: _sam_tr(n), "sam_tr, fixed budget n (chain or tree)"),
}


# ------------------------------------------------------------------ records

def load_records(path: str | Path, topk_path: str | Path | None = None,
                 half: str | None = "odd") -> list[dict]:
    """Rows of a ``scripts/record_greedy_hf.py`` file (in file order), with
    ``"topk"`` = (ids, logprobs) per output position from its ``topk`` .npz
    when given; ``half`` keeps the rows whose ``pos`` is even or odd."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if topk_path is not None:
        z = np.load(topk_path)
        offsets = z["offsets"]
        if offsets.size != len(rows) + 1:
            raise ValueError(f"{topk_path} holds top-k of {offsets.size - 1} records, "
                             f"{path} has {len(rows)}")
        ids, logprobs = z["ids"], z["logprobs"]
        for i, r in enumerate(rows):
            lo, hi = int(offsets[i]), int(offsets[i + 1])
            if hi - lo != len(r["output_ids"]):
                raise ValueError(f"record {i}: {hi - lo} top-k rows for "
                                 f"{len(r['output_ids'])} output tokens")
            r["topk"] = (ids[lo:hi], logprobs[lo:hi])
    if half is not None:
        parity = {"even": 0, "odd": 1}[half]
        rows = [r for r in rows if r["pos"] % 2 == parity]
    return rows


def requests_of(rows: Sequence[dict]) -> list[tuple]:
    return [(r["prompt_ids"], r["output_ids"], r.get("topk")) for r in rows]


def curve(method: str, rows: Sequence[dict], budgets: Sequence[int] = BUDGETS,
          factory: Callable[[int], Proposer] | None = None,
          relative_token_cost: float | None = None) -> list[dict]:
    """Replay of ``rows`` (one proposer for all, in order) at each budget.
    ``relative_token_cost``: what the adapter would set from the verify-cost
    line (``b / (a + b)``), read by proposers that size drafts by cost
    (``sam``'s default cut); None: the class default."""
    make = factory or METHODS[method][0]
    out = []
    for n in budgets:
        each: list[dict] = []
        proposer = make(n)
        if relative_token_cost is not None:
            proposer.relative_token_cost = relative_token_cost
        res = replay_many(proposer, requests_of(rows), n, per_request=each)
        res["budget"] = n
        res["nodes_per_step"] = res["draft_tokens"] / res["steps"] if res["steps"] else 0.0
        by_cat: dict[str, list[int]] = {}
        for r, c in zip(rows, each):
            g = by_cat.setdefault(str(r.get("category", "")), [0, 0])
            g[0] += c["generated"]
            g[1] += c["steps"]
        res["tau_by_category"] = {k: g / s for k, (g, s) in by_cat.items() if s}
        out.append(res)
    return out


def oracle_replay(sources: dict[str, Proposer], requests: Sequence[tuple],
                  budget: int) -> dict:
    """An upper bound for choosing, each step, among ``sources``' drafts and
    for sizing the draft: greedy replay (as ``replay_many``: batch size 1,
    in order, one proposer per source for all requests) where each step
    keeps the candidate draft accepted deepest and verifies exactly its
    accepted tokens (no rejected node is ever verified). Every source
    observes every committed token. Returns tau, ``nodes_per_step`` (the
    verified draft nodes: the accepted ones) and how many steps each
    source's draft was the one kept (``wins``; a step where none was
    accepted counts for none)."""
    gen = steps = nodes = 0
    wins = {name: 0 for name in sources}
    for i, request in enumerate(requests):
        prompt, out = list(request[0]), list(request[1])
        if not out:
            continue
        rid = f"r{i}"
        for p in sources.values():
            p.start(rid, prompt + out[:1])   # the prefill step made out[0]
        pos, n_steps = 1, 1
        while pos < len(out):
            best, who = 0, None
            for name, p in sources.items():
                a = accepted_length(within_budget(p.propose(rid, budget), budget), out, pos)
                if a > best:
                    best, who = a, name
            if who is not None:
                wins[who] += 1
            n = min(best + 1, len(out) - pos)
            for p in sources.values():
                p.observe(rid, out[pos:pos + n])
            nodes += n - 1
            pos += n
            n_steps += 1
        for p in sources.values():
            p.complete(rid)
            p.finish(rid)
        gen += len(out)
        steps += n_steps
    return {"generated": gen, "steps": steps, "tau": gen / steps if steps else 1.0,
            "nodes_per_step": nodes / steps if steps else 0.0, "wins": wins}


# ------------------------------------------------------------------ cost lines

@dataclass(frozen=True)
class CostLine:
    """``cost(tokens) = a + b * tokens`` for one verify step of one request
    (tokens = 1 + draft nodes); units cancel in speedups."""

    a: float
    b: float
    name: str = ""
    source: str = ""

    def cost(self, tokens: float) -> float:
        return self.a + self.b * tokens

    def speedup(self, tau: float, nodes_per_step: float) -> float:
        """Expected speedup over plain decoding (one token per step)."""
        return tau * self.cost(1) / self.cost(1 + nodes_per_step)

    @property
    def relative_token_cost(self) -> float:
        """``StepCostModel.relative_token_cost(1)`` of this line."""
        return self.b / (self.a + self.b)

    def as_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "b_over_a": self.b / self.a, "name": self.name,
                "source": self.source}


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """Least squares (a, b, R^2) of y = a + b * x."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    b, a = np.polyfit(x, y, 1)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float(((y - a - b * x) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return float(a), float(b), r2


#: This CPU's measured verify steps (docs/architecture.md, "Measured cost of
#: a tree verify step", first run of scripts/measure_tree_cost.py; 2-core
#: AVX2, SmolLM2-135M float32, batch 1): (draft nodes, ms per step) for
#: plain decoding, vLLM's chain verification and our tree path.
CPU_MEASURED_MS = {
    "plain": [(0, 69.5)],
    "chain": [(1, 70.8), (8, 104.7), (16, 134.6), (32, 189.3), (64, 333.8)],
    "tree": [(1, 67.4), (8, 106.5), (16, 141.9), (32, 224.0), (64, 377.9)],
}


def cpu_cost_line() -> CostLine:
    """The line through every measured point above (tokens = 1 + nodes)."""
    pts = [(1 + n, ms) for rows in CPU_MEASURED_MS.values() for n, ms in rows]
    a, b, r2 = fit_line(pts)
    return CostLine(a, b, "cpu", f"least squares over the 11 points of docs/architecture.md "
                                 f"(plain, chain and tree, 0-64 draft nodes), ms; R^2 {r2:.3f}")


#: The GPU-like line: 64 more verified tokens cost 10% of a step.
GPU_LIKE_B_OVER_A = 0.1 / 64


def gpu_like_cost_line() -> CostLine:
    return CostLine(1.0, GPU_LIKE_B_OVER_A, "gpu_like",
                    "assumed, not measured: b = 0.1 * a / 64 (verifying 64 more tokens "
                    "costs 10% of a step); replace with the device script's fitted line")


def load_cost_line(spec: str, name: str = "gpu") -> CostLine:
    """A cost line from a JSON file: ``{"a": .., "b": ..}``, ``{"a_ms": ..,
    "b_ms_per_token": ..}`` (``scripts/device_gpu_checks.py``'s fit), or
    that script's whole output (``gpu_checks.json``): ``FILE:KEY`` picks the
    fit of context/batch KEY (default ``1024/1``, batch size 1 as the
    replay)."""
    path, _, key = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
    data = json.loads(Path(path).read_text())
    if "verify_cost" in data:
        fits = data["verify_cost"].get("fits", {})
        key = key or "1024/1"
        if key not in fits:
            raise ValueError(f"{path}: no verify_cost fit {key!r} (have {sorted(fits)})")
        data = fits[key]
        source = f"{path}, verify_cost fit {key}"
    else:
        source = path
    if "a_ms" in data:
        a, b = float(data["a_ms"]), float(data["b_ms_per_token"])
    else:
        a, b = float(data["a"]), float(data["b"])
    if not (a > 0 and b >= 0 and math.isfinite(a) and math.isfinite(b)):
        raise ValueError(f"{path}: implausible cost line a={a}, b={b}")
    return CostLine(a, b, name, source)


def best_budget(points: Sequence[dict], line: CostLine) -> dict:
    """The budget with the highest expected speedup on ``line``."""
    scored = [(line.speedup(p["tau"], p["nodes_per_step"]), p) for p in points]
    s, p = max(scored, key=lambda t: t[0])
    return {"budget": p["budget"], "speedup": s, "tau": p["tau"],
            "nodes_per_step": p["nodes_per_step"]}
