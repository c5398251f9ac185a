"""A learned stopping rule for ``sam``'s drafts (``sam_stop: "learned"``).

Per drafted position i of a candidate draft, a logistic model gives the
probability that token i is accepted given that tokens 0..i-1 were, from
features that are cheap at propose time (``FEATURES``): depth, match
length, the source's own online table estimate, the share of the most
frequent continuation at that depth (the request's own automaton), this
request's recent acceptance from that source (an exponentially weighted
average), tokens since the last rejection, whether the match lies in the
prompt, and how far into its output the request is. One coefficient vector
per source, fitted offline by ``specplug fit-stop`` on recorded outputs
(``bench.stop_fit``) and shipped as a small versioned JSON file
(``data/sam_stop.json``), validated on load.

The draft is cut where one more verified token no longer pays: the kept
length m maximises expected tokens per unit of verify cost,
``(1 + sum of q_0..q_{m-1}) / (1 + c * m)``, with q_i the product of the
conditional probabilities (the chance that the draft is accepted through
position i) and c the measured relative cost of one verified token
(``Proposer.relative_token_cost``, from ``budget.StepCostModel``).

Online adaptation: per source, the chance that the draft is accepted
through a position is recalibrated by bins of its estimate: each bin keeps
decayed sums of the estimates and of the outcomes of every verified
position (``observe``), and scales the estimates by their ratio (the
chosen draft is the best of several candidates, so its raw estimates run
high). A fixed-size array, whatever the traffic. Per-request state (the EWMA,
the counters) lives while the request does and is freed by ``finish``.

Plain numpy, and two numba kernels (``stop_kernels``: the scoring of a
candidate and the calibration update, run for every candidate and every
verified draft, fused so their cost is not numpy's per-call overhead
several dozen times over; imported when a ``LearnedStop`` is built, as the
global store's kernels are); no torch, no vLLM.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import numpy as np

FORMAT = "specplug-sam-stop"
VERSION = 2
#: feature names, in the coefficient order of the file
FEATURES = ("bias", "depth_log", "depth0", "match_log", "table_logit", "share_logit",
            "share_known", "cum_share_log", "ewma_logit", "ewma_drafts_log",
            "since_reject_log", "in_prompt", "generated_log", "last_full",
            "depth_x_match", "depth_x_ewma", "depth_x_table", "agree", "other_known",
            "ctx_uni", "ctx_bi", "ctx_log")
#: version 1 files (no ctx_* features) load with those coefficients at 0
V1_FEATURES = FEATURES[:19]
#: the support length (``SuffixAutomaton.support``) ctx_log counts up to
SUPPORT_CAP = 64
SOURCES = ("dynamic", "global", "static")
#: upper edges of the calibration bins of an estimate q (the last bin: up to 1)
CALIB_EDGES = np.array([0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
N_BINS = CALIB_EDGES.size + 1
#: depth bands of the calibration: position i is in band CALIB_BAND[min(i, 15)]
CALIB_BAND = np.array([0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 4])
N_BANDS = 5
#: pseudo-count (in positions) of the calibration's prior "as estimated", and
#: the decay of its sums per verified position
CALIB_PRIOR = 20.0
CALIB_DECAY = 0.9995
#: weight of the newest draft in the request's acceptance average
EWMA_RATE = 0.3
#: every EXPLORE_EVERY-th draft of a source goes one token past the cut
EXPLORE_EVERY = 16
_CLIP = 1e-3


def default_path() -> Path:
    return Path(__file__).resolve().parent.parent / "data" / "sam_stop.json"


def _logit(p: float) -> float:
    p = min(max(p, _CLIP), 1.0 - _CLIP)
    return math.log(p / (1.0 - p))


class StopModelError(ValueError):
    pass


class StopModel:
    """Coefficients per source (a missing source falls back to the table rule)."""

    def __init__(self, coef: dict[str, np.ndarray], meta: dict | None = None) -> None:
        self.coef = coef
        self.meta = meta or {}

    @classmethod
    def load(cls, path: str | Path | None = None) -> "StopModel":
        path = Path(path) if path else default_path()
        hint = "refit it with `specplug fit-stop`, or unset sam_stop_file"
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise StopModelError(f"sam_stop_file {str(path)!r}: cannot read it as JSON ({e}); "
                                 f"{hint}") from e
        return cls.from_dict(data, str(path), hint)

    @classmethod
    def from_dict(cls, data, where: str = "stop model", hint: str = "") -> "StopModel":
        def bad(msg: str) -> StopModelError:
            return StopModelError(f"sam_stop_file {where!r}: {msg}" + (f"; {hint}" if hint else ""))

        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise bad(f"not a {FORMAT} file (its 'format' must be {FORMAT!r})")
        version = data.get("version")
        if version not in (1, VERSION) or isinstance(version, bool):
            raise bad(f"version {version!r}, this plugin reads versions 1 and {VERSION}")
        names = list(V1_FEATURES if version == 1 else FEATURES)
        if list(data.get("features", ())) != names:
            raise bad(f"its features {data.get('features')!r} are not version {version}'s "
                      f"{names}")
        sources = data.get("sources")
        if not isinstance(sources, dict) or not sources:
            raise bad("'sources' must map at least one source to its coefficients")
        coef = {}
        for name, entry in sources.items():
            if name not in SOURCES:
                raise bad(f"unknown source {name!r} (known: {list(SOURCES)})")
            w = entry.get("coef") if isinstance(entry, dict) else None
            if (not isinstance(w, list) or len(w) != len(names)
                    or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                               and math.isfinite(v) and abs(v) < 1e3 for v in w)):
                raise bad(f"source {name!r}: 'coef' must be {len(names)} finite numbers "
                          f"below 1000 in size")
            coef[name] = np.zeros(len(FEATURES))   # version 1: no ctx_* terms
            coef[name][:len(names)] = w
        return cls(coef, {k: v for k, v in data.items() if k not in ("sources",)})

    def to_dict(self, meta: dict | None = None) -> dict:
        return {"format": FORMAT, "version": VERSION, "features": list(FEATURES),
                **(meta or {}),
                "sources": {s: {"coef": [round(float(v), 6) for v in w]}
                            for s, w in self.coef.items()}}


class _Request:
    __slots__ = ("prompt_len", "generated", "since_reject", "last_full", "num", "den",
                 "drafts", "pending")

    def __init__(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        self.generated = 0
        self.since_reject = 0
        self.last_full = 0.0
        # per source: decayed accepted positions and verified positions, drafts seen
        self.num = [0.0] * len(SOURCES)
        self.den = [0.0] * len(SOURCES)
        self.drafts = [0] * len(SOURCES)
        # (source index, conditional probabilities of the drafted positions)
        self.pending: tuple[int, np.ndarray] | None = None

    def ewma(self, s: int) -> float:
        """This request's recent acceptance from source ``s`` (a Beta(1, 1) prior)."""
        return (self.num[s] + 1.0) / (self.den[s] + 2.0)


def features(depths: int, match_len: int, table_p: Sequence[float],
             shares: Sequence[float] | None, ewma: float, ewma_drafts: int,
             since_reject: int, in_prompt: bool, generated: int, last_full: float,
             agree: np.ndarray | None = None,
             support: Sequence[int] | None = None) -> np.ndarray:
    """The feature matrix (``depths`` rows, ``FEATURES`` columns) of one
    candidate draft. ``table_p``: the source table's estimates that the
    draft is accepted through each position (at least ``depths`` of them);
    ``shares``: the products of the most frequent continuation's shares
    through each position (``SuffixAutomaton.frequent_continuation``), or
    None when the source does not give them; ``agree``: per position, 1
    where another source's draft has the same tokens up to there (None: no
    other source drafted); ``support``: per position, how many of the last
    tokens through it occur together in this request's own text
    (``SuffixAutomaton.support``; None for a draft copied from that text,
    the dynamic source, whose ctx_* features are 0)."""
    X = np.empty((depths, len(FEATURES)))
    d = np.arange(depths)
    X[:, 0] = 1.0
    X[:, 1] = np.log1p(d)
    X[:, 2] = d == 0
    X[:, 3] = math.log1p(match_len)
    tp = np.clip(np.asarray(table_p[:depths], dtype=np.float64), _CLIP, 1.0)
    cond = tp / np.concatenate([[1.0], tp[:-1]])
    cond = np.clip(cond, _CLIP, 1.0 - _CLIP)
    X[:, 4] = np.log(cond / (1.0 - cond))
    if shares is not None and len(shares) >= depths:
        cum = np.clip(np.asarray(shares[:depths], dtype=np.float64), _CLIP, 1.0)
        step = np.clip(cum / np.concatenate([[1.0], cum[:-1]]), _CLIP, 1.0 - _CLIP)
        X[:, 5] = np.log(step / (1.0 - step))
        X[:, 6] = 1.0
        X[:, 7] = np.log(cum)
    else:
        X[:, 5:8] = 0.0
    X[:, 8] = _logit(ewma)
    X[:, 9] = math.log1p(ewma_drafts)
    X[:, 10] = math.log1p(since_reject)
    X[:, 11] = 1.0 if in_prompt else 0.0
    X[:, 12] = math.log1p(generated)
    X[:, 13] = last_full
    X[:, 14] = X[:, 1] * X[:, 3]
    X[:, 15] = X[:, 1] * X[:, 8]
    X[:, 16] = X[:, 1] * X[:, 4]
    if agree is None:
        X[:, 17:19] = 0.0
    else:
        X[:, 17] = agree[:depths]
        X[:, 18] = 1.0
    if support is None:
        X[:, 19:22] = 0.0
    else:
        sup = np.asarray(support[:depths], dtype=np.float64)
        X[:, 19] = sup >= 1
        X[:, 20] = sup >= 2
        X[:, 21] = np.log1p(np.minimum(sup, SUPPORT_CAP))
    return X


#: log1p(depth) for depths 0..; grown on demand
_DEPTH_LOG = np.log1p(np.arange(64, dtype=np.float64))


def _cond_logit(cum: Sequence[float], depths: int) -> np.ndarray:
    """logit of cum[i] / cum[i - 1] (cum[-1] = 1), both clipped as in ``features``."""
    c = np.clip(np.asarray(cum[:depths], dtype=np.float64), _CLIP, 1.0)
    step = np.empty(depths)
    step[0] = c[0]
    np.divide(c[1:], c[:-1], out=step[1:])
    np.clip(step, _CLIP, 1.0 - _CLIP, out=step)
    return np.log(step / (1.0 - step))


def _draft_terms(w: np.ndarray, match_len: int, ewma: float, ewma_drafts: int,
                 since_reject: int, in_prompt: bool, generated: int,
                 last_full: float) -> tuple[float, float]:
    """The logit's terms that are the same at every position of one draft:
    (the constant, the coefficient of log1p(depth))."""
    ml = math.log1p(match_len)
    el = _logit(ewma)
    c = (w[0] + w[3] * ml + w[8] * el + w[9] * math.log1p(ewma_drafts)
         + w[10] * math.log1p(since_reject) + (w[11] if in_prompt else 0.0)
         + w[12] * math.log1p(generated) + w[13] * last_full)
    return c, w[1] + w[14] * ml + w[15] * el


def logits(w: np.ndarray, depths: int, match_len: int, table_p: Sequence[float],
           shares: Sequence[float] | None, ewma: float, ewma_drafts: int,
           since_reject: int, in_prompt: bool, generated: int, last_full: float,
           agree: np.ndarray | None = None,
           support: Sequence[int] | None = None) -> np.ndarray:
    """``features(...) @ w`` without building the matrix (what ``propose``
    runs: the per-draft features enter as one constant)."""
    global _DEPTH_LOG
    if depths > _DEPTH_LOG.size:
        _DEPTH_LOG = np.log1p(np.arange(2 * depths, dtype=np.float64))
    dl = _DEPTH_LOG[:depths]
    tl = _cond_logit(table_p, depths)
    c, a1 = _draft_terms(w, match_len, ewma, ewma_drafts, since_reject, in_prompt, generated,
                         last_full)
    z = a1 * dl
    z += (w[4] + w[16] * dl) * tl
    z += c
    z[0] += w[2]
    if shares is not None and len(shares) >= depths:
        z += w[5] * _cond_logit(shares, depths)
        z += w[7] * np.log(np.clip(np.asarray(shares[:depths], dtype=np.float64), _CLIP, 1.0))
        z += w[6]
    if agree is not None:
        z += w[17] * agree[:depths]
        z += w[18]
    if support is not None:
        sup = np.asarray(support[:depths], dtype=np.float64)
        z += w[19] * (sup >= 1) + w[20] * (sup >= 2)
        z += w[21] * np.log1p(np.minimum(sup, SUPPORT_CAP))
    return z


def agreement(tokens: Sequence[int], others: Sequence[Sequence[int]]) -> np.ndarray | None:
    """Per position of ``tokens``: 1.0 where some other draft has the same
    tokens from the first through that position; None without others."""
    if not others:
        return None
    out = np.zeros(len(tokens))
    for other in others:
        n = min(len(tokens), len(other))
        i = 0
        while i < n and tokens[i] == other[i]:
            i += 1
        out[:i] = 1.0
    return out


def best_cut(q: np.ndarray, relative_cost: float) -> tuple[int, float]:
    """(m, rate): the length m (0..len(q)) maximising the step's expected
    tokens per unit of verify cost, rate = (1 + q_0 + ... + q_{m-1}) / (1 +
    relative_cost * m), the shortest of equals. One more token is kept
    while its chance q_m exceeds relative_cost times the rate so far: its
    expected gain against its measured cost."""
    best_m, best_rate, gain = 0, 1.0, 1.0
    for m, v in enumerate(q.tolist(), start=1):
        gain += v
        rate = gain / (1.0 + relative_cost * m)
        if rate > best_rate:
            best_m, best_rate = m, rate
    return best_m, best_rate


_EMPTY = np.empty(0)


class LearnedStop:
    """The learned rule with its online calibration and per-request state."""

    def __init__(self, model: StopModel) -> None:
        from . import stop_kernels   # numba: only when the rule is used

        self._kernels = stop_kernels
        self.model = model
        # per source and bin: decayed sums of estimates and of outcomes
        self.calib_est = np.zeros((len(SOURCES), N_BANDS, N_BINS))
        self.calib_hit = np.zeros((len(SOURCES), N_BANDS, N_BINS))
        self.proposals = [0] * len(SOURCES)
        self._req: dict[str, _Request] = {}
        # the last candidate's feature matrix, and a callback given each
        # candidate (req_id, source, tokens) after it is scored: for
        # ``bench.stop_fit``'s recording replay (None: off)
        self.last_features: np.ndarray | None = None
        self.record = None

    def handles(self, source: str) -> bool:
        return source in self.model.coef

    # ------------------------------------------------------------ requests
    def start(self, req_id: str, context_len: int) -> None:
        old = self._req.get(req_id)
        if old is None:   # a preempted request keeps its counters
            self._req[req_id] = _Request(context_len)
        else:
            old.pending = None

    def finish(self, req_id: str) -> None:
        self._req.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._req)

    # ------------------------------------------------------------ scoring
    def conditional(self, req_id: str, source: str, match_len: int, table_p: Sequence[float],
                    shares: Sequence[float] | None, depths: int, in_prompt: bool,
                    agree: np.ndarray | None = None,
                    support: Sequence[int] | None = None) -> np.ndarray:
        """Per position, the probability of acceptance given the positions
        before (the model's raw estimates)."""
        r = self._req[req_id]
        s = SOURCES.index(source)
        args = (depths, match_len, table_p, shares, r.ewma(s), r.drafts[s], r.since_reject,
                in_prompt, r.generated, r.last_full, agree, support)
        if self.record is not None:
            self.last_features = features(*args)
        z = logits(self.model.coef[source], *args)
        return 1.0 / (1.0 + np.exp(-z))

    def calibrated(self, source: str, q: np.ndarray) -> np.ndarray:
        """The chances of acceptance through each position, ``q`` (raw,
        non-increasing) scaled by the source's calibration of their bins,
        kept non-increasing and at most 1."""
        s = SOURCES.index(source)
        b = np.searchsorted(CALIB_EDGES, q, side="right")
        d = CALIB_BAND[np.minimum(np.arange(q.size), CALIB_BAND.size - 1)]
        # the prior: CALIB_PRIOR positions whose outcomes matched their estimate q
        ratio = ((self.calib_hit[s, d, b] + CALIB_PRIOR * q)
                 / (self.calib_est[s, d, b] + CALIB_PRIOR * q))
        return np.minimum.accumulate(np.minimum(q * ratio, 1.0))

    def score(self, req_id: str, source: str, match_len: int, table_p: Sequence[float],
              shares: Sequence[float] | None, depths: int, in_prompt: bool,
              agree: np.ndarray | None, support: Sequence[int] | None,
              relative_cost: float) -> tuple[np.ndarray, np.ndarray, int, float]:
        """(raw, q, m, rate) of a candidate: ``np.cumprod(conditional(...))``,
        its ``calibrated`` chances and their ``best_cut``, computed by one
        numba kernel (``stop_kernels.score_kernel``; a test holds it to the numpy
        functions)."""
        r = self._req[req_id]
        s = SOURCES.index(source)
        w = self.model.coef[source]
        c, a1 = _draft_terms(w, match_len, r.ewma(s), r.drafts[s], r.since_reject, in_prompt,
                             r.generated, r.last_full)
        sh = (np.asarray(shares[:depths], dtype=np.float64)
              if shares is not None and len(shares) >= depths else _EMPTY)
        ag = _EMPTY if agree is None else np.asarray(agree[:depths], dtype=np.float64)
        sp = _EMPTY if support is None else np.asarray(support[:depths], dtype=np.float64)
        tp = np.asarray(table_p[:depths], dtype=np.float64)
        if tp.size < depths or (agree is not None and ag.size < depths) or (
                support is not None and sp.size < depths):
            raise ValueError(f"score: fewer estimates than the draft's {depths} positions")
        return self._kernels.score_kernel(w, depths, float(c), float(a1), tp, sh, ag, sp,
                                          self.calib_hit[s], self.calib_est[s], CALIB_EDGES,
                                          CALIB_BAND, CALIB_PRIOR, float(relative_cost), _CLIP,
                                          float(SUPPORT_CAP))

    def cut(self, source: str, q: np.ndarray, relative_cost: float, explore: bool) -> int:
        """Kept length of a draft whose calibrated chances are ``q``
        (``best_cut``); with ``explore``, one more on every
        EXPLORE_EVERY-th draft of the source."""
        m = best_cut(q, relative_cost)[0]
        if explore:
            s = SOURCES.index(source)
            self.proposals[s] += 1
            if m < q.size and self.proposals[s] % EXPLORE_EVERY == 0:
                m += 1
        return m

    def prompt_len(self, req_id: str) -> int:
        """Tokens of the request's context at its start, less the prefill's
        output token: a match ending before it copies the prompt."""
        return self._req[req_id].prompt_len - 1

    def drafted(self, req_id: str, source: str, raw: np.ndarray, q: np.ndarray) -> None:
        """The chosen draft: its raw and calibrated chances of acceptance
        through each position, for ``_chain`` and ``observe``."""
        self._req[req_id].pending = (SOURCES.index(source), raw, q)

    def pending_q(self, req_id: str, source: str, n: int) -> np.ndarray | None:
        """The calibrated chances of the chosen draft's first n tokens (None:
        the draft was not chosen by this rule, e.g. ``sam_corpus_bias``'s)."""
        pending = self._req[req_id].pending
        if pending is None or SOURCES[pending[0]] != source or pending[2].size < n:
            return None
        return pending[2][:n]

    # ------------------------------------------------------------ feedback
    def observe(self, req_id: str, drafted: int, accepted: int, committed: int) -> None:
        """A step's outcome: ``drafted`` tokens verified (after any cut by the
        adapter), ``accepted`` of them, ``committed`` tokens added."""
        r = self._req.get(req_id)
        if r is None:
            return
        r.generated += committed
        pending, r.pending = r.pending, None
        if pending is None or drafted <= 0:
            r.since_reject += committed
            return
        s, raw, _ = pending
        rejected = accepted < drafted
        r.since_reject = 1 if rejected else r.since_reject + committed
        r.last_full = 0.0 if rejected else 1.0
        r.num[s] = (1 - EWMA_RATE) * r.num[s] + accepted
        r.den[s] = (1 - EWMA_RATE) * r.den[s] + accepted + (1 if rejected else 0)
        r.drafts[s] += 1
        n = min(drafted, raw.size)
        self._kernels.calibrate_kernel(self.calib_est[s], self.calib_hit[s], raw, n, accepted,
                                       CALIB_DECAY ** n, CALIB_EDGES, CALIB_BAND)
