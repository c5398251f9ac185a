"""EAGLE-2: a context-aware dynamic draft tree from a small EAGLE head.

EAGLE-2 (Li et al., arXiv 2406.16858). A one-layer head, trained to predict
the target's next feature from its current feature and token, drafts a tree
each step; the target verifies it in one forward pass. The head's own
confidence (the product of its probabilities along a path) approximates
the chance that the path is accepted, and the tree's shape follows it:

1. **Root.** The head's top-``topk`` next tokens after the last committed
   token are the depth-1 candidates; a candidate's score is its cumulative
   log-probability.
2. **Expand** (depths 2..``depth``). The frontier (the best ``topk``
   candidates of the last depth) is fed to the head in one call; each
   frontier node's top-``topk`` children are new candidates scored
   parent score + child log-prob. The best ``topk`` of them are the next
   frontier. Candidates outside the frontier are not fed but stay in the
   pool.
3. **Rerank.** Of all candidates, of all depths, the best ``max_nodes`` by
   score are drafted. A child's score never exceeds its parent's, so the
   kept set is closed under parents (ties: shallower first, then the order
   generated; checked, and repaired should a head ever break it).

Nodes are returned best first, which is also parents first; a prefix of the
draft (vLLM's scheduler may cut one) is then the best smaller tree.
``Draft.scores`` are ``exp(score)``: the head's estimate that a node lies on
the accepted path, used by the batch-aware budget.

Work saved without changing the result (exact prunings): the root and every
node ask for at most ``min(topk, max_nodes)`` children, no tree is deeper
than ``max_nodes``, and a frontier node is fed only while its score beats
the ``max_nodes``-th best score so far (its descendants could not enter the
draft otherwise). With ``num_speculative_tokens: "auto"`` the number of
nodes is chosen like Token Recycling's, by ``budget.best_node_count`` over
the scores against the verify cost this engine measures
(``relative_token_cost``); a node worth at most that cost is never chosen,
so no node below it is fed either, and when the head reports the cost of
one expand call (``call_cost``), a further depth is expanded only if the
frontier's total score could pay for the call. On a CPU (a verified token
costs ~8% of a step) this cuts the tree to a few nodes and usually to one
or two head calls.

This module is vLLM-free. The head is reached through an
:class:`EagleDraftHook` that the vLLM adapter
(``vllm_specplug.vllm_adapter.v1.eagle_runner``) binds when the target is
loaded; unit tests bind a fake.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Callable, ClassVar, Protocol, Sequence

import numpy as np

from ..budget import best_node_count
from ..folders import check_draft_vocab, check_head_against_model, check_head_path
from ..options import Option
from .base import Draft, Proposer, TargetTopK

ExpandFn = Callable[[np.ndarray, np.ndarray, int], tuple[np.ndarray, np.ndarray]]


class EagleDraftHook(Protocol):
    """Runs the EAGLE head for one request (worker side)."""

    vocab_size: int

    def root(self, req_id: str, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Catch the head up with the request's committed tokens and return
        the top-k (token ids int32 [k], log-probs float32 [k], sorted desc)
        of the head's prediction for the token after the last committed one.
        Also starts a new draft tree for this request (forgets the previous
        step's draft nodes)."""

    def expand(self, req_id: str, tokens: np.ndarray, parents: np.ndarray, k: int
               ) -> tuple[np.ndarray, np.ndarray]:
        """Feed m new draft nodes to the head (tokens [m]; parents [m] index
        nodes fed earlier in this draft, in feeding order across all expand
        calls since root(), or -1 for a child of the last committed token)
        and return the top-k children of each: ids int32 [m, k] and
        log-probs float32 [m, k], sorted desc per row."""

    def release(self, req_id: str) -> None:
        """Forget the request (finished, aborted, preempted)."""

    # Optional: ``call_cost`` (float), the cost of one ``expand`` call
    # relative to one target step; "auto" budgets then expand a further
    # depth only when it can pay for itself. ``stats()`` (dict): shown in
    # ``debug_stats()["head"]``.


# ---------------------------------------------------------------------- tree
def clean_children(ids: np.ndarray, logprobs: np.ndarray, k: int,
                   vocab_size: int | None = None,
                   counters: Counter | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One node's children as the head gave them, made safe: ids out of the
    vocabulary and non-finite log-probs dropped, log-probs clipped to <= 0
    (rounding), a repeated id kept once (its best log-prob), sorted by
    log-prob (stable), the best ``k`` kept."""
    ids = np.asarray(ids).reshape(-1).astype(np.int64)
    lps = np.asarray(logprobs, dtype=np.float64).reshape(-1)
    if ids.shape != lps.shape:
        raise ValueError(f"EAGLE head gave {ids.size} token ids but {lps.size} log-probs")
    ok = np.isfinite(lps) & (ids >= 0)
    if vocab_size is not None:
        ok &= ids < vocab_size
    if counters is not None and not ok.all():
        counters["invalid_children"] += int((~ok).sum())
    ids, lps = ids[ok], np.minimum(lps[ok], 0.0)
    order = np.argsort(-lps, kind="stable")
    ids, lps = ids[order], lps[order]
    _, first = np.unique(ids, return_index=True)
    if first.size != ids.size:
        # top-k ids are distinct; a head that repeats one is counted, not trusted
        if counters is not None:
            counters["duplicate_children"] += int(ids.size - first.size)
        first.sort()
        ids, lps = ids[first], lps[first]
    return ids[:k], lps[:k]


def _nth_best(scores: list[np.ndarray], n: int) -> float:
    """The n-th best of all scores so far (-inf while there are fewer)."""
    flat = np.concatenate(scores) if scores else np.zeros(0)
    if flat.size < n:
        return -math.inf
    return float(np.partition(flat, flat.size - n)[flat.size - n])


def build_dynamic_tree(root_ids: np.ndarray, root_logprobs: np.ndarray, expand_fn: ExpandFn,
                       depth: int, topk: int, max_nodes: int, *,
                       token_cost: float | None = None, call_cost: float = 0.0,
                       vocab_size: int | None = None,
                       counters: Counter | None = None) -> Draft:
    """EAGLE-2's draft tree (see the module docstring).

    ``expand_fn(tokens [m], parents [m], k) -> (ids [m, k'], logprobs [m, k'])``
    feeds frontier nodes to the head (``parents``: feeding index of each
    node's parent, -1 at depth 1; ``EagleDraftHook.expand``). ``token_cost``
    None: draft the best ``max_nodes`` candidates; a float (the relative cost
    of verifying one more token): draft as many of the best ``max_nodes`` as
    ``best_node_count`` finds worth it, and ``call_cost`` (the cost of one
    ``expand_fn`` call, same units) stops expanding when a depth cannot pay
    for itself. ``counters`` (optional) counts ``expand_calls``,
    ``nodes_fed``, ``candidates``, ``invalid_children``,
    ``duplicate_children``, ``closure_repairs``."""
    counters = counters if counters is not None else Counter()
    max_nodes = int(max_nodes)
    width = min(int(topk), max_nodes)
    depth = min(int(depth), max_nodes)
    if max_nodes <= 0 or width <= 0 or depth <= 0:
        return Draft.empty()
    auto = token_cost is not None
    floor = math.log(token_cost) if auto and token_cost > 0 else -math.inf

    # candidates, one array per depth: token, parent (candidate index, -1: root),
    # score (cumulative log-prob); candidate index = generation order
    ids, lps = clean_children(root_ids, root_logprobs, width, vocab_size, counters)
    toks, pars, scores = [ids], [np.full(ids.size, -1, dtype=np.int64)], [lps]
    frontier = np.arange(ids.size)          # candidate indices, best first
    start = 0                               # candidate index of this depth's first
    fed: dict[int, int] = {}                # candidate index -> feeding index
    calls = 0
    for _ in range(1, depth):
        level = scores[-1]
        # only nodes whose descendants could still be drafted are fed
        bar = max(_nth_best(scores, max_nodes), floor)
        frontier = frontier[level[frontier - start] > bar]
        if frontier.size == 0:
            break
        if auto and call_cost > 0 and not _depth_pays(scores, level[frontier - start],
                                                      token_cost, call_cost, max_nodes, calls):
            break
        all_tok = np.concatenate(toks)
        all_par = np.concatenate(pars)
        feed_parents = np.array([fed[int(all_par[c])] if all_par[c] >= 0 else -1
                                 for c in frontier], dtype=np.int32)
        for c in frontier:
            fed[int(c)] = len(fed)
        out_ids, out_lps = expand_fn(all_tok[frontier].astype(np.int32), feed_parents, width)
        calls += 1
        counters["expand_calls"] += 1
        counters["nodes_fed"] += int(frontier.size)
        out_ids, out_lps = np.asarray(out_ids), np.asarray(out_lps)
        if out_ids.ndim != 2 or out_ids.shape[0] != frontier.size \
                or out_lps.shape != out_ids.shape:
            raise ValueError(
                f"EAGLE head expand gave ids {out_ids.shape} and log-probs {out_lps.shape} "
                f"for {frontier.size} nodes (want [{frontier.size}, k] each)")
        new_tok, new_par, new_score = [], [], []
        for row, c in enumerate(frontier):
            cid, clp = clean_children(out_ids[row], out_lps[row], width, vocab_size, counters)
            new_tok.append(cid)
            new_par.append(np.full(cid.size, c, dtype=np.int64))
            new_score.append(level[c - start] + clp)
        start += level.size
        toks.append(np.concatenate(new_tok))
        pars.append(np.concatenate(new_par))
        scores.append(np.concatenate(new_score))
        # next frontier: this depth's best ``width`` (ties: generation order)
        order = np.argsort(-scores[-1], kind="stable")[:width]
        frontier = start + order

    tok, par, score = np.concatenate(toks), np.concatenate(pars), np.concatenate(scores)
    dep = np.concatenate([np.full(s.size, d + 1) for d, s in enumerate(scores)])
    counters["candidates"] += int(tok.size)
    keep = rerank(score, dep, par, max_nodes, counters)
    if auto and keep.size:
        n = best_node_count(np.exp(score[keep]), token_cost, keep.size)
        keep = keep[:n]
    if keep.size == 0:
        return Draft.empty()
    index = np.full(tok.size, -1, dtype=np.int64)
    index[keep] = np.arange(keep.size)
    parents = np.where(par[keep] < 0, -1, index[np.maximum(par[keep], 0)])
    return Draft(tok[keep].astype(np.int32), parents.astype(np.int32),
                 np.exp(score[keep]).astype(np.float32))


def rerank(score: np.ndarray, depth: np.ndarray, parent: np.ndarray, n: int,
           counters: Counter | None = None) -> np.ndarray:
    """Indices of the best ``n`` candidates, best first (score, then shallower,
    then generation order), closed under parents: a candidate whose parent
    was not taken is skipped (never happens while a child's score is at most
    its parent's; counted as ``closure_repairs``)."""
    order = np.lexsort((np.arange(score.size), depth, -score))
    top = order[:n]
    taken = np.zeros(score.size, dtype=bool)
    taken[top] = True
    p = parent[top]
    if not np.any((p >= 0) & ~taken[np.maximum(p, 0)]):
        return top
    taken[:] = False
    out = []
    for c in order:
        if len(out) == n:
            break
        if parent[c] < 0 or taken[parent[c]]:
            taken[c] = True
            out.append(c)
        elif counters is not None:
            counters["closure_repairs"] += 1
    return np.asarray(out, dtype=np.int64)


def _depth_pays(scores: list[np.ndarray], frontier_scores: np.ndarray, token_cost: float,
                call_cost: float, max_nodes: int, calls: int) -> bool:
    """Whether one more head call can raise expected tokens per unit of time:
    its new nodes add at most the frontier's total probability (a node's
    children share its probability), against one call's cost. Counted in
    step units: 1 + token_cost per verified node + call_cost per call."""
    flat = np.sort(np.concatenate(scores))[::-1][:max_nodes]
    values = np.exp(flat)
    n = best_node_count(values, token_cost, values.size)
    gained = 1.0 + float(values[:n].sum())
    spent = 1.0 + token_cost * n + call_cost * calls
    bound = float(np.exp(frontier_scores).sum())
    return bound * spent > call_cost * gained


def path_length(draft: Draft, chain: Sequence[int] | np.ndarray) -> int:
    """How many of ``chain``'s tokens, from the first, lie on one path of
    ``draft`` from its root (a trie: at most one child per token)."""
    parents = draft.parent_array()
    tokens = draft.tokens
    at, n = -1, 0
    for tok in np.asarray(chain).tolist():
        nxt = np.flatnonzero((parents == at) & (tokens == tok))
        if nxt.size == 0:
            break
        at, n = int(nxt[0]), n + 1
    return n


# ---------------------------------------------------------------------- proposer
class _Request:
    __slots__ = ("n", "last")

    def __init__(self, n: int) -> None:
        self.n = n
        self.last: Draft | None = None      # the last draft, as verified


class Eagle2Proposer(Proposer):
    """EAGLE-2: a dynamic draft tree from a trained EAGLE head."""

    name: ClassVar[str] = "eagle2"
    drafts_trees: ClassVar[bool] = True
    auto_budget_max: ClassVar[int] = 64
    default_num_speculative_tokens: ClassVar[int | str] = "auto"
    # the head runs identically on every rank, and ranks adopt rank 0's tree
    supports_tensor_parallel: ClassVar[bool] = True
    #: ``speculative_config['model']`` is this method's own (the head folder).
    takes_model_path: ClassVar[bool] = True
    target_hook: ClassVar[str] = "vllm_specplug.vllm_adapter.v1.eagle_runner:make_eagle_hook"
    options: ClassVar[tuple[Option, ...]] = (
        Option("model", str, "",
               "folder of the trained EAGLE head (config.json and model.safetensors); "
               "required"),
        Option("depth", int, 6,
               "most depths of the draft tree (the head's root call, then at most "
               "depth - 1 expand calls per step)", minimum=1, maximum=16),
        Option("topk", int, 10,
               "children per expanded node and frontier width of the draft tree",
               minimum=1, maximum=32),
        Option("draft_vocab", int, 0,
               "tokens the head drafts over (its LM head is restricted to them, as in "
               "FR-Spec; verification is unchanged, so output is too): 0 = the head folder's "
               "draft_vocab.json when present (the tokens the target produced on the "
               "training prompts), else the whole vocabulary; N > 0 = that file's N most "
               "frequent tokens; -1 = the whole vocabulary", minimum=-1),
    )

    @classmethod
    def check_options(cls, num_speculative_tokens: int, options: dict) -> None:
        options["model"] = check_head_path(options.get("model", ""), cls.name)
        check_draft_vocab(options, cls.name)

    @classmethod
    def check_model(cls, options: dict, tokenizer: str) -> None:
        check_head_against_model(options["model"], tokenizer, cls.name)

    def __init__(self, num_speculative_tokens: int, model: str = "", depth: int = 6,
                 topk: int = 10, auto_budget: bool = False, draft_vocab: int = 0) -> None:
        self.k = int(num_speculative_tokens)
        self.model = model
        del draft_vocab  # applied by the adapter's head runner (from the options)
        self.depth = int(depth)
        self.topk = int(topk)
        self.auto_budget = bool(auto_budget)
        self.hook: EagleDraftHook | None = None
        self._requests: dict[str, _Request] = {}
        self.counts: Counter = Counter()
        self.accept_at_depth: Counter = Counter()   # depth -> steps accepted that deep
        self.drafted_at_depth: Counter = Counter()  # depth -> verified drafts that deep

    def bind_target(self, hook: EagleDraftHook) -> None:
        """Attach the head (the adapter calls this once the target is loaded)."""
        for attr in ("root", "expand", "release"):
            if not callable(getattr(hook, attr, None)):
                raise TypeError(f"EAGLE hook {type(hook).__name__} has no {attr}()")
        self.hook = hook

    # ------------------------------------------------------------------ life cycle
    def start(self, req_id: str, token_ids: Sequence[int]) -> None:
        if req_id in self._requests and self.hook is not None:
            # rebuilt (preemption, unseen steps): the head's state may be stale
            self.hook.release(req_id)
        self._requests[req_id] = _Request(len(token_ids))

    def observe(self, req_id: str, committed_ids: Sequence[int],
                target_topk: TargetTopK | None = None) -> None:
        req = self._requests[req_id]
        last, req.last = req.last, None
        if not committed_ids:
            return
        req.n += len(committed_ids)
        if last is None or not len(last):
            return
        # the last committed token is the target's own (bonus or correction)
        a = path_length(last, list(committed_ids)[:-1])
        self.counts["verified_steps"] += 1
        self.counts["accepted"] += a
        if last.scores is not None:
            self.counts["expected_accepted_milli"] += int(round(1000 * float(last.scores.sum())))
        for d in range(1, int(last.depths().max()) + 1):
            self.drafted_at_depth[d] += 1
        for d in range(1, a + 1):
            self.accept_at_depth[d] += 1

    def propose(self, req_id: str, budget: int) -> Draft:
        req = self._requests[req_id]
        req.last = None
        self.counts["steps"] += 1
        if self.hook is None:
            self.counts["unbound"] += 1
            return Draft.empty()
        n = min(int(budget), self.k)
        if n <= 0 or req.n == 0:
            return Draft.empty()
        hook = self.hook
        root_ids, root_lps = hook.root(req_id, min(self.topk, n))
        self.counts["head_calls"] += 1

        def expand(tokens: np.ndarray, parents: np.ndarray, k: int):
            self.counts["head_calls"] += 1
            return hook.expand(req_id, tokens, parents, k)

        draft = build_dynamic_tree(
            root_ids, root_lps, expand, self.depth, self.topk, n,
            token_cost=self.relative_token_cost if self.auto_budget else None,
            call_cost=float(getattr(hook, "call_cost", 0.0) or 0.0),
            vocab_size=getattr(hook, "vocab_size", None), counters=self.counts)
        if len(draft):
            self.counts["drafts"] += 1
            self.counts["nodes"] += len(draft)
            req.last = draft
        else:
            self.counts["empty_drafts"] += 1
        return draft

    def draft_cut(self, req_id: str, kept: Draft) -> None:
        """Only ``kept`` is verified (the batch-aware budget cut the rest)."""
        req = self._requests.get(req_id)
        if req is None or req.last is None:
            return
        # (in sam_eagle2, ``kept`` is the verified merged tree: SAM's nodes too)
        self.counts["nodes_cut"] += max(0, len(req.last) - len(kept))
        req.last = kept if len(kept) else None

    def finish(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        if self.hook is not None:
            self.hook.release(req_id)

    def active_requests(self) -> int:
        return len(self._requests)

    def state_nbytes(self) -> int:
        return sum(64 + (12 * len(r.last) if r.last is not None else 0)
                   for r in self._requests.values())

    def debug_stats(self) -> dict:
        """Tree sizes, head calls and acceptance per depth (all requests)."""
        c = self.counts
        steps, drafts, verified = c["steps"], c["drafts"], c["verified_steps"]
        return {
            **{k: int(v) for k, v in c.items() if k != "expected_accepted_milli"},
            "depth": self.depth, "topk": self.topk, "auto_budget": self.auto_budget,
            "mean_tree_size": round(c["nodes"] / drafts, 3) if drafts else None,
            "head_calls_per_step": round(c["head_calls"] / steps, 3) if steps else None,
            # accepted draft tokens per verified step, and what the head's
            # scores expected (calibration of the budget's estimates)
            "mean_accepted": round(c["accepted"] / verified, 4) if verified else None,
            "mean_expected": (round(c["expected_accepted_milli"] / 1000 / verified, 4)
                              if verified else None),
            # P(accepted path reaches depth d | the verified draft reaches it)
            "accept_at_depth": {str(d): round(self.accept_at_depth[d] / n, 4)
                                for d, n in sorted(self.drafted_at_depth.items()) if n},
            "head": (self.hook.stats() if callable(getattr(self.hook, "stats", None))
                     else {}),
        }
