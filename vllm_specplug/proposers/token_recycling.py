"""Token Recycling (Luo et al., ACL 2025, arXiv 2408.08696): training-free
tree drafting from the target's own recycled top-k candidates.

State, shared by all requests and kept across them: an adjacency matrix whose
row t holds the k tokens the target most recently ranked highest after token
t (``-1``: not seen yet). After every verify forward, the row of each scored
position's input token (the last committed token and every draft node,
rejected ones included) is replaced by the target's top-k there.

Drafting fills a tree template breadth-first from the last committed token: a
template node is a path of candidate ranks, e.g. ``(0, 2)`` = the root's best
candidate, then that token's third candidate. Nodes whose row is still empty
are dropped with their subtrees.

Templates:

* ``"auto"`` (default): the ``num_speculative_tokens`` paths of highest
  estimated acceptance, where a path's estimate is the product of the
  measured hit rate of each rank it takes (how often the committed next token
  was the r-th candidate of the previous token's row). Re-derived as the
  rates move; a best-first selection, so a prefix of the node order is itself
  a tree (vLLM's scheduler may cut drafts to a prefix).
* ``"paper"``: the paper's shape, 80 nodes over 6 levels (8/21/25/15/8/3
  nodes per level), each level filled with the best-estimated children of the
  level above under a fixed prior over ranks; cut to the node budget.
* a path to a JSON file: a list of rank paths, e.g. ``[[0], [1], [0, 0]]``.

Per request only the last committed token is kept (and its prompt's
bigrams: "Prompts" below).

Tenants (docs/security.md): the matrix holds text other requests produced,
so there is one matrix per tenant (``RequestInfo.tenant``: by default the
request's ``cache_salt`` and LoRA adapter), at most ``tr_tenants`` of them
(the least recently used dropped whole). A request whose tenant is None
(``isolation`` "request", or its own opt-out) drafts from a matrix of its own
(a row per token it met, over the warm-start matrix when there is one),
freed when it finishes. The rank hit rates behind the templates are shared:
they are counts per rank, no text.

The bound holds under concurrency (issue 45): a running request writes to
its tenant's matrix at every step, so a tenant with running requests is
pinned (``Partitions.acquire``) and never dropped; only idle tenants are. The
full matrices alive, kept or held by a running request, are therefore at most
``tr_tenants`` (``sizes.tr_matrices``), and a tenant's matrix is never swapped
for an empty one under its running requests. When all ``tr_tenants`` slots
are pinned, a request of yet another tenant drafts from a matrix of its own,
as an opted-out request does, for its whole life (``stats.tenant_overflows``).
Why this and not empty drafts: that request still gets Token Recycling's
speed-up from its own text, it reads and feeds nobody's memory (so it is no
less isolated), and its matrix is sparse (a row per token it met) and freed
at ``finish``, the same per-request state an opted-out request already has,
counted in ``state_nbytes`` and ``sizes.tr_private_matrices``. Every way a
request leaves (finished, aborted, preempted: ``finish``, or a new ``start``
of the same id) unpins.

Prompts (``tr_prompt_bigrams``): a request's own prompt bigrams (token ->
the token after its last occurrence in the prompt, two sorted arrays, 8 bytes
a distinct prompt token) are kept with the request and read only by its own
drafts, where its matrix's row is still empty; they are never written into a
matrix, so a prompt never reaches another request (nor ``tr_save_matrix``).
"""
from __future__ import annotations

import heapq
import json
import os
import zlib
from typing import ClassVar, Sequence

import numpy as np

from ..budget import best_node_count
from ..options import Option, SpecPlugConfigError
from .base import SHARED, Draft, Proposer, RequestInfo, TargetTopK
from .tenants import Partitions

PAPER_LEVEL_SIZES = (8, 21, 25, 15, 8, 3)
# Prior hit rate per candidate rank (before measurements; also the "paper"
# template's ranking). Decreasing in rank.
PRIOR_RANK_RATE = np.array([0.45, 0.12, 0.06, 0.04, 0.03, 0.02, 0.015, 0.01])
# Templates are re-derived from the measured rates every this many updates.
RETEMPLATE_EVERY = 256
# Rate counts are halved past this many transitions, so estimates follow the workload.
RATE_HORIZON = 1 << 16
MAX_TEMPLATE_DEPTH = 16
ROW_GROWTH = 4096
SAVE_EVERY = 512
# A template file may list at most this many paths: no step verifies more
# (config.MAX_NUM_SPECULATIVE_TOKENS, vLLM's rejection-sampler limit).
MAX_TEMPLATE_NODES = 128


def _check_template(value: str) -> str | None:
    if value in ("auto", "paper"):
        return None
    if not os.path.isfile(value):
        return (f"no file {value!r}; give \"auto\", \"paper\" or the path of a JSON list "
                f"of rank paths such as [[0], [1], [0, 0]]")
    return None


def _check_save_path(value: str) -> str | None:
    if not value:
        return None
    if os.path.isdir(value):
        return f"{value!r} is a folder; give a file path such as {os.path.join(value, 'tr.npy')!r}"
    folder = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(folder):
        return f"folder {folder!r} does not exist"
    if not os.access(folder, os.W_OK):
        return f"folder {folder!r} is not writable"
    return None


def _check_matrix(value: str) -> str | None:
    if value and not os.path.isfile(value):
        return f"no file {value!r}; give the path of a .npy matrix (specplug build-tr)"
    return None


class Adjacency:
    """A tenant's matrix: row t holds the k tokens the target last ranked
    highest after token t (-1: not seen), grown ROW_GROWTH rows at a time;
    a copy of the warm-start matrix at first."""

    def __init__(self, k: int, warm: np.ndarray | None = None) -> None:
        self.k = k
        self.matrix = (warm.copy() if warm is not None
                       else np.full((0, k), -1, dtype=np.int32))

    def _ensure_rows(self, max_id: int) -> None:
        if max_id < self.matrix.shape[0]:
            return
        rows = (max_id // ROW_GROWTH + 1) * ROW_GROWTH
        grown = np.full((rows, self.k), -1, dtype=np.int32)
        grown[: self.matrix.shape[0]] = self.matrix
        self.matrix = grown

    def row(self, t: int) -> np.ndarray | None:
        return self.matrix[t] if 0 <= t < self.matrix.shape[0] else None

    def update(self, input_ids: np.ndarray, topk_ids: np.ndarray) -> None:
        """Rows ``input_ids`` become ``topk_ids`` (later rows win ties)."""
        self._ensure_rows(int(max(input_ids.max(), topk_ids.max())))
        self.matrix[input_ids, : topk_ids.shape[1]] = topk_ids

    def nbytes(self) -> int:
        return int(self.matrix.nbytes)


class PrivateAdjacency(Adjacency):
    """One request's own matrix: the rows it wrote (a dict: a request meets
    few of the vocabulary's tokens), over the warm-start matrix (read only)."""

    def __init__(self, k: int, warm: np.ndarray | None = None) -> None:
        self.k = k
        self.warm = warm
        self.rows: dict[int, np.ndarray] = {}

    def row(self, t: int) -> np.ndarray | None:
        r = self.rows.get(t)
        if r is None and self.warm is not None and 0 <= t < self.warm.shape[0]:
            return self.warm[t]
        return r

    def _set(self, t: int, values) -> None:
        r = self.row(t)
        r = np.full(self.k, -1, dtype=np.int32) if r is None else r.copy()
        r[: len(values)] = values
        self.rows[t] = r

    def update(self, input_ids: np.ndarray, topk_ids: np.ndarray) -> None:
        for t, values in zip(input_ids.tolist(), topk_ids.tolist()):
            self._set(t, values)

    def nbytes(self) -> int:
        return (4 * self.k + 100) * len(self.rows)


class PromptBigrams:
    """One request's prompt bigrams: token -> the token after its last
    occurrence in the prompt, as two sorted int32 arrays (8 bytes a distinct
    prompt token). Read by that request only; never written into a matrix."""

    def __init__(self, ids: np.ndarray) -> None:
        prev, nxt = ids[:-1][::-1], ids[1:][::-1]
        # np.unique's first index in the reversed prompt: the last occurrence
        keys, first = np.unique(prev, return_index=True)
        self.keys = keys.astype(np.int32)
        self.nexts = nxt[first].astype(np.int32)

    def next(self, t: int) -> int:
        """The token after ``t``'s last occurrence in the prompt (-1: none)."""
        i = int(np.searchsorted(self.keys, t))
        return int(self.nexts[i]) if i < self.keys.size and self.keys[i] == t else -1

    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.nexts.nbytes)


class RequestView:
    """What one request drafts from and learns into: ``adj`` (its tenant's
    matrix or its own), where a row is still empty its own prompt's bigram
    as the first candidate. Updates go to ``adj`` only."""

    def __init__(self, adj: Adjacency, prompt: PromptBigrams | None) -> None:
        self.adj = adj
        self.prompt = prompt

    def row(self, t: int) -> np.ndarray | None:
        r = self.adj.row(t)
        if self.prompt is None or (r is not None and r[0] >= 0):
            return r
        n = self.prompt.next(t)
        if n < 0:
            return r
        out = np.full(self.adj.k, -1, dtype=np.int32)
        out[0] = n
        return out

    def update(self, input_ids: np.ndarray, topk_ids: np.ndarray) -> None:
        self.adj.update(input_ids, topk_ids)

    def own_nbytes(self) -> int:
        """Bytes held for this request alone (its own matrix, its prompt's bigrams)."""
        own = self.adj.nbytes() if isinstance(self.adj, PrivateAdjacency) else 0
        return own + (self.prompt.nbytes() if self.prompt is not None else 0)


def rank_rates(prior: np.ndarray, hits: np.ndarray, total: float, k: int) -> np.ndarray:
    """Hit rate per rank: measured, with the prior as 16 pseudo-observations."""
    p = np.zeros(k)
    m = min(k, prior.size)
    p[:m] = prior[:m]
    return (hits[:k] + 16.0 * p) / (total + 16.0)


def best_first_template(rates: np.ndarray, budget: int,
                        max_depth: int = MAX_TEMPLATE_DEPTH) -> list[tuple[int, ...]]:
    """The ``budget`` rank paths of highest product of rates, best first.

    A child's value never exceeds its parent's, and a node enters the frontier
    only once its parent is taken, so every prefix of the result is a tree.
    """
    order = np.argsort(-rates, kind="stable")
    heap: list[tuple[float, int, tuple[int, ...]]] = []
    counter = 0
    for r in order:
        heapq.heappush(heap, (-float(rates[r]), counter, (int(r),)))
        counter += 1
    out: list[tuple[int, ...]] = []
    while heap and len(out) < budget:
        neg, _, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < max_depth:
            for r in order:
                heapq.heappush(heap, (neg * float(rates[r]), counter, path + (int(r),)))
                counter += 1
    return out


def paper_template(rates: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    """The paper's level sizes, each level the best children of the level above."""
    value = {(): 1.0}
    levels: list[list[tuple[int, ...]]] = [[()]]
    for size in PAPER_LEVEL_SIZES:
        cands = [(value[p] * float(rates[r]), p + (r,))
                 for p in levels[-1] for r in range(rates.size)]
        cands.sort(key=lambda c: -c[0])
        level = [path for _, path in cands[:size]]
        for v, path in cands[:size]:
            value[path] = v
        levels.append(level)
    nodes = [p for level in levels[1:] for p in level]
    # best first (parents precede children: a child's value <= its parent's;
    # ties broken by depth)
    nodes.sort(key=lambda p: (-value[p], len(p)))
    return nodes[:budget]


def load_template(path: str, k: int) -> list[tuple[int, ...]]:
    """A JSON list of rank paths; every prefix of a path must be listed."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise SpecPlugConfigError(
            f"tr_template {path!r} is not readable JSON: {e}; give a JSON list of rank paths "
            f"such as [[0], [1], [0, 0]], or \"auto\"") from e
    if not isinstance(raw, list) or not raw:
        raise SpecPlugConfigError(f"tr_template {path!r} must be a non-empty JSON list of "
                                  f"rank paths such as [[0], [1], [0, 0]]")
    if len(raw) > MAX_TEMPLATE_NODES:
        raise SpecPlugConfigError(
            f"tr_template {path!r} lists {len(raw)} paths, more than the "
            f"{MAX_TEMPLATE_NODES} nodes a step can verify; keep at most {MAX_TEMPLATE_NODES} "
            f"(best first, parents before children)")
    paths: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    for item in raw:
        if (not isinstance(item, list) or not item or not all(
                isinstance(r, int) and not isinstance(r, bool) for r in item)):
            raise SpecPlugConfigError(
                f"tr_template {path!r}: {item!r} is not a non-empty list of integer ranks")
        p = tuple(item)
        if any(not 0 <= r < k for r in p):
            raise SpecPlugConfigError(
                f"tr_template {path!r}: path {list(p)} uses a rank outside [0, tr_topk={k})")
        if p in seen:
            raise SpecPlugConfigError(f"tr_template {path!r}: path {list(p)} is listed twice")
        seen.add(p)
        paths.append(p)
    for p in paths:
        if len(p) > 1 and p[:-1] not in seen:
            raise SpecPlugConfigError(
                f"tr_template {path!r}: path {list(p)} has no parent {list(p[:-1])} listed")
    # parents first (stable: keep the file's order within a depth)
    paths.sort(key=len)
    return paths


def model_vocab_size(tokenizer: str) -> int:
    """Token ids a model can take: its tokenizer's size, or its config's
    ``vocab_size`` (padded embeddings) when that is larger."""
    from transformers import AutoConfig, AutoTokenizer

    size = len(AutoTokenizer.from_pretrained(tokenizer))
    try:
        config = AutoConfig.from_pretrained(tokenizer)
        size = max(size, int(getattr(config.get_text_config(), "vocab_size", 0) or 0))
    except Exception:  # noqa: BLE001 - a tokenizer-only folder: its size
        pass
    return size


def load_matrix(path: str, k: int) -> np.ndarray:
    """A saved adjacency matrix (.npy, no pickle): int, 2-D, at least k columns."""
    fix = "save one with tr_save_matrix, or remove tr_matrix to start empty"
    try:
        m = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise SpecPlugConfigError(
            f"tr_matrix {path!r} is not a readable .npy array (pickled files are refused): "
            f"{e}; {fix}") from e
    if not isinstance(m, np.ndarray):  # an .npz archive
        if hasattr(m, "close"):
            m.close()
        raise SpecPlugConfigError(
            f"tr_matrix {path!r} is a {type(m).__name__} (.npz archive), not a .npy array; "
            f"{fix}")
    if m.ndim != 2 or not np.issubdtype(m.dtype, np.integer):
        raise SpecPlugConfigError(
            f"tr_matrix {path!r} must be a 2-D integer array, got {m.dtype} {m.shape}; {fix}")
    if m.shape[1] < k:
        raise SpecPlugConfigError(
            f"tr_matrix {path!r} has {m.shape[1]} candidates per row; tr_topk={k} needs "
            f"at least that many: lower tr_topk to {m.shape[1]} or {fix}")
    if m.size and (m.min() < -1 or m.max() >= 2**31 - 1):
        raise SpecPlugConfigError(
            f"tr_matrix {path!r} holds values outside [-1, 2^31) (token ids, -1 for empty); "
            f"{fix}")
    return np.ascontiguousarray(m[:, :k], dtype=np.int32)


class TokenRecyclingProposer(Proposer):
    name: ClassVar[str] = "token_recycling"
    drafts_trees: ClassVar[bool] = True
    wants_target_topk: ClassVar[bool] = True
    auto_budget_max: ClassVar[int] = 64
    default_num_speculative_tokens: ClassVar[int | str] = "auto"
    options: ClassVar[tuple[Option, ...]] = (
        Option("tr_topk", int, 8, "candidates kept per token (matrix columns)",
               minimum=1, maximum=32),
        Option("tr_template", str, "auto",
               "tree template: \"auto\" (best-first from measured rank hit rates), "
               "\"paper\" (80 nodes, 6 levels) or a JSON file of rank paths",
               check=_check_template),
        Option("tr_matrix", str, "", "warm-start adjacency matrix (.npy from "
               "specplug build-tr); empty: start empty", check=_check_matrix),
        Option("tr_prompt_bigrams", bool, True,
               "the request's own drafts also follow its prompt's bigrams where the "
               "matrix knows nothing yet (kept with the request, never written into "
               "the shared matrix: no other request sees them)"),
        Option("tr_save_matrix", str, "",
               "save the matrix (.npy; with tenants, that of requests without a cache_salt "
               "or LoRA adapter) to this path every 512 updates and whenever no "
               "request is active (atomic replace); reload it with tr_matrix",
               check=_check_save_path),
        Option("tr_tenants", int, 8,
               "tenants (cache_salt and LoRA adapter pairs) whose matrices are kept (the "
               "least recently used idle one dropped beyond this; a tenant with running "
               "requests is kept, and a new tenant's request then drafts from its own "
               "text); each costs up to vocabulary size x tr_topk x 4 bytes",
               minimum=1, maximum=1024),
    )

    @classmethod
    def check_options(cls, num_speculative_tokens: int, options: dict) -> None:
        k = options["tr_topk"]
        if options["tr_template"] not in ("auto", "paper"):
            load_template(options["tr_template"], k)
        if options["tr_matrix"]:
            load_matrix(options["tr_matrix"], k)

    @classmethod
    def check_model(cls, options: dict, tokenizer: str) -> None:
        """A warm-start matrix must hold only token ids of this model (drafting
        an id past its vocabulary would crash the engine)."""
        if not options.get("tr_matrix"):
            return
        m = load_matrix(options["tr_matrix"], options["tr_topk"])
        top = int(m.max()) if m.size else -1
        if top < 0:
            return
        try:
            vocab = model_vocab_size(tokenizer)
        except Exception as e:  # noqa: BLE001 - any loader failure is reported
            raise SpecPlugConfigError(
                f"speculative_config['tr_matrix']: cannot load the model's tokenizer "
                f"{tokenizer!r} to check the matrix against it: {e}") from e
        if top >= vocab:
            raise SpecPlugConfigError(
                f"speculative_config['tr_matrix']: {options['tr_matrix']!r} holds token id "
                f"{top}, but this model has {vocab} tokens: it was made for another model; "
                f"remove tr_matrix (the matrix fills itself as requests run) or give one "
                f"saved from this model (tr_save_matrix)")

    def __init__(self, num_speculative_tokens: int, tr_topk: int = 8,
                 tr_template: str = "auto", tr_matrix: str = "",
                 tr_prompt_bigrams: bool = True, tr_save_matrix: str = "",
                 tr_tenants: int = 8, auto_budget: bool = False) -> None:
        self.save_path = tr_save_matrix
        self.budget = int(num_speculative_tokens)
        self.auto_budget = bool(auto_budget)
        self.k = int(tr_topk)
        self.target_topk_k = self.k
        self.template_kind = tr_template
        self.prompt_bigrams = bool(tr_prompt_bigrams)
        # the operator's warm-start matrix (None: start empty); read only
        self.warm = load_matrix(tr_matrix, self.k) if tr_matrix else None
        if self.warm is not None:
            self.warm.flags.writeable = False
        # tenant key -> its matrix; a tenant with running requests is pinned
        self.parts: Partitions[Adjacency] = Partitions(
            lambda: Adjacency(self.k, self.warm), int(tr_tenants))
        # req_id -> (the tenant key it pinned, None: a matrix of its own; what
        # it drafts from)
        self._adj: dict[str, tuple[object, RequestView]] = {}
        self.fixed_template = (load_template(tr_template, self.k)
                               if tr_template not in ("auto", "paper") else None)
        self.rank_hits = np.zeros(self.k + 1)   # last slot: not among the candidates
        self.transitions = 0.0
        self._updates = 0
        self._template_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._last: dict[str, int] = {}
        self.stats = {"drafts": 0, "nodes": 0, "matrix_updates": 0, "topk_misaligned": 0,
                      "tenant_overflows": 0}

    # ------------------------------------------------------------ matrix
    @property
    def matrix(self) -> np.ndarray:
        """The default tenant's matrix (requests without a ``cache_salt`` or
        LoRA adapter; every request with ``isolation`` "none"), read without
        making it or touching the tenants' order (issue 45: reading it for
        ``tr_save_matrix`` must never evict a tenant); while it does not exist,
        what it would start as (the warm-start matrix, read only, or empty)."""
        default = self.parts.peek(())
        if default is not None:
            return default.matrix
        return self.warm if self.warm is not None else np.full((0, self.k), -1, np.int32)

    def update(self, input_ids: np.ndarray, topk_ids: np.ndarray,
               adj: Adjacency | RequestView | None = None) -> None:
        """Rows ``input_ids`` of ``adj`` (default: the default tenant's
        matrix, made if missing unless every tenant slot is pinned) become
        the target's top-k (later rows win ties)."""
        input_ids = np.asarray(input_ids, dtype=np.int64)
        if input_ids.size == 0:
            return
        topk_ids = np.asarray(topk_ids)[:, : self.k]
        adj = adj or self.parts.acquire((), pin=False)
        if adj is None:
            return
        adj.update(input_ids, topk_ids)
        self.stats["matrix_updates"] += int(input_ids.size)

    def _record_transitions(self, adj: RequestView, prev: int,
                            committed: Sequence[int]) -> None:
        """Which rank of the previous token's row each committed token had."""
        for t in committed:
            t = int(t)
            row = adj.row(prev)
            if row is not None:
                hit = np.flatnonzero(row == t)
                self.rank_hits[hit[0] if hit.size else self.k] += 1
                self.transitions += 1
            prev = t
        if self.transitions > RATE_HORIZON:
            self.rank_hits *= 0.5
            self.transitions *= 0.5

    def rates(self) -> np.ndarray:
        return rank_rates(PRIOR_RANK_RATE, self.rank_hits, self.transitions, self.k)

    # ------------------------------------------------------------ template
    def template(self, budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ranks, parents, values) of the template cut to ``budget`` nodes; a
        node's value estimates the chance it lies on the accepted path."""
        cached = self._template_cache.get(budget)
        if cached is not None:
            return cached
        if self.fixed_template is not None:
            paths = self.fixed_template[:budget]
        elif self.template_kind == "paper":
            paths = paper_template(rank_rates(PRIOR_RANK_RATE, np.zeros(self.k + 1), 0, self.k),
                                   budget)
        else:
            paths = best_first_template(self.rates(), budget)
        index = {p: i for i, p in enumerate(paths)}
        ranks = np.array([p[-1] for p in paths], dtype=np.int32)
        parents = np.array([index[p[:-1]] if len(p) > 1 else -1 for p in paths],
                           dtype=np.int32)
        rates = self.rates()
        values = np.array([float(np.prod(rates[list(p)])) for p in paths])
        self._template_cache[budget] = (ranks, parents, values)
        return ranks, parents, values

    # ------------------------------------------------------------ proposer API
    def start(self, req_id: str, token_ids: Sequence[int],
              info: RequestInfo = SHARED) -> None:
        # a rebuild: the old state (and its tenant's pin) goes first
        self._release(req_id)
        self._last.pop(req_id, None)
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.size == 0:
            return
        tenant, adj = info.tenant, None
        if tenant is not None:
            # pinned while the request runs (None: every slot is pinned)
            adj = self.parts.acquire(tenant)
            if adj is None:
                self.stats["tenant_overflows"] += 1
                tenant = None
        if adj is None:
            adj = PrivateAdjacency(self.k, self.warm)
        # the prompt's bigrams stay with the request (module doc)
        prompt = PromptBigrams(ids) if self.prompt_bigrams and ids.size > 1 else None
        self._adj[req_id] = (tenant, RequestView(adj, prompt))
        self._last[req_id] = int(ids[-1])

    def _release(self, req_id: str) -> None:
        """Drop a request's matrix reference and unpin its tenant."""
        held = self._adj.pop(req_id, None)
        if held is not None and held[0] is not None:
            self.parts.unpin(held[0])

    def observe(self, req_id: str, committed_ids: Sequence[int],
                target_topk: TargetTopK | None = None) -> None:
        held = self._adj.get(req_id)
        if held is None:   # never started (or no tokens): nothing to learn into
            return
        tenant, adj = held
        if tenant is not None:
            self.parts.get(tenant, create=False)   # in use: the least recently used last
        prev = self._last.get(req_id, -1)
        # (at a request's start the first sampled token is already in its
        # state, so only later steps can be checked)
        if committed_ids and target_topk is not None and target_topk.input_ids.size \
                and prev >= 0 \
                and int(target_topk.input_ids[0]) != prev:
            # the first scored position must be the last committed token
            self.stats["topk_misaligned"] += 1
        if committed_ids:
            self._record_transitions(adj, prev, committed_ids)
            self._last[req_id] = int(committed_ids[-1])
        if target_topk is not None:
            self.update(target_topk.input_ids, target_topk.token_ids, adj)
            self._updates += 1
            if self.save_path and self._updates % SAVE_EVERY == 0:
                self.save_matrix(self.save_path)
            if self.fixed_template is None and self.template_kind == "auto" \
                    and self._updates % RETEMPLATE_EVERY == 0:
                self._template_cache.clear()

    def propose(self, req_id: str, budget: int) -> Draft:
        root = self._last.get(req_id)
        budget = min(budget, self.budget)
        adj = self._adj[req_id][1] if req_id in self._adj else None
        if root is None or adj is None or budget <= 0 or adj.row(root) is None:
            return Draft.empty()
        ranks, parents, values = self.template(budget)
        if self.auto_budget:
            # the best n nodes by value form a tree only for best-first
            # templates; other templates are cut in their own order
            n = best_node_count(np.sort(values)[::-1], self.relative_token_cost, ranks.size)
            if n == 0:
                return Draft.empty()
            ranks, parents = ranks[:n], parents[:n]
        n = ranks.size
        values = np.asarray(values[:n], dtype=np.float32)
        tokens = np.full(n, -1, dtype=np.int64)
        for i in range(n):
            p = parents[i]
            row = adj.row(int(root if p < 0 else tokens[p]))
            if row is not None:
                tokens[i] = row[ranks[i]]
        keep = tokens >= 0
        if not keep.all():
            # drop nodes whose own or an ancestor's row was empty
            for i in range(n):
                if keep[i] and parents[i] >= 0 and not keep[parents[i]]:
                    keep[i] = False
            if not keep.any():
                return Draft.empty()
            new_index = np.cumsum(keep) - 1
            kept_parents = parents[keep]
            parents_out = np.where(kept_parents < 0, -1,
                                   new_index[np.maximum(kept_parents, 0)]).astype(np.int32)
            tokens = tokens[keep]
            values = values[keep]
        else:
            parents_out = parents
        self.stats["drafts"] += 1
        self.stats["nodes"] += int(tokens.size)
        # scores: each node's estimated chance of being on the accepted path
        # (the template's values), used by batch-aware budgets
        return Draft(tokens.astype(np.int32), parents_out, values)

    def finish(self, req_id: str) -> None:
        self._release(req_id)
        if self._last.pop(req_id, None) is not None and not self._last and self.save_path:
            self.save_matrix(self.save_path)

    def active_requests(self) -> int:
        return len(self._last)

    def live_matrices(self) -> int:
        """Tenants' matrices alive: kept, or held by a running request (at
        most ``tr_tenants``: a running request's tenant is pinned)."""
        live = {id(a) for a in self.parts.values()}
        live.update(id(view.adj) for t, view in self._adj.values() if t is not None)
        return len(live)

    def structure_sizes(self) -> dict[str, int]:
        return {"tr_requests": len(self._last), "tr_template_cache": len(self._template_cache),
                "tr_private_matrices": sum(1 for t, _ in self._adj.values() if t is None),
                "tr_matrices": self.live_matrices()}

    def state_nbytes(self) -> int:
        """Per-request state (requests' own matrices and prompt bigrams
        included; the tenants' matrices: ``matrix_nbytes``)."""
        return 16 * len(self._last) + sum(view.own_nbytes() for _, view in self._adj.values())

    def matrix_nbytes(self) -> int:
        """Bytes of the default tenant's matrix (0: it does not exist)."""
        default = self.parts.peek(())
        return default.nbytes() if default is not None else 0

    def debug_stats(self) -> dict:
        default = self.parts.peek(())   # read without making or touching it
        matrix = default.matrix if default is not None else Adjacency(self.k).matrix
        return {**self.stats, "matrix_rows": int(matrix.shape[0]),
                "matrix_bytes": int(matrix.nbytes),
                "tenants": len(self.parts),
                "tenants_running": self.parts.num_pinned,
                "tenant_matrices_bytes": sum(a.nbytes() for a in self.parts.values()),
                # equal on every tensor-parallel rank (they see the same top-k)
                "matrix_crc32": zlib.crc32(np.ascontiguousarray(matrix).data),
                "rank_rates": [round(float(x), 4) for x in self.rates()]}

    def save_matrix(self, path: str) -> bool:
        """Write the default tenant's matrix as .npy, atomically (readers
        never see half a file). It is read without making or touching it, so
        saving never evicts a tenant; while it does not exist (never made, or
        dropped) nothing is written and an earlier file stays (False)."""
        default = self.parts.peek(())
        if default is None:
            return False
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            np.save(f, default.matrix, allow_pickle=False)
        os.replace(tmp, path)
        return True
