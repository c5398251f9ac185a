"""SAM: suffix-automaton drafting over prompt + committed output (SAM-Decoding).

Each request owns a dynamic suffix automaton, extended only with committed
tokens. The running match is the longest suffix of the context that occurred
earlier; the draft continues from there. Two ways to continue:

* ``"frequent"`` (default): walk the automaton taking, at each step, the token
  that most often followed (occurrence counts), while its share is at least
  ``sam_min_token_prob``;
* ``"first"`` (SAM-Decoding): copy what followed the match's first occurrence,
  at most ``ceil(sam_spec_factor * match_len)`` tokens.

Draft length follows match length: no draft below ``sam_min_match_len``, and
an online estimate of how often a draft from a match of this length was
accepted up to each position (shared by all requests) cuts the draft where
that chance falls below ``sam_min_accept_prob``, so weak matches draft little
and long matches draft up to ``num_speculative_tokens``.

Static corpus automata (``sam_corpus``, files from ``specplug build-sam``; see
``corpus_automaton``) are shared read-only by all requests; each request keeps
one (state, length) match per file, advanced with the same committed tokens.
A step drafts from the static match when its length minus
``sam_corpus_bias`` exceeds the request's own match length: the corpus
tokens after the match's first occurrence, cut by a separate acceptance
estimate. That effective length (``match_len``) is what ``sam_tr`` compares
with its threshold.
"""
from __future__ import annotations

import math
from typing import ClassVar, Sequence

import numpy as np

from ..options import Option, SpecPlugConfigError
from .base import Draft, Proposer, TargetTopK
from .suffix_automaton import SuffixAutomaton

# Occurrence counts are kept for the 32 longest suffixes of each new token.
COUNT_DEPTH = 32
# Match lengths 1..MAX_BUCKET-1 have their own acceptance statistics; longer
# matches share the last bucket.
MAX_BUCKET = 16
# Every EXPLORE_EVERY-th draft of a bucket goes one token past the cut, so
# an estimate that fell below the threshold can recover.
EXPLORE_EVERY = 16
# Acceptance counts are halved when a bucket has seen this many drafts, so the
# estimate follows the workload.
STATS_HORIZON = 4096


class AcceptanceByMatchLength:
    """How often a draft from a match of length l was accepted through
    position i, estimated online with a Beta(1, 1) prior."""

    def __init__(self, k: int) -> None:
        self.tried = np.zeros((MAX_BUCKET + 1, k), dtype=np.float64)
        self.accepted = np.zeros((MAX_BUCKET + 1, k), dtype=np.float64)
        self.proposals = np.zeros(MAX_BUCKET + 1, dtype=np.int64)

    @staticmethod
    def bucket(match_len: int) -> int:
        return min(match_len, MAX_BUCKET)

    def prob(self, match_len: int) -> np.ndarray:
        b = self.bucket(match_len)
        return (self.accepted[b] + 1.0) / (self.tried[b] + 2.0)

    def cut(self, match_len: int, n: int, min_prob: float) -> int:
        """Draft length: positions before the first whose estimate < min_prob
        (one more on every EXPLORE_EVERY-th proposal of the bucket)."""
        b = self.bucket(match_len)
        self.proposals[b] += 1
        below = np.flatnonzero(self.prob(match_len)[:n] < min_prob)
        keep = n if below.size == 0 else int(below[0])
        if keep < n and self.proposals[b] % EXPLORE_EVERY == 0:
            keep += 1
        return keep

    def update(self, match_len: int, drafted: int, accepted: int) -> None:
        b = self.bucket(match_len)
        self.tried[b, :drafted] += 1
        self.accepted[b, :accepted] += 1
        if self.tried[b, 0] >= STATS_HORIZON:
            self.tried[b] *= 0.5
            self.accepted[b] *= 0.5


def corpus_paths(value: str) -> list[str]:
    """The files a ``sam_corpus`` value names (comma-separated)."""
    return [p.strip() for p in value.split(",") if p.strip()]


def open_corpora(value: str) -> list:
    """The static automata a ``sam_corpus`` value names, mapped once per process."""
    if not value:
        return []
    from .corpus_automaton import open_corpus_automaton  # numba: only when used

    return [open_corpus_automaton(p) for p in corpus_paths(value)]


def _check_corpus(value: str) -> str | None:
    if value.strip() and not corpus_paths(value):
        return (f"{value!r} names no file; give comma-separated paths of files from "
                f"`specplug build-sam`, or \"\" for none")
    try:
        open_corpora(value)
    except ValueError as e:
        return str(e)
    return None


class SamProposer(Proposer):
    name: ClassVar[str] = "sam"
    options: ClassVar[tuple[Option, ...]] = (
        Option("sam_continuation", str, "frequent",
               "how a match is continued: the most frequent next tokens, or the "
               "tokens after its first occurrence (SAM-Decoding)",
               choices=("frequent", "first")),
        Option("sam_min_match_len", int, 1,
               "no draft when the longest earlier match is shorter than this",
               minimum=1, maximum=1024),
        Option("sam_min_accept_prob", float, 0.1,
               "cut the draft where the learned chance that it is still accepted falls "
               "below this (0: never cut)", minimum=0.0, maximum=1.0),
        Option("sam_min_token_prob", float, 0.0,
               "'frequent': stop at a token that followed less often than this share",
               minimum=0.0, maximum=1.0),
        Option("sam_spec_factor", float, 4.0,
               "'first': draft at most ceil(factor * match length) tokens",
               minimum=0.01, maximum=1024.0),
        Option("sam_corpus", str, "",
               "static corpus automata (files from `specplug build-sam`, built with the "
               "model's tokenizer), comma-separated; empty: none", check=_check_corpus),
        Option("sam_corpus_bias", int, 5,
               "draft from a static corpus match only when its length minus this exceeds "
               "the request's own match length", minimum=0, maximum=1024),
    )

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
                 sam_min_match_len: int = 1, sam_min_accept_prob: float = 0.1,
                 sam_min_token_prob: float = 0.0, sam_spec_factor: float = 4.0,
                 sam_corpus: str = "", sam_corpus_bias: int = 5) -> None:
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.continuation = sam_continuation
        self.min_match_len = int(sam_min_match_len)
        self.min_accept_prob = float(sam_min_accept_prob)
        self.min_token_prob = float(sam_min_token_prob)
        self.spec_factor = float(sam_spec_factor)
        self.corpora = open_corpora(sam_corpus)
        self.corpus_bias = int(sam_corpus_bias)
        self._count_depth = COUNT_DEPTH if sam_continuation == "frequent" else 0
        self._automata: dict[str, SuffixAutomaton] = {}
        # req_id -> one (state, length) match per static corpus automaton
        self._corpus_matches: dict[str, list[tuple[int, int]]] = {}
        # req_id -> (source, match length, draft tokens) of the last draft proposed
        self._pending: dict[str, tuple[str, int, list[int]]] = {}
        self.acceptance = AcceptanceByMatchLength(self.num_speculative_tokens)
        self.static_acceptance = AcceptanceByMatchLength(self.num_speculative_tokens)
        self.stats = {f"{source}_{what}": 0 for source in ("dynamic", "static")
                      for what in ("drafts", "tokens", "accepted")}

    def start(self, req_id: str, token_ids: Sequence[int]) -> None:
        self._pending.pop(req_id, None)
        self._automata[req_id] = SuffixAutomaton(token_ids, count_depth=self._count_depth)
        if self.corpora:
            self._corpus_matches[req_id] = [c.advance_many(0, 0, token_ids)
                                            for c in self.corpora]

    def observe(self, req_id: str, committed_ids: Sequence[int],
                target_topk: TargetTopK | None = None) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is not None:
            source, match_len, draft = pending
            a = 0
            while a < len(draft) and a < len(committed_ids) - 1 and draft[a] == committed_ids[a]:
                a += 1
            table = self.static_acceptance if source == "static" else self.acceptance
            table.update(match_len, len(draft), a)
            self.stats[f"{source}_accepted"] += a
        self._automata[req_id].extend(committed_ids)
        if self.corpora:
            matches = self._corpus_matches[req_id]
            for i, c in enumerate(self.corpora):
                matches[i] = c.advance_many(*matches[i], committed_ids)

    def _static_match(self, req_id: str) -> tuple[int, int, int]:
        """(corpus index, state, length) of the longest static match (-1: none)."""
        best = (-1, 0, 0)
        for i, (state, length) in enumerate(self._corpus_matches.get(req_id, ())):
            if length > best[2]:
                best = (i, state, length)
        return best

    def match_len(self, req_id: str) -> int:
        """Effective match length: the request's own, or a static corpus match's
        length minus ``sam_corpus_bias`` if that is longer."""
        return max(self._automata[req_id].match_len,
                   self._static_match(req_id)[2] - self.corpus_bias)

    def propose(self, req_id: str, budget: int) -> Draft:
        budget = min(budget, self.num_speculative_tokens)
        if budget <= 0:
            return Draft.empty()
        length = self._automata[req_id].match_len
        corpus, state, static_len = self._static_match(req_id)
        if static_len - self.corpus_bias > max(length, self.min_match_len - 1):
            tokens = self.corpora[corpus].continuation(state, static_len, budget).tolist()
            draft = self._chain(req_id, "static", static_len, tokens)
            if len(draft):
                return draft
        if length < self.min_match_len:
            return Draft.empty()
        sa = self._automata[req_id]
        if self.continuation == "frequent":
            tokens, _ = sa.frequent_continuation(budget, self.min_token_prob,
                                                 self.min_match_len)
        else:
            n = min(budget, max(1, math.ceil(self.spec_factor * length)))
            _, tokens = sa.continuation(n, self.min_match_len)
        return self._chain(req_id, "dynamic", length, tokens)

    def _chain(self, req_id: str, source: str, match_len: int, tokens: list[int]) -> Draft:
        """The draft ``tokens`` cut by the source's learned acceptance; remembered
        for ``observe``."""
        table = self.static_acceptance if source == "static" else self.acceptance
        if self.min_accept_prob > 0 and tokens:
            tokens = tokens[: table.cut(match_len, len(tokens), self.min_accept_prob)]
        if not tokens:
            return Draft.empty()
        self._pending[req_id] = (source, match_len, tokens)
        self.stats[f"{source}_drafts"] += 1
        self.stats[f"{source}_tokens"] += len(tokens)
        return Draft.chain(tokens, table.prob(match_len)[: len(tokens)])

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

    def active_requests(self) -> int:
        return len(self._automata)

    def state_nbytes(self) -> int:
        matches = 16 * len(self.corpora) * len(self._corpus_matches)
        return sum(sa.nbytes() for sa in self._automata.values()) + matches

    def debug_stats(self) -> dict:
        """Drafts, drafted tokens and accepted tokens from the request's own
        automaton ("dynamic") and from static corpus automata ("static")."""
        return dict(self.stats)
