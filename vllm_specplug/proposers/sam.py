"""SAM: suffix-automaton drafting over prompt + committed output (SAM-Decoding).

Each request owns a dynamic suffix automaton, extended only with committed
tokens. The running match is the longest suffix of the context that occurred
earlier; the draft continues from there. Two ways to continue:

* ``"frequent"`` (default): walk the automaton taking, at each step, the token
  that most often followed (occurrence counts);
* ``"first"`` (SAM-Decoding): copy what followed the match's first occurrence,
  at most ``ceil(sam_spec_factor * match_len)`` tokens.

Draft length follows match length: no draft below ``sam_min_match_len``, and
an online estimate of how often a draft from a match of this length was
accepted up to each position (shared by all requests) cuts the draft. With
``sam_min_accept_prob`` unset (default) the kept length maximises expected
tokens per unit of verify cost, (1 + sum of the estimates) / (1 +
relative_token_cost * length), with the cost of one more verified token that
the engine measures (``Proposer.relative_token_cost``): drafts are short
where verified tokens are expensive (a CPU: ~0.08 of a step each) and long
where they are nearly free (a GPU). With ``sam_min_accept_prob`` set the
draft is cut where the estimate falls below it. Weak matches draft little,
long matches up to ``num_speculative_tokens``.

Static corpus automata (``sam_corpus``, files from ``specplug build-sam``; see
``corpus_automaton``) are shared read-only by all requests; each request keeps
one (state, length) match per file, advanced with the same committed tokens.
Their draft is the corpus tokens after the match's first occurrence.

The global store (``sam_global_tokens`` > 0; ``global_store``) holds the
outputs (and, with ``sam_global_prompts``, the prompts) of this worker's
recently finished requests, added when a request finishes (``complete``),
a step's finished requests in request-id order, and (``sam_global_live``,
opt-in) running requests' outputs as they grow, in windows of LIVE_EVERY
new tokens (``_live_window``), so requests of one template running together
draft from each other as vLLM's ``suffix`` lets them: only the
output the user received (``RequestInfo.output_end``: nothing past a stop
token or ``max_tokens``, nothing of a request with stop strings). A document
whose insertion raises is dropped and counted, and costs no request its
drafts (``_add_completed``). Each request keeps its own matches in it. The
store is kept apart by tenant (``RequestInfo.tenant``: by default the
request's ``cache_salt`` and LoRA adapter; ``tenants.TenantStores``, which
also shares the budget fairly): a request reads and feeds only its tenant's
store, and a request whose tenant is None (``isolation`` "request", or the
request's own opt-out) none (docs/security.md). The acceptance estimates are
shared by all requests: they hold rates, no text.

Each step has up to three candidate drafts: the request's own automaton
("dynamic"), the global store ("global") and the static corpus ("static").
Each source keeps its own acceptance estimate per match length and position
(fed by ``observe``); the step drafts from the source whose draft, cut as
above, has the highest expected
accepted length (the sum of the estimates over the kept positions; ties:
dynamic, global, static). ``sam_corpus_bias`` set to a number restores the
fixed rule for the static corpus: its draft is used when its match length
minus the bias exceeds the request's own match length. ``match_len`` (what
``sam_tr`` compares with its threshold) is the chosen source's match length
(with the bias rule: the static length minus the bias when that is longer).
"""
from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, ClassVar, Sequence

import numpy as np

from ..budget import best_node_count
from ..options import Option, SpecPlugConfigError
from .base import SHARED, Draft, OutputEnd, Proposer, RequestInfo, TargetTopK
if TYPE_CHECKING:
    from .global_store import GlobalMatch
    from .tenants import TenantStores
from .stop_rule import LearnedStop, StopModel, StopModelError, agreement, best_cut
from .suffix_automaton import SuffixAutomaton

# Occurrence counts are kept for the 32 longest suffixes of each new token.
COUNT_DEPTH = 32
# Match lengths 1..MAX_BUCKET-1 have their own acceptance statistics; longer
# matches share the last bucket.
MAX_BUCKET = 16
# Every EXPLORE_EVERY-th draft of a bucket goes one token past the cut, so
# an estimate that fell below the threshold can recover.
EXPLORE_EVERY = 16
# Weight (in drafts) of the prior of a position past the first: the bucket's
# estimate one position earlier times the decay seen over all buckets.
PRIOR_WEIGHT = 2.0
# Acceptance counts are halved when a bucket has seen this many drafts, so the
# estimate follows the workload.
STATS_HORIZON = 4096
# Draft sources, in the order that breaks ties of expected accepted length.
SOURCES = ("dynamic", "global", "static")
# sam_global_tokens: 0 (off) or at least this many tokens.
MIN_GLOBAL_TOKENS = 1024
# Prompt lengths of requests not yet finished; the oldest are forgotten past this.
MAX_TRACKED_PROMPTS = 1 << 16
# sam_global_live: every LIVE_EVERY output tokens a running request adds its
# newest output to its tenant's store, with the LIVE_CONTEXT tokens before
# them (so consecutive windows overlap and a match can reach into a window)
LIVE_EVERY = 16
LIVE_CONTEXT = 16

logger = logging.getLogger("vllm_specplug")


class AcceptanceByMatchLength:
    """How often a draft from a match of length l was accepted through
    position i, estimated online.

    The first position has a Beta(1, 1) prior. Position i > 0 shrinks towards
    the bucket's own estimate at i - 1 times how much acceptance falls from
    position i - 1 to i over all buckets (empirical Bayes, PRIOR_WEIGHT
    drafts' weight): a deep position that was never verified is expected to
    be accepted about as often as deep positions are elsewhere, not half the
    time, so long drafts (``num_speculative_tokens`` 32) are not verified
    on the strength of a guess."""

    def __init__(self, k: int) -> None:
        self.tried = np.zeros((MAX_BUCKET + 1, k), dtype=np.float64)
        self.accepted = np.zeros((MAX_BUCKET + 1, k), dtype=np.float64)
        self.proposals = np.zeros(MAX_BUCKET + 1, dtype=np.int64)
        # bucket -> (estimates, their running sums) as lists; dropped by update
        self._rows: dict[int, tuple[list[float], list[float]]] = {}
        # bucket -> (relative cost, best length for each ceiling n (index n))
        # for the latest cost asked: one entry a bucket whatever the costs
        # (the cost is refitted every step); dropped by update
        self._best: dict[int, tuple[float, list[int]]] = {}
        # how acceptance falls from position i - 1 to i, over all buckets
        self._decay: np.ndarray | None = None

    @staticmethod
    def bucket(match_len: int) -> int:
        return min(match_len, MAX_BUCKET)

    def decay(self) -> np.ndarray:
        """Over all buckets, acceptance at position i over that at i - 1
        (each with a Beta(1, 1) prior; at most 1), for i = 1..k-1."""
        if self._decay is None:
            q = (self.accepted.sum(0) + 1.0) / (self.tried.sum(0) + 2.0)
            self._decay = np.minimum(q[1:] / q[:-1], 1.0)
        return self._decay

    def prob(self, match_len: int) -> np.ndarray:
        b = self.bucket(match_len)
        tried, accepted = self.tried[b].tolist(), self.accepted[b].tolist()
        decay = self.decay().tolist()
        out = [(accepted[0] + 1.0) / (tried[0] + 2.0)]
        for i in range(1, len(tried)):
            prior = out[-1] * decay[i - 1]
            out.append((accepted[i] + PRIOR_WEIGHT * prior) / (tried[i] + PRIOR_WEIGHT))
        return np.asarray(out)

    def _row(self, match_len: int) -> tuple[list[float], list[float]]:
        b = self.bucket(match_len)
        row = self._rows.get(b)
        if row is None:
            p = self.prob(match_len)
            row = self._rows[b] = (p.tolist(), np.cumsum(p).tolist())
        return row

    def kept(self, match_len: int, n: int, min_prob: float) -> int:
        """Positions before the first whose estimate < min_prob (no side effect)."""
        p = self._row(match_len)[0]
        for i in range(min(n, len(p))):
            if p[i] < min_prob:
                return i
        return n

    def expected(self, match_len: int, n: int) -> float:
        """Expected accepted tokens of an n-token draft: the estimates' sum."""
        return self._row(match_len)[1][n - 1] if n > 0 else 0.0

    def best_length(self, match_len: int, n: int, relative_cost: float) -> int:
        """The length (at most n) that maximises expected tokens per unit of
        verify cost, (1 + sum of the estimates) / (1 + relative_cost * length)
        (the estimates made non-increasing: a later position cannot be
        accepted more often than an earlier one); no side effect."""
        b = self.bucket(match_len)
        cached = self._best.get(b)
        if cached is None or cached[0] != relative_cost:
            cached = self._best[b] = (relative_cost, self._best_lengths(
                self._row(match_len)[0], relative_cost))
        best = cached[1]
        return best[min(n, len(best) - 1)] if n > 0 else 0

    @staticmethod
    def _best_lengths(p: list[float], relative_cost: float) -> list[int]:
        """For every ceiling n (index n, 0..len(p)): the length m <= n that
        maximises (1 + the first m non-increasing estimates' sum) /
        (1 + relative_cost * m), the shortest of equals: ``best_node_count``
        of every prefix in one pass (it runs once per bucket and update)."""
        out = [0]
        best_m, best_rate, gain, low = 0, 1.0, 1.0, 1.0
        for m, q in enumerate(p, start=1):
            low = min(low, q)
            gain += low
            rate = gain / (1.0 + relative_cost * m)
            if rate > best_rate:
                best_m, best_rate = m, rate
            out.append(best_m)
        return out

    def length(self, match_len: int, n: int, min_prob: float | None,
               relative_cost: float) -> int:
        """Draft length (no side effect): ``best_length`` when ``min_prob`` is
        None, else the positions before the first whose estimate < min_prob
        (0: never cut)."""
        if min_prob is None:
            return self.best_length(match_len, n, relative_cost)
        return self.kept(match_len, n, min_prob) if min_prob > 0 else n

    def cut(self, match_len: int, n: int, min_prob: float | None,
            relative_cost: float = 0.0) -> int:
        """``length``, one more on every EXPLORE_EVERY-th proposal of the bucket."""
        b = self.bucket(match_len)
        self.proposals[b] += 1
        keep = self.length(match_len, n, min_prob, relative_cost)
        if keep < n and self.proposals[b] % EXPLORE_EVERY == 0:
            keep += 1
        return keep

    def update(self, match_len: int, drafted: int, accepted: int) -> None:
        b = self.bucket(match_len)
        self._rows.clear()  # every bucket's deeper estimates lean on the pooled decay
        self._best.clear()
        self._decay = None
        self.tried[b, :drafted] += 1
        self.accepted[b, :accepted] += 1
        if self.tried[b, 0] >= STATS_HORIZON:
            self.tried[b] *= 0.5
            self.accepted[b] *= 0.5


def stop_rule_of(sam_stop: str, min_accept_prob: float | None) -> str:
    """The rule ``sam_stop`` names: "auto" is the table rule when its
    threshold ``sam_min_accept_prob`` is given, else the learned rule."""
    if sam_stop == "auto":
        return "table" if min_accept_prob is not None else "learned"
    return sam_stop


def corpus_paths(value: str) -> list[str]:
    """The files a ``sam_corpus`` value names (comma-separated)."""
    return [p.strip() for p in value.split(",") if p.strip()]


def open_corpora(value: str) -> list:
    """The static automata a ``sam_corpus`` value names, mapped once per process."""
    if not value:
        return []
    from .corpus_automaton import open_corpus_automaton  # numba: only when used

    return [open_corpus_automaton(p) for p in corpus_paths(value)]


def _check_global_tokens(value: int) -> str | None:
    if 0 < value < MIN_GLOBAL_TOKENS:
        return f"use 0 (no global store) or at least {MIN_GLOBAL_TOKENS}, got {value}"
    return None


def _check_global_bytes(value: int) -> str | None:
    if value:
        from .global_store import GlobalStore, tokens_for_bytes

        if tokens_for_bytes(value) < MIN_GLOBAL_TOKENS:
            need = GlobalStore(MIN_GLOBAL_TOKENS).max_nbytes()
            return (f"a store of the minimum {MIN_GLOBAL_TOKENS} tokens reserves {need} "
                    f"bytes; use 0 (no byte cap) or at least {need}, got {value}")
    return None


def _check_stop_file(value: str) -> str | None:
    try:
        StopModel.load(value or None)
    except StopModelError as e:
        return str(e)
    return None


def _check_corpus(value: str) -> str | None:
    if value.strip() and not corpus_paths(value):
        return (f"{value!r} names no file; give comma-separated paths of files from "
                f"`specplug build-sam`, or \"\" for none")
    try:
        open_corpora(value)
    except ValueError as e:
        return str(e)
    return None


def _cut(stop: LearnedStop, source: str, p: np.ndarray, cost: float):
    """(raw, q, m, rate) of a candidate from its per-position conditional
    chances ``p``: through-position chances, calibrated, and their best cut
    (expected tokens per unit of verify cost)."""
    raw = np.cumprod(p)
    q = stop.calibrated(source, raw)
    m, rate = best_cut(q, cost)
    return raw, q, m, rate


class SamProposer(Proposer):
    name: ClassVar[str] = "sam"
    # a ceiling: each draft's length comes from the learned acceptance and the
    # measured verify cost (short where drafts fail or tokens are dear)
    default_num_speculative_tokens: ClassVar[int | str] = 32
    options: ClassVar[tuple[Option, ...]] = (
        Option("sam_continuation", str, "frequent",
               "how a match is continued: the most frequent next tokens, or the "
               "tokens after its first occurrence (SAM-Decoding)",
               choices=("frequent", "first")),
        Option("sam_min_match_len", int, 1,
               "no draft when the longest earlier match is shorter than this",
               minimum=1, maximum=1024),
        Option("sam_min_accept_prob", float, None,
               "unset: keep the draft length that maximises expected tokens per unit of "
               "the verify cost this engine measures (short drafts where a verified token "
               "is expensive, as on CPUs; long ones where it is nearly free, as on GPUs); "
               "a number: cut the draft where the learned chance that it is still accepted "
               "falls below it (0: never cut)", minimum=0.0, maximum=1.0),
        Option("sam_spec_factor", float, 4.0,
               "'first': draft at most ceil(factor * match length) tokens",
               minimum=0.01, maximum=1024.0),
        Option("sam_corpus", str, "",
               "static corpus automata (files from `specplug build-sam`, built with the "
               "model's tokenizer), comma-separated; empty: none", check=_check_corpus),
        Option("sam_corpus_bias", int, None,
               "unset: choose between the request's own, global and static corpus drafts "
               "by expected accepted length; a number: draft from a static corpus match "
               "only when its length minus this exceeds the request's own match length",
               minimum=0, maximum=1024),
        Option("sam_global_tokens", int, 500_000,
               "tokens kept in the worker's global store of finished requests' outputs "
               "(about 140 bytes a token resident, 160 reserved; 0: no global store)", minimum=0,
               maximum=1 << 28, check=_check_global_tokens),
        Option("sam_global_bytes", int, 0,
               "a cap in bytes on the global store (all tenants together): its token "
               "budget becomes the largest below sam_global_tokens whose reserved bytes "
               "fit; 0: the token budget alone", minimum=0, maximum=1 << 40,
               check=_check_global_bytes),
        Option("sam_global_prompts", bool, False,
               "also add finished requests' prompts to the global store"),
        Option("sam_global_live", bool, True,
               "running requests add their output to their tenant's global store as it "
               "grows (every 16 tokens, the newest 16 with the 16 before them), so requests "
               "running together draft from each other (a batch of one template), not only "
               "from finished requests; false: only finished requests' outputs"),
        Option("sam_global_tenants", int, 16,
               "tenants (cache_salt and LoRA adapter pairs) whose global stores are kept; "
               "beyond this the store holding the fewest tokens is dropped; past "
               "sam_global_tokens in all, the largest store drops its oldest part",
               minimum=1, maximum=4096),
        Option("sam_stop", str, "auto",
               "how drafts are cut and sources chosen: 'learned', a logistic model per "
               "drafted position (match length, continuation shares, this request's recent "
               "acceptance, ...; sam_stop_file) calibrated online per source, cut where one "
               "more verified token costs more than it is expected to bring (the measured "
               "verify cost); 'table', the acceptance per match length and position learned "
               "online; 'auto': 'table' when sam_min_accept_prob is set (the table rule's "
               "threshold), else 'learned'",
               choices=("auto", "table", "learned")),
        Option("sam_stop_file", str, "",
               "'learned': the model's coefficients (a file from `specplug fit-stop`); "
               "empty: the shipped file, fitted on this project's recorded outputs",
               check=_check_stop_file),
    )

    @classmethod
    def check_options(cls, num_speculative_tokens: int, options: dict) -> None:
        stop = options.get("sam_stop", "auto")
        if stop == "learned" and options.get("sam_min_accept_prob") is not None:
            raise SpecPlugConfigError(
                "speculative_config['sam_min_accept_prob'] is the table rule's threshold and "
                "is not read with sam_stop 'learned' (which cuts by the measured verify "
                "cost); remove one of them")
        if stop_rule_of(stop, options.get("sam_min_accept_prob")) != "learned" \
                and options.get("sam_stop_file"):
            raise SpecPlugConfigError(
                "speculative_config['sam_stop_file'] is read only by the learned rule "
                "(sam_stop 'learned', or 'auto' without sam_min_accept_prob); use that rule "
                "or remove sam_stop_file")

    @classmethod
    def check_model(cls, options: dict, tokenizer: str) -> None:
        paths = corpus_paths(options.get("sam_corpus", ""))
        if not paths:
            return
        from .corpus_automaton import load_tokenizer_identity

        try:
            identity = load_tokenizer_identity(tokenizer)
        except Exception as e:  # noqa: BLE001 - any loader failure is reported
            raise SpecPlugConfigError(
                f"speculative_config['sam_corpus']: cannot load the model's tokenizer "
                f"{tokenizer!r} to check the corpus files against it: {e}") from e
        for path, automaton in zip(paths, open_corpora(options["sam_corpus"])):
            if not automaton.same_tokenizer(identity):
                built = automaton.tokenizer
                raise SpecPlugConfigError(
                    f"speculative_config['sam_corpus']: {path!r} was built with tokenizer "
                    f"{built['name']!r} (vocabulary sha256 {built['vocab_sha256'][:12]}), "
                    f"not with this model's {identity['name']!r} (vocabulary sha256 "
                    f"{identity['vocab_sha256'][:12]}); rebuild it with `specplug build-sam "
                    f"--model {tokenizer} CORPUS... -o FILE` or remove it from sam_corpus")

    def __init__(self, num_speculative_tokens: int, sam_continuation: str = "frequent",
                 sam_min_match_len: int = 1, sam_min_accept_prob: float | None = None,
                 sam_spec_factor: float = 4.0,
                 sam_corpus: str = "", sam_corpus_bias: int | None = None,
                 sam_global_tokens: int = 500_000, sam_global_bytes: int = 0,
                 sam_global_prompts: bool = False, sam_global_live: bool = True,
                 sam_global_tenants: int = 16, sam_stop: str = "auto",
                 sam_stop_file: str = "") -> None:
        self.num_speculative_tokens = int(num_speculative_tokens)
        # None: the table rule; else the learned rule (``stop_rule_of``)
        self._stop = (LearnedStop(StopModel.load(sam_stop_file or None))
                      if stop_rule_of(sam_stop, sam_min_accept_prob) == "learned" else None)
        self.continuation = sam_continuation
        self.min_match_len = int(sam_min_match_len)
        # None: draft lengths from the verify cost (``best_length``); a number:
        # the fixed threshold rule
        self.min_accept_prob = (None if sam_min_accept_prob is None
                                else float(sam_min_accept_prob))
        self.spec_factor = float(sam_spec_factor)
        self.corpora = open_corpora(sam_corpus)
        self.corpus_bias = None if sam_corpus_bias is None else int(sam_corpus_bias)
        # tenant key -> its global store (None: no global store)
        self.stores: TenantStores | None = None
        if sam_global_tokens and sam_global_bytes:
            from .global_store import tokens_for_bytes

            sam_global_tokens = min(sam_global_tokens, tokens_for_bytes(sam_global_bytes))
        if sam_global_tokens:
            # numba only when used: importing it at module import breaks vLLM's
            # in-process engines (VLLM_ENABLE_V1_MULTIPROCESSING=0), whose
            # Triton-override scan then fails on llvmlite
            from .tenants import TenantStores

            self.stores = TenantStores(sam_global_tokens, sam_global_tenants)
        self.global_prompts = bool(sam_global_prompts)
        self.global_live = bool(sam_global_live) and self.stores is not None
        # req_id -> where its last live window ended (a context index), while
        # it has state (sam_global_live)
        self._live_mark: dict[str, int] = {}
        # req_id -> its tenant key (None: it shares nothing), while it has state
        self._tenant: dict[str, object] = {}
        # req_id -> where the output its user receives ends (RequestInfo.output_end),
        # for requests that feed a store, while it has state
        self._output_end: dict[str, OutputEnd] = {}
        # req_id -> the request's matches in its tenant's global store
        self._global_matches: dict[str, GlobalMatch] = {}
        # req_id -> context length at its first start (the prompt and the first
        # output token); kept over preemptions, dropped when it completes
        self._prompt_len: dict[str, int] = {}
        # (req_id, tenant key, tokens) of requests finished since the last
        # step, added to their tenants' stores (in req_id order) before the
        # next draft
        self._completed: list[tuple[str, object, list[int]]] = []
        # req_id -> (budget, source, match length, tokens) chosen this step
        self._choice: dict[str, tuple[int, str, int, list[int]]] = {}
        self._count_depth = COUNT_DEPTH if sam_continuation == "frequent" else 0
        self._automata: dict[str, SuffixAutomaton] = {}
        # req_id -> one (state, length) match per static corpus automaton
        self._corpus_matches: dict[str, list[tuple[int, int]]] = {}
        # req_id -> (source, match length, draft tokens) of the last draft proposed
        self._pending: dict[str, tuple[str, int, list[int]]] = {}
        self.acceptance = AcceptanceByMatchLength(self.num_speculative_tokens)
        self.static_acceptance = AcceptanceByMatchLength(self.num_speculative_tokens)
        self.global_acceptance = AcceptanceByMatchLength(self.num_speculative_tokens)
        self.stats = {f"{source}_{what}": 0 for source in SOURCES
                      if source != "global" or self.stores is not None
                      for what in ("drafts", "tokens", "accepted")}
        if self.stores is not None:
            self.stats["global_store_failed_documents"] = 0
            # output tokens committed past what the user received (after a
            # stop token, past max_tokens, all of a request with stop strings),
            # kept out of the store
            self.stats["global_store_unreceived_tokens"] = 0

    @property
    def global_store(self):
        """The global store of the default tenant (requests without a
        ``cache_salt`` or LoRA adapter, and every request with ``isolation``
        "none"); None without a global store. For tests and inspection."""
        return self.stores.get(()) if self.stores is not None else None

    def _table(self, source: str) -> AcceptanceByMatchLength:
        if source == "static":
            return self.static_acceptance
        return self.global_acceptance if source == "global" else self.acceptance

    def start(self, req_id: str, token_ids: Sequence[int],
              info: RequestInfo = SHARED) -> None:
        self._pending.pop(req_id, None)
        self._choice.pop(req_id, None)
        self._automata[req_id] = SuffixAutomaton(token_ids, count_depth=self._count_depth)
        if self._stop is not None:
            self._stop.start(req_id, len(token_ids))
        if self.corpora:
            self._corpus_matches[req_id] = [c.advance_many(0, 0, token_ids)
                                            for c in self.corpora]
        if self.stores is not None:
            self._add_completed()
            if info.num_prompt_tokens is not None:   # the adapter knows it exactly
                self._prompt_len.pop(req_id, None)
                self._prompt_len[req_id] = info.num_prompt_tokens + 1
            elif req_id not in self._prompt_len:
                if len(self._prompt_len) >= MAX_TRACKED_PROMPTS:
                    del self._prompt_len[next(iter(self._prompt_len))]
                self._prompt_len[req_id] = len(token_ids)
            self._tenant[req_id] = info.tenant
            self._global_matches.pop(req_id, None)
            self._output_end.pop(req_id, None)
            if info.tenant is not None and info.output_end is not None:
                self._output_end[req_id] = info.output_end
            if info.tenant is not None:
                from .global_store import GlobalMatch

                self._global_matches[req_id] = GlobalMatch()

    def observe(self, req_id: str, committed_ids: Sequence[int],
                target_topk: TargetTopK | None = None) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is not None:
            source, match_len, draft = pending
            a = 0
            while a < len(draft) and a < len(committed_ids) - 1 and draft[a] == committed_ids[a]:
                a += 1
            self._table(source).update(match_len, len(draft), a)
            self.stats[f"{source}_accepted"] += a
        if self._stop is not None:
            self._stop.observe(req_id, 0 if pending is None else len(pending[2]),
                               0 if pending is None else a, len(committed_ids))
        self._choice.pop(req_id, None)
        self._automata[req_id].extend(committed_ids)
        if self.corpora:
            matches = self._corpus_matches[req_id]
            for i, c in enumerate(self.corpora):
                matches[i] = c.advance_many(*matches[i], committed_ids)
        match = self._global_matches.get(req_id)
        if match is not None:
            store = self.stores.peek(self._tenant[req_id])
            if store is not None:
                store.advance(match, committed_ids)
            if self.global_live:
                self._live_window(req_id)

    def _live_window(self, req_id: str) -> None:
        """``sam_global_live``: once LIVE_EVERY more output tokens reached the
        user (``RequestInfo.output_end``: none of a request with stop
        strings), they go to the request's tenant's store, with the
        LIVE_CONTEXT tokens before them, before the next draft (as finished
        outputs do, ``_add_completed``)."""
        prompt_len = self._prompt_len.get(req_id)
        if prompt_len is None:
            return
        tokens = self._automata[req_id].tokens
        out = max(prompt_len - 1, 0)
        mark = self._live_mark.get(req_id, out)
        if len(tokens) - mark < LIVE_EVERY:
            return
        stop = self._received_stop(req_id, tokens, out)
        if stop - mark < LIVE_EVERY:
            return
        self._live_mark[req_id] = stop
        self._completed.append((req_id, self._tenant[req_id],
                                tokens[max(out, mark - LIVE_CONTEXT):stop].tolist()))

    def _received_stop(self, req_id: str, tokens, out: int) -> int:
        """Where the output its user received ends in ``tokens`` (the
        request's context, its output from ``out``): ``RequestInfo.output_end``,
        or all of it when that is unknown."""
        end = self._output_end.get(req_id)
        return len(tokens) if end is None else out + end.received(tokens[out:])

    def complete(self, req_id: str) -> None:
        """The request finished: its output (with ``sam_global_prompts``, all
        its tokens) goes to the global store before the next draft, up to
        where the output its user received ends (``RequestInfo.output_end``)."""
        prompt_len = self._prompt_len.pop(req_id, None)
        sa = self._automata.get(req_id)
        tenant = self._tenant.get(req_id)
        if self.stores is None or sa is None or tenant is None:
            return
        end = self._output_end.get(req_id)
        if prompt_len is None and (end is not None or not self.global_prompts):
            # where the output begins is unknown (its prompt length was
            # forgotten past MAX_TRACKED_PROMPTS): neither the prompt nor
            # tokens past the output's end may enter
            return
        stop = len(sa.tokens)
        if end is not None:
            stop = self._received_stop(req_id, sa.tokens, max(prompt_len - 1, 0))
            self.stats["global_store_unreceived_tokens"] += len(sa.tokens) - stop
        start = 0 if self.global_prompts else max(prompt_len - 1, 0)
        tokens = sa.tokens[start:stop].tolist()
        if tokens:
            self._completed.append((req_id, tenant, tokens))

    def _add_completed(self) -> None:
        """Insert the documents of requests finished since the last step, in
        request-id order. This runs inside whichever request starts or drafts
        next, whatever its tenant, so it never raises: a document whose
        insertion raises costs only itself. It is dropped (counted in
        ``global_store_failed_documents``; logged with its traceback the first
        time, then at every power of ten of the count), never retried; the
        others still go in and the calling request drafts on."""
        if not self._completed:
            return
        completed, self._completed = self._completed, []
        for req_id, tenant, tokens in sorted(completed, key=lambda c: c[0]):
            try:
                self.stores.add(tenant, tokens)
            except Exception as e:  # noqa: BLE001 - contained here: only this output is lost
                n = self.stats["global_store_failed_documents"] + 1
                self.stats["global_store_failed_documents"] = n
                if n == 1 or math.log10(n).is_integer():
                    logger.error("vllm_specplug: sam's global store could not take the output "
                                 "of request %s (%d so far): %s: %s; that output is dropped, "
                                 "no request loses its drafts", req_id, n, type(e).__name__, e,
                                 exc_info=e if n == 1 else None)

    def _static_match(self, req_id: str) -> tuple[int, int, int]:
        """(corpus index, state, length) of the longest static match (-1: none)."""
        best = (-1, 0, 0)
        for i, (state, length) in enumerate(self._corpus_matches.get(req_id, ())):
            if length > best[2]:
                best = (i, state, length)
        return best

    def match_len(self, req_id: str) -> int:
        """Effective match length: that of the source the next draft comes from
        (with ``sam_corpus_bias`` set: the static length minus the bias when
        that is longer)."""
        if self.corpus_bias is not None:
            own = max(self._automata[req_id].match_len, self._match(req_id, "global")[0])
            return max(own, self._static_match(req_id)[2] - self.corpus_bias)
        return self._choose(req_id, self.num_speculative_tokens)[1]

    def _match(self, req_id: str, source: str) -> tuple[int, tuple[int, int] | None]:
        """(length, where) of a source's longest match: where is (corpus or
        segment index, state) for the static corpus, (segment index, state,
        store) for the request's tenant's global store."""
        if source == "dynamic":
            return self._automata[req_id].match_len, None
        if source == "static":
            corpus, state, length = self._static_match(req_id)
            return length, (corpus, state)
        match = self._global_matches.get(req_id)
        store = None if match is None else self.stores.get(self._tenant[req_id], create=False)
        if store is None or not store.segments:
            return 0, None
        store.refresh(match, self._automata[req_id].tokens)
        segment, state, length = store.best(match)
        return length, (segment, state, store)

    def _draft_tokens(self, req_id: str, source: str, length: int,
                      where: tuple[int, int] | None, budget: int) -> list[int]:
        """A source's draft from its match, before the acceptance cut."""
        n = budget if self.continuation == "frequent" else min(
            budget, max(1, math.ceil(self.spec_factor * length)))
        if source == "dynamic":
            sa = self._automata[req_id]
            if self.continuation == "frequent":
                return sa.frequent_continuation(budget, 0.0, self.min_match_len)[0]
            return sa.continuation(n, self.min_match_len)[1]
        if source == "static":
            return self.corpora[where[0]].continuation(where[1], length, budget).tolist()
        return where[2].continuation(where[0], where[1], n, self.continuation,
                                     0.0, self.min_match_len)

    def _value(self, source: str, length: int, n: int) -> tuple[float, float]:
        """(expected accepted tokens of an n-token draft after the cut, the
        first token's estimate): what the choice of source maximises."""
        if n <= 0:
            return -1.0, -1.0
        table = self._table(source)
        n = table.length(length, n, self.min_accept_prob, self.relative_token_cost)
        return table.expected(length, n), table._row(length)[0][0]

    def _needed(self, source: str, length: int, budget: int) -> int:
        """Tokens worth fetching for a ``budget`` draft: the length the cut
        will keep plus one (the cut's exploration step). The cut of a draft of
        n >= that many tokens is the same as of the full budget's, since the
        best length up to n is the best up to ``budget`` once n reaches it;
        so the walk stops there instead of at ``budget``."""
        if self.min_accept_prob == 0:   # 0: never cut
            return budget
        table = self._table(source)
        return min(budget, table.length(length, budget, self.min_accept_prob,
                                        self.relative_token_cost) + 1)

    def _choose(self, req_id: str, budget: int) -> tuple[str, int, list[int]]:
        """(source, match length, tokens) of this step's draft before the cut:
        the source with the highest ``_value``. A source whose value with a
        full-budget draft cannot beat the best so far is not continued."""
        cached = self._choice.get(req_id)
        if cached is not None and cached[0] == budget:
            return cached[1:]
        if self.stores is not None:
            self._add_completed()
        sources = [s for s in SOURCES if s != "static" or self.corpora]
        best = ("dynamic", self._automata[req_id].match_len, [])
        if self.corpus_bias is not None and self.corpora:
            # the fixed rule: a long enough static match first
            own = self._automata[req_id].match_len
            length, where = self._match(req_id, "static")
            if length - self.corpus_bias > max(own, self.min_match_len - 1):
                tokens = self._draft_tokens(req_id, "static", length, where, budget)
                if tokens:
                    best = ("static", length, tokens)
            sources.remove("static")
        if self._stop is not None and best[0] != "static":
            best = self._choose_learned(req_id, budget, sources, best)
        elif best[0] != "static":
            score = (-2.0, -2.0)
            for source in sources:
                length, where = self._match(req_id, source)
                if length < self.min_match_len or self._value(source, length, budget) <= score:
                    continue
                tokens = self._draft_tokens(req_id, source, length, where,
                                            self._needed(source, length, budget))
                value = self._value(source, length, len(tokens))
                if value > score:
                    score, best = value, (source, length, tokens)
        self._choice[req_id] = (budget, *best)
        return best

    def _choose_learned(self, req_id: str, budget: int, sources: list[str],
                        best: tuple[str, int, list[int]]) -> tuple[str, int, list[int]]:
        """``_choose`` with the learned rule: each source's full-budget draft
        scored per position (``stop_rule``), the source with the highest
        expected tokens per unit of verify cost after the cut."""
        stop, cost = self._stop, self.relative_token_cost
        sa = self._automata[req_id]
        score, chosen = 1.0, None
        drafts = []
        for source in sources:
            length, where = self._match(req_id, source)
            if length < self.min_match_len:
                continue
            shares = None
            if source == "dynamic" and self.continuation == "frequent":
                tokens, shares = sa.frequent_continuation(budget, 0.0, self.min_match_len)
            else:
                tokens = self._draft_tokens(req_id, source, length, where, budget)
            if tokens:
                drafts.append((source, length, tokens, shares))
        for source, length, tokens, shares in drafts:
            row = self._table(source)._row(length)[0]
            if stop.handles(source):
                in_prompt = source == "dynamic" and 0 <= sa.match_end() < stop.prompt_len(req_id)
                agree = agreement(tokens, [d[2] for d in drafts if d[0] != source])
                support = None if source == "dynamic" else sa.support(tokens)
                if stop.record is None:   # one numba kernel: the numbers of the numpy path
                    raw, q, m, value = stop.score(req_id, source, length, row, shares,
                                                  len(tokens), in_prompt, agree, support, cost)
                else:   # recording candidates (fit-stop): the numpy functions
                    p = stop.conditional(req_id, source, length, row, shares, len(tokens),
                                         in_prompt, agree, support)
                    stop.record(req_id, source, tokens)
                    raw, q, m, value = _cut(stop, source, p, cost)
            else:   # no coefficients for it: the table's estimates
                p = np.minimum.accumulate(np.clip(np.asarray(row[: len(tokens)]), 1e-6, 1.0))
                raw, q, m, value = _cut(stop, source, p / np.concatenate([[1.0], p[:-1]]), cost)
            if m and value > score:
                score, best, chosen = value, (source, length, tokens), (source, raw, q)
        if chosen is not None:
            stop.drafted(req_id, *chosen)
        return best

    def propose(self, req_id: str, budget: int) -> Draft:
        budget = min(budget, self.num_speculative_tokens)
        if budget <= 0:
            return Draft.empty()
        source, length, tokens = self._choose(req_id, budget)
        self._choice.pop(req_id, None)
        return self._chain(req_id, source, length, tokens)

    def _chain(self, req_id: str, source: str, match_len: int, tokens: list[int]) -> Draft:
        """The draft ``tokens`` cut by the source's learned acceptance; remembered
        for ``observe``."""
        table = self._table(source)
        q = None if self._stop is None else self._stop.pending_q(req_id, source, len(tokens))
        if tokens and q is not None:
            tokens = tokens[: self._stop.cut(source, q, self.relative_token_cost, explore=True)]
            if not tokens:
                return Draft.empty()
            self._pending[req_id] = (source, match_len, tokens)
            self.stats[f"{source}_drafts"] += 1
            self.stats[f"{source}_tokens"] += len(tokens)
            return Draft.chain(tokens, q[: len(tokens)])
        if tokens and self.min_accept_prob != 0:   # 0: never cut, the table unread
            tokens = tokens[: table.cut(match_len, len(tokens), self.min_accept_prob,
                                        self.relative_token_cost)]
        if not tokens:
            return Draft.empty()
        self._pending[req_id] = (source, match_len, tokens)
        self.stats[f"{source}_drafts"] += 1
        self.stats[f"{source}_tokens"] += len(tokens)
        return Draft.chain(tokens, np.asarray(table._row(match_len)[0][: len(tokens)]))

    def draft_cut(self, req_id: str, kept: Draft) -> None:
        pending = self._pending.get(req_id)
        if pending is None:
            return
        source, match_len, tokens = pending
        if len(kept) == 0:
            del self._pending[req_id]
        else:
            self._pending[req_id] = (source, match_len, tokens[: len(kept)])
        self.stats[f"{source}_tokens"] -= len(tokens) - len(kept)

    def finish(self, req_id: str) -> None:
        self._automata.pop(req_id, None)
        self._corpus_matches.pop(req_id, None)
        self._pending.pop(req_id, None)
        self._global_matches.pop(req_id, None)
        self._tenant.pop(req_id, None)
        self._output_end.pop(req_id, None)
        self._choice.pop(req_id, None)
        self._live_mark.pop(req_id, None)
        if self._stop is not None:
            self._stop.finish(req_id)

    def active_requests(self) -> int:
        return len(self._automata)

    def structure_sizes(self) -> dict[str, int]:
        tables = (self.acceptance, self.global_acceptance, self.static_acceptance)
        return {"sam_requests": len(self._automata), "sam_prompt_lens": len(self._prompt_len),
                "sam_completed": len(self._completed), "sam_pending": len(self._pending),
                "sam_choices": len(self._choice), "sam_corpus_matches": len(self._corpus_matches),
                "sam_global_matches": len(self._global_matches),
                "sam_tenants": len(self._tenant), "sam_output_ends": len(self._output_end),
                "sam_live_marks": len(self._live_mark),
                "sam_acceptance_cache": sum(len(t._rows) + len(t._best) for t in tables),
                "sam_stop_requests": 0 if self._stop is None else len(self._stop)}

    def state_nbytes(self) -> int:
        matches = 16 * len(self.corpora) * len(self._corpus_matches)
        matches += sum(48 * len(m.per_segment) for m in self._global_matches.values())
        return sum(sa.nbytes() for sa in self._automata.values()) + matches

    def debug_stats(self) -> dict:
        """Drafts, drafted tokens and accepted tokens from the request's own
        automaton ("dynamic"), the global store ("global") and static corpus
        automata ("static"); with a global store, its size too."""
        out = dict(self.stats)
        if self.stores is not None:
            # all tenants' stores together
            out["global_store_tokens"] = self.stores.num_tokens
            out["global_store_bytes"] = self.stores.resident_nbytes()
            out["global_store_tenants"] = len(self.stores)
            # sharing the budget (tenants.TenantStores): stores dropped whole,
            # oldest segments dropped from the largest stores
            out["global_store_tenants_dropped"] = self.stores.dropped
            out["global_store_segments_trimmed"] = self.stores.segments_trimmed
        return out
