"""Hardware-aware draft budgets (Sequoia / EAGLE "auto total tokens" idea).

The cost of a target step grows with the tokens it verifies: on a GPU a few
dozen extra tokens are nearly free, on this 2-core CPU each one costs several
percent of a step. ``StepCostModel`` learns ``seconds = c0 + c_row * rows +
c_draft * draft_tokens`` from the engine's own decode steps (the drafter times
consecutive steps), robustly and starting from a prior, so the estimate is
this machine's and this model's, and what rows cost is never charged to
drafts. ``best_node_count`` then picks how many draft nodes to verify: the
count maximising expected tokens per second,

    (1 + sum of the n best nodes' acceptance estimates) / (a + b * (B + n))

for a batch of B rows (``a, b = fit(B)``; the nodes' estimates sorted in
decreasing order, each the probability that the node lies on the accepted
path).

The fit is cached per machine, model, parallel layout and verification path
(``save_fit`` / ``load_prior``): an engine starts from the previous engine's
coefficients, with more weight than the built-in prior, checks them against
its own first measurements (dropping them when they disagree) and keeps
learning. Until that check a cached fit steers only where it says drafts
are cheaper than the built-in prior does (a fit from another regime, say
large batches, never starves a new engine of the drafts it needs to check
it).
"""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import MutableMapping
from pathlib import Path

import numpy as np

# Prior: a step of one row and no drafts costs 1 + 0.08 (relative units),
# each further row 0.08 and each draft token 0.08 (what this project measured
# for SmolLM2-135M on a 2-core AVX2 CPU, where extra tokens are expensive; on
# a GPU the fit drives both towards 0 quickly).
PRIOR_A = 1.0
PRIOR_B = 0.08
PRIOR_WEIGHT = 8.0
DECAY = 0.99
# Weight of a cached fit used as the prior, and how often it is re-saved.
CACHED_PRIOR_WEIGHT = 32.0
SAVE_EVERY = 256
# A cached prior is checked against the engine's own measurements once this
# many steps were timed, with at least CHECK_DRAFT_SPREAD (standard deviation)
# of draft tokens among them; it is dropped for the built-in prior when the
# two disagree on a draft token's relative cost by more than CHECK_FACTOR.
CHECK_AFTER = 64
CHECK_DRAFT_SPREAD = 1.0
CHECK_FACTOR = 1.5
# Robust fit: a step further than HUBER_K decayed mean absolute residuals
# from the fit enters with weight HUBER_K * mad / |residual| (Huber), and its
# residual enters that mean clipped to HUBER_K * mad; one over
# STALL times the fitted cost is a stall (GC, the OS) and is ignored.
HUBER_K = 3.0
STALL = 5.0
# The fit is solved again after every step for the first REFIT_AFTER steps,
# then every REFIT_EVERY steps (it moves slowly; a solve costs about 50 us).
REFIT_AFTER = 64
REFIT_EVERY = 8
# The first HUBER_AFTER steps seed the residuals' scale with their median.
HUBER_AFTER = 16
# The prior's design points (rows, draft tokens), scaled to the measurements'
# level: they pin what the data alone cannot tell apart (the per-row cost and
# the intercept when every step had one row). Close in, so their leverage on
# the slopes is small next to steps that spread rows and drafts (at 16 they
# held a draft token's cost 27% high after 300 one-row steps drafting 0-8).
_PRIOR_POINTS = ((1.0, 0.0), (1.0, 4.0), (4.0, 0.0), (4.0, 4.0))
_PRIOR_X = np.array([[1.0, rows, drafts] for rows, drafts in _PRIOR_POINTS])
_PRIOR_XTX = _PRIOR_X.T @ _PRIOR_X
# columns kept when the fit constrains slopes to be >= 0 (StepCostModel._solve)
_SUBSETS = tuple((np.array(k), np.ix_(k, k)) for k in ((0, 1, 2), (0, 1), (0, 2), (0,)))

_BUILT_IN = (PRIOR_A, PRIOR_B, PRIOR_B, PRIOR_WEIGHT)


def _draft_share(coef: np.ndarray) -> float:
    """A draft token's cost relative to a one-row step without drafts."""
    return float(coef[2] / (coef[0] + coef[1]))


class StepCostModel:
    """Online robust least squares of step time against the step's shape,

        seconds = c0 + c_row * rows + c_draft * draft_tokens,

    from the engine's own decode steps. Rows and draft tokens are separate
    terms: what a row costs beyond its one token (sampling, output
    processing, scheduling) grows with the batch, not with the drafts, and a
    single slope over all verified tokens charged it to the drafts (a fit
    made in batches of sampled requests then read b/a = 0.31 where a draft
    token cost 0.06 of a step, and every method drafted too little).

    ``fit(rows)`` gives the line in verified tokens at that row count,
    ``(a, b)`` with ``a + b * (rows + drafts)`` the step's cost: ``b`` is a
    draft token's cost, ``a + b * rows`` a step without drafts."""

    def __init__(self, prior_a: float = PRIOR_A, prior_b: float = PRIOR_B,
                 prior_weight: float = PRIOR_WEIGHT, decay: float = DECAY,
                 prior_row: float | None = None, cached: bool = False) -> None:
        """``cached``: the prior is a cached fit (``load_prior``), checked
        against this engine's own steps (``_check_prior``) and, until then,
        steering only where it reads drafts cheaper than the built-in prior
        (``coefficients``)."""
        self.decay = decay
        self.cached = cached
        # (c0, c_row, c_draft, weight) in relative units; scaled to the
        # measurements' level (the decayed mean of seconds / prior cost), so
        # units cancel and the prior keeps its ratios to the measured step.
        self.prior = (prior_a, prior_b if prior_row is None else prior_row, prior_b,
                      prior_weight)
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self._yty = 0.0
        self._w = 0.0
        self._mad = 0.0       # decayed sum of |residual| (weight self._w)
        self._first: list[float] = []   # the first HUBER_AFTER residuals
        # draft tokens' decayed sums (weight, sum, sum of squares) for the check
        self._drafts = np.zeros(3)
        self.samples = 0
        self.prior_checked = False
        self.prior_dropped = False
        self._coef: np.ndarray | None = None
        # True while an unchecked cache reads drafts dearer than the built-in
        # prior, so the built-in solve steers (set with _coef, by coefficients)
        self._built_in_steers = False

    def _solve(self, prior: tuple) -> np.ndarray:
        c0, cr, cd, w = prior
        # the measurements' level: their seconds over what the prior says
        # the same steps cost (ratio of the weighted sums)
        modelled = c0 * self._xtx[0, 0] + cr * self._xtx[0, 1] + cd * self._xtx[0, 2]
        scale = self._xty[0] / modelled if modelled > 0 else 1.0
        # the prior's points, weight w / 4 each, at the measurements' level
        y = _PRIOR_X @ np.array([c0, cr, cd]) * scale
        pw = w / len(_PRIOR_X)
        xtx = self._xtx + pw * _PRIOR_XTX
        xty = self._xty + pw * (_PRIOR_X.T @ y)
        yty = self._yty + pw * float(y @ y)
        # least squares with both slopes >= 0 (a negative per-row or
        # per-draft cost is noise; clamping one coefficient afterwards
        # would move the fitted line): the best of the column subsets whose
        # solution has no negative slope
        best = None
        for idx, block in _SUBSETS:
            try:
                ck = np.linalg.solve(xtx[block], xty[idx])
            except np.linalg.LinAlgError:
                continue
            if (ck[1:] < 0).any():
                continue
            coef = np.zeros(3)
            coef[idx] = ck
            if len(idx) == 3:   # the unconstrained optimum is feasible
                best = (0.0, coef)
                break
            sse = yty - 2.0 * coef @ xty + coef @ xtx @ coef
            if best is None or sse < best[0]:
                best = (sse, coef)
        if best is None:
            return np.array([c0, cr, cd]) * scale
        coef = best[1]
        coef[0] = max(coef[0], 1e-9)
        return coef

    def coefficients(self) -> np.ndarray:
        """(c0, c_row, c_draft) in seconds (prior units before any step).

        A cached prior not yet checked (``_check_prior``) steers only where
        it says a draft token is cheaper than the built-in prior does: a
        cache from another regime (a batch of 24 rows verifying 9 tokens
        each read 6.7 ms a draft token where one row's cost 1.7 ms) would
        otherwise cut every draft, and with no drafts the steps never spread
        enough to check it, so it would steer the whole engine. Until the
        check the engine drafts at least as much as without a cache."""
        if self._coef is None:
            mine = self._solve(self.prior)
            self._built_in_steers = False
            if self.cached and not self.prior_checked:
                own = self._solve(_BUILT_IN)
                if _draft_share(own) < _draft_share(mine):
                    mine, self._built_in_steers = own, True
            self._coef = mine
        return self._coef

    @property
    def steering(self) -> str:
        """Which prior the coefficients come from now: "built-in", "cache",
        or "built-in (cache unchecked)" while an unchecked cache says drafts
        cost more than the built-in prior does (``coefficients``)."""
        if not self.cached or self.prior_dropped:
            return "built-in"
        self.coefficients()
        return "built-in (cache unchecked)" if self._built_in_steers else "cache"

    def fit(self, rows: int = 1) -> tuple[float, float]:
        """``(a, b)`` at ``rows`` decoding rows: a step verifying ``rows +
        d`` tokens costs ``a + b * (rows + d)`` (module doc)."""
        c0, cr, cd = self.coefficients()
        rows = max(int(rows), 1)
        base = c0 + cr * rows
        return base - cd * rows, cd

    def add(self, tokens: int, seconds: float, rows: int = 1) -> None:
        """One step of ``rows`` decoding rows that verified ``tokens`` tokens
        (rows plus draft tokens) in ``seconds``."""
        rows = max(int(rows), 1)
        drafts = tokens - rows
        if tokens <= 0 or drafts < 0 or not seconds > 0:
            return
        x = np.array([1.0, rows, drafts])
        weight = 1.0
        if self.samples:
            predicted = float(self.coefficients() @ x)
            if seconds > STALL * predicted:
                return
            residual = abs(seconds - predicted)
            if self.samples < HUBER_AFTER:
                self._first.append(residual)
                self._mad = self._mad * self.decay + residual
                if len(self._first) == HUBER_AFTER - 1:   # seed: the median
                    self._mad = float(np.median(self._first)) * self._w
                    self._first = []
            else:
                mad = self._mad / self._w
                if mad > 0 and residual > HUBER_K * mad:
                    weight = HUBER_K * mad / residual
                    residual = HUBER_K * mad   # the scale itself winsorized
                self._mad = self._mad * self.decay + residual
        d = self.decay
        self._xtx = self._xtx * d + weight * np.outer(x, x)
        self._xty = self._xty * d + weight * x * seconds
        self._yty = self._yty * d + weight * seconds * seconds
        self._w = self._w * d + 1.0
        self._drafts = self._drafts * d + np.array([1.0, drafts, drafts * drafts])
        self.samples += 1
        if self.samples <= REFIT_AFTER or self.samples % REFIT_EVERY == 0:
            self._coef = None
        if not self.prior_checked and self.samples >= CHECK_AFTER:
            self._check_prior()

    def draft_spread(self) -> float:
        """Standard deviation of the draft tokens of the steps measured."""
        w, s, ss = self._drafts
        return float(np.sqrt(max(ss / w - (s / w) ** 2, 0.0))) if w > 0 else 0.0

    def _check_prior(self) -> None:
        """A prior heavier than the built-in one (a cached fit) must agree
        with what this engine measures: once the steps measured spread their
        draft tokens enough to tell, compare a draft token's relative cost
        under that prior and under the built-in one; drop the cached prior
        when they differ by more than CHECK_FACTOR."""
        if not self.cached:
            self.prior_checked = True
            return
        if self.draft_spread() < CHECK_DRAFT_SPREAD:
            return
        self.prior_checked = True
        self._coef = None
        lo, hi = sorted((_draft_share(self._solve(_BUILT_IN)),
                         _draft_share(self._solve(self.prior))))
        if hi > CHECK_FACTOR * max(lo, 1e-6):
            self.prior = _BUILT_IN
            self.prior_dropped = True

    def relative_token_cost(self, rows: int = 1) -> float:
        """Cost of one more draft token relative to a step of ``rows``
        decoding rows without drafts."""
        a, b = self.fit(rows)
        return b / (a + b * max(rows, 1))

    def row_token_cost(self, rows: int = 1) -> float:
        """Cost of one more token relative to one row's share of a step of
        ``rows`` decoding rows, ``b / ((a + b * rows) / rows)``: what a row's
        own draft length trades against (its tokens per step, 1 + accepted,
        against its share of the step's time). At one row it is
        ``relative_token_cost(1)``; in a batch of B rows a verified token is
        B times dearer to a row than to the whole step, which is why the
        batch budget would cut a draft sized by the whole step's cost."""
        rows = max(rows, 1)
        return rows * self.relative_token_cost(rows)


def best_node_count(values_desc: np.ndarray, relative_cost: float, max_nodes: int) -> int:
    """Nodes to verify maximising (1 + sum of best values) / (1 + cost * n)."""
    v = np.asarray(values_desc, dtype=np.float64)[:max_nodes]
    if v.size == 0:
        return 0
    n = np.arange(v.size + 1)
    gain = 1.0 + np.concatenate([[0.0], np.cumsum(v)])
    rate = gain / (1.0 + relative_cost * n)
    return int(np.argmax(rate))


def save_fit(model: StepCostModel, path: Path) -> None:
    """Write the fitted coefficients (atomically; JSON)."""
    c0, cr, cd = (float(v) for v in model.coefficients())
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": 2, "c0_s": c0, "row_s": cr, "draft_s": cd,
            "ratio": cd / (c0 + cr), "samples": model.samples}
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def load_prior(path: Path) -> StepCostModel | None:
    """A model whose prior is the cached fit (its ratios to a one-row step
    without drafts), checked against the new engine's first measurements
    (``StepCostModel._check_prior``); None when there is no usable cache
    (missing, unreadable, an older format or implausible values)."""
    try:
        data = json.loads(Path(path).read_text())
        if data.get("format") != 2:
            return None
        c0, cr, cd = (float(data[k]) for k in ("c0_s", "row_s", "draft_s"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    base = c0 + cr
    if not (np.isfinite([c0, cr, cd]).all() and base > 0 and c0 >= 0 and cr >= 0
            and 0.0 <= cd / base < 10.0 and cr / base < 10.0):
        return None
    return StepCostModel(prior_a=c0 / base, prior_b=cd / base, prior_row=cr / base,
                         prior_weight=CACHED_PRIOR_WEIGHT, cached=True)


def monotone_values(values: np.ndarray, parents: np.ndarray | None) -> np.ndarray:
    """Node values made non-increasing from parent to child (a node cannot be
    on the accepted path more often than its parent)."""
    v = np.clip(np.asarray(values, dtype=np.float64), 0.0, 1.0)
    for i in range(v.size):
        p = (i - 1) if parents is None else int(parents[i])
        if p >= 0 and v[i] > v[p]:
            v[i] = v[p]
    return v



class PendingDrafts:
    """Entries for drafts awaiting verification, one per request, in
    ``pending``: the drafter's request records (which bound them), or by
    default a dict of at most ``MAX_PENDING`` (the oldest dropped beyond: a
    request the drafter never saw leave)."""

    MAX_PENDING = 1 << 16

    def __init__(self, pending: MutableMapping | None = None) -> None:
        self.bounded = pending is None
        self.pending: MutableMapping = {} if pending is None else pending

    def _put(self, req_id: str, value) -> None:
        """A request's entry, replacing its earlier one."""
        self.pending.pop(req_id, None)
        if self.bounded and len(self.pending) >= self.MAX_PENDING:
            del self.pending[next(iter(self.pending))]
        self.pending[req_id] = value

    def forget(self, req_id: str) -> None:
        self.pending.pop(req_id, None)


class AcceptanceCalibration(PendingDrafts):
    """How far the proposers' acceptance estimates are from what verification
    accepts, in batch steps: ``ratio`` = accepted tokens / expected tokens (the
    kept nodes' estimates summed), exponentially weighted, starting at 1 with
    ``PRIOR`` expected tokens' weight and kept within [MIN, MAX].
    ``allocate_batch`` scales node estimates by it, so a proposer that
    overstates its acceptance does not make large batches pay for nodes that
    are not accepted."""

    PRIOR = 16.0
    MIN, MAX = 0.25, 1.5
    DECAY = 0.995

    def __init__(self, pending: MutableMapping[str, float] | None = None) -> None:
        """``pending``: where the drafts awaiting verification are kept
        (``PendingDrafts``)."""
        super().__init__(pending)
        self.accepted = 0.0
        self.expected = 0.0
        self.settled = 0

    @property
    def ratio(self) -> float:
        r = (self.accepted + self.PRIOR) / (self.expected + self.PRIOR)
        return min(max(r, self.MIN), self.MAX)

    def expect(self, req_id: str, expected_tokens: float) -> None:
        """A request's kept draft is expected to get this many tokens accepted."""
        self._put(req_id, float(expected_tokens))

    def settle(self, req_id: str, accepted: int) -> None:
        """Verification accepted ``accepted`` draft tokens of that draft."""
        expected = self.pending.pop(req_id, None)
        if expected is None:
            return
        self.accepted = self.accepted * self.DECAY + max(int(accepted), 0)
        self.expected = self.expected * self.DECAY + expected
        self.settled += 1

    def stats(self) -> dict:
        return {"ratio": round(self.ratio, 4), "settled": self.settled,
                "accepted": round(self.accepted, 2), "expected": round(self.expected, 2)}


def expected_accepted(draft) -> float:
    """Expected accepted tokens of a scored draft: the sum of its nodes'
    (monotone) chances of lying on the accepted path; 0 without scores."""
    if draft.scores is None or len(draft) == 0:
        return 0.0
    return float(monotone_values(draft.scores, draft.parents).sum())


def allocate_batch(drafts: list, a: float, b: float, rows: int, scale: float = 1.0) -> list:
    """Batch-aware draft budgets (in the spirit of TETRIS, arXiv 2502.15197).

    One step verifies ``rows`` tokens (one per decoding request) plus the
    drafts, and costs ``a + b * tokens`` seconds. Node j of a ``Draft`` is on
    the accepted path with probability ``draft.scores[j]``. Nodes are taken
    greedily across the whole batch, most likely first, while one more node
    raises the batch's expected tokens per second::

        v > N * b / (a + b * T)   (N expected tokens out, T tokens verified)

    so speculation shrinks as the batch grows and turns off when no node is
    likely enough to pay for itself. ``scale`` multiplies every estimate
    (``AcceptanceCalibration.ratio``; capped at 1). Drafts without scores are kept whole
    (their cost counts). Returns the drafts cut to the chosen nodes: a chain
    keeps a prefix, a tree an ancestor-closed subset (values are made
    monotone from parent to child, and ties keep shallower nodes first)."""
    return allocate_batch_exploring(drafts, a, b, rows, scale)[0]


def allocate_batch_exploring(drafts: list, a: float, b: float, rows: int,
                             scale: float = 1.0, explore: int = 0,
                             margin: float = 0.5,
                             explored_masks: list | None = None,
                             row_values: list | None = None) -> tuple[list, int]:
    """``allocate_batch``, then up to ``explore`` more nodes that do not pay
    for themselves on their current estimates, the most likely first, each
    with an estimate (before ``scale``) above ``margin`` times the value it
    had to beat; returns (drafts, nodes taken that way). ``explored_masks``,
    when given (an empty list), receives per row a boolean mask over the
    returned draft's nodes: True where the node was taken by exploration.

    ``row_values`` (a draining batch, ``DrainValuation``): seconds of engine
    time one accepted token of each row saves. A node of row i is then
    worth ``v * row_values[i]`` seconds against the ``b`` its verification
    costs; nodes go most valuable first, and the bar a node of row i must
    beat is ``b / row_values[i]`` (instead of the batch's tokens per second,
    which values every row's token at its share of the step: right when a
    request that finishes early is replaced, not when the batch drains).

    Exploration: an estimate learns only from nodes that are verified, so
    without it a batch whose estimates start (or fall) below the bar never
    drafts again, however good its drafts would be. The caller sizes
    ``explore`` from a share of step time (the drafter's ``EXPLORE_SHARE``);
    ``margin`` spends it only on nodes that could plausibly pay. The margin
    reads the proposer's own estimate, not the calibrated one: calibration
    learns only from verified drafts too, so a ratio that fell to its floor
    on a few failed drafts must not stop the exploration that lets it
    recover."""
    from .draft import Draft

    n_tokens = float(rows)
    expected = float(rows)
    cands: list[tuple[float, int, int, float, float]] = []
    for i, d in enumerate(drafts):
        if d.scores is None:
            n_tokens += len(d)
            continue
        raw = monotone_values(d.scores, d.parents)
        m = np.minimum(raw * float(scale), 1.0)
        worth = 1.0 if row_values is None else float(row_values[i])
        # (-merit, index, row, estimate, value): a parent precedes its
        # children (higher or equal merit, lower index), and equal merits go
        # to shallow nodes of any row before deep ones of one row
        cands.extend((-float(x) * worth, j, i, float(r), float(x))
                     for j, (x, r) in enumerate(zip(m, raw)))
    cands.sort()
    keep = [np.zeros(len(d), dtype=bool) for d in drafts]
    explored_at: list[tuple[int, int]] = []   # (row, node) taken by exploring
    explored = 0
    for _, j, i, estimate, v in cands:
        if row_values is None:
            bar = expected * b / (a + b * n_tokens)
        else:
            bar = b / row_values[i] if row_values[i] > 0 else float("inf")
        if v <= bar:
            if explored >= explore or estimate <= margin * bar:
                break
            explored += 1
            explored_at.append((i, j))
        keep[i][j] = True
        expected += v
        n_tokens += 1
    out = []
    for d, k in zip(drafts, keep):
        if d.scores is None or k.all():
            out.append(d)
        elif not k.any():
            out.append(Draft.empty())
        else:
            out.append(subset(d, k))
    if explored_masks is not None:
        by_exploring = [np.zeros(len(d), dtype=bool) for d in drafts]
        for i, j in explored_at:
            by_exploring[i][j] = True
        explored_masks.extend(x if d.scores is None or k.all() else x[k]
                              for d, x, k in zip(drafts, by_exploring, keep))
    return out, explored


class ExplorationYield(PendingDrafts):
    """What the batch budget's exploration buys, measured: the tokens that
    explored nodes got accepted, per explored node verified, against the
    value a node had to reach to pay for itself (the bar).

    Exploration verifies nodes whose estimates say they do not pay, so that
    estimates that start (or fall) too low can recover. When explored nodes
    are accepted about as often as their estimates said, or less (a fixed
    batch of fresh requests whose drafts mostly fail), exploring confirms
    the estimates and only slows the batch: ``factor``, the yield over the
    bar (between ``MIN_FACTOR`` and 1, starting at 1 with ``PRIOR`` nodes'
    weight at the bar), scales the share of step time the drafter spends on
    it. When explored nodes pay, the factor stays at 1.

    A request's explored nodes are settled when its next step shows how many
    draft tokens were accepted: of a draft whose nodes kept on their merit
    reach depth m and whose explored nodes reach depth m + e, the explored
    nodes got ``min(max(accepted - m, 0), e)`` tokens accepted. Pending
    entries live in the drafter's request records (``pending``), as
    ``AcceptanceCalibration``'s do."""

    PRIOR = 8.0
    MIN_FACTOR = 0.1
    DECAY = 0.99

    def __init__(self, pending: MutableMapping[str, tuple[int, int, int]] | None = None) -> None:
        super().__init__(pending)
        self.hits = 0.0
        self.tries = 0.0
        self.settled = 0

    def factor(self, bar: float) -> float:
        """The share of exploration time to spend, for nodes that must reach
        ``bar`` (tokens per node) to pay."""
        if not bar > 0:
            return 1.0
        rate = (self.hits + self.PRIOR * bar) / (self.tries + self.PRIOR)
        return min(max(rate / bar, self.MIN_FACTOR), 1.0)

    def expect(self, req_id: str, merit_depth: int, explored_depth: int, nodes: int) -> None:
        """A request's kept draft: its merit nodes reach ``merit_depth``, its
        ``nodes`` explored nodes ``explored_depth`` (both from the root)."""
        if nodes <= 0:
            self.forget(req_id)
        else:
            self._put(req_id, (int(merit_depth), int(explored_depth), int(nodes)))

    def settle(self, req_id: str, accepted: int) -> None:
        entry = self.pending.pop(req_id, None)
        if entry is None:
            return
        merit, deepest, nodes = entry
        hits = min(max(int(accepted) - merit, 0), max(deepest - merit, 0))
        self.hits = self.hits * self.DECAY + hits
        self.tries = self.tries * self.DECAY + nodes
        self.settled += 1

    def stats(self, bar: float | None = None) -> dict:
        out = {"settled": self.settled, "hits": round(self.hits, 2),
               "tries": round(self.tries, 2)}
        if bar is not None:
            out["factor"] = round(self.factor(bar), 4)
        return out


class DrainValuation:
    """What an accepted token is worth when the batch drains.

    The batch budget's usual rule (``allocate_batch``) maximises the batch's
    tokens per second: a token accepted on any row is worth that row's share
    of the step, because a request that finishes earlier is replaced by the
    next one, waiting or arriving. In a batch that nothing refills (an
    offline ``LLM.generate`` of N prompts, once its queue is empty) the
    batch runs until its slowest request finishes. A token accepted on a
    row that will finish before the slowest one then saves only that row's
    own cost for a step (``c_row``); the step's fixed part (``c0``) is saved
    only when the rows that finish last get there sooner. So (``values``):

        value(row) = c_row + c0 * [row is among the last to finish] / n_last

    where a row's remaining steps are its tokens left over its tokens per
    step so far, and the last to finish are the rows within ``TIE_STEPS``
    (plus ``TIE_SHARE`` of it) of the most remaining steps. At the
    equilibrium where every row would finish together, this is the row's
    share of the step again.

    Whether finished requests' slots are refilled is learned (``note_step``):
    a request that finishes while others run opens a window of
    ``WINDOW`` steps; a request that arrives while the queue was empty and
    others ran closes every open window as refilled (1), and a window that
    expires, or that the batch's emptying closes, counts 0. ``refill`` is
    their exponentially weighted mean, starting at 0 with weight 1 (a fresh engine's first batch is valued as
    draining; one observed refill turns that off). The batch drains when
    the scheduler's queue is empty and ``refill`` is below one half; with
    the queue's length unknown it never does (the usual rule)."""

    WINDOW = 16
    DECAY = 0.8
    MAX_OPEN = 1024
    TIE_STEPS = 1.0
    TIE_SHARE = 0.05

    def __init__(self) -> None:
        self.refilled = 0.0
        self.weight = 1.0
        self.open: list[int] = []    # steps at which a finished slot opened
        self.step = 0
        self.waiting: int | None = None
        self.refills = 0
        self.expired = 0
        self.drain_steps = 0

    @property
    def refill(self) -> float:
        return self.refilled / self.weight

    def _settle(self, value: float) -> None:
        self.refilled = self.refilled * self.DECAY + value
        self.weight = self.weight * self.DECAY + 1.0

    def note_step(self, waiting: int | None, arrived: int, finished: int,
                  still_running: int) -> None:
        """One scheduler step: the queue's length after it (None: unknown),
        the requests it brings, and the requests that finished since the last
        step; ``still_running``: requests of the last step that did not finish."""
        prev_waiting, self.waiting = self.waiting, waiting
        self.step += 1
        while self.open and (self.step - self.open[0] > self.WINDOW or not still_running):
            # expired, or the batch emptied first: those slots were not refilled
            # (a batch submitted one request at a time may start with one
            # request and take the rest a step later: no refill either)
            self.open.pop(0)
            self.expired += 1
            self._settle(0.0)
        if arrived and still_running and prev_waiting == 0 and self.open:
            # a request from outside took a slot while the queue was empty
            self.refills += len(self.open)
            for _ in self.open:
                self._settle(1.0)
            self.open = []
        if finished and still_running:
            self.open.extend([self.step] * min(finished, self.MAX_OPEN - len(self.open)))

    @property
    def draining(self) -> bool:
        return self.waiting == 0 and self.refill < 0.5

    def values(self, c0: float, c_row: float, remaining: list) -> list[float]:
        """Seconds an accepted token of each row saves (class doc);
        ``remaining``: each row's expected steps left (inf: unbounded)."""
        if not remaining:
            return []
        last = max(remaining)
        if np.isinf(last):
            crit = [np.isinf(r) for r in remaining]
        else:
            tie = self.TIE_STEPS + self.TIE_SHARE * last
            crit = [r >= last - tie for r in remaining]
        n = max(sum(crit), 1)
        return [c_row + (c0 / n if c else 0.0) for c in crit]

    def stats(self) -> dict:
        return {"waiting": self.waiting, "refill": round(self.refill, 4),
                "refills": self.refills, "expired": self.expired,
                "open": len(self.open), "drain_steps": self.drain_steps}


def subset(draft, keep: np.ndarray):
    """The nodes of ``draft`` where ``keep`` (an ancestor-closed mask), with
    parents renumbered."""
    from .draft import Draft

    keep = np.asarray(keep, dtype=bool)
    parents = draft.parent_array()
    if np.any(keep & (parents >= 0) & ~keep[np.maximum(parents, 0)]):
        raise ValueError("subset: the kept nodes are not closed under parents")
    new_index = np.cumsum(keep) - 1
    kept_parents = parents[keep]
    new_parents = np.where(kept_parents < 0, -1, new_index[np.maximum(kept_parents, 0)])
    scores = None if draft.scores is None else draft.scores[keep]
    if draft.parents is None:
        return Draft.chain(draft.tokens[keep], scores)
    return Draft(draft.tokens[keep], new_parents.astype(np.int32), scores)


#: Plugin-wide keys of ``--speculative-config`` for batch-aware budgets.
BATCH_BUDGET_KEY = "batch_budget"
DISABLE_BY_BATCH_SIZE_KEY = "disable_by_batch_size"
BATCH_BUDGET_MODES = ("auto", "off")
GOODPUT_KEY = "goodput"
GOODPUT_MODES = ("on", "off")
BATCH_DRAIN_KEY = "batch_drain"
BATCH_DRAIN_MODES = ("auto", "off")


def pop_batch_options(spec: dict) -> dict:
    """Take and validate the batch-aware budget keys from a speculative config:

    * ``"batch_budget"``: ``"auto"`` (default: when two or more requests
      decode, draft nodes are shared out across the batch by ``allocate_batch``
      from the measured step cost) or ``"off"`` (every request keeps its
      proposer's draft; ``"pace"``, pacing fixed batches, was removed on
      2026-12-07: measured no faster);
    * ``"disable_by_batch_size"``: no speculation at all in steps with at
      least this many decoding requests (default: none; the automatic budget
      already turns speculation off when it stops paying);
    * ``"goodput"``: ``"on"`` (``vllm_specplug.goodput`` cuts drafts
      where measured tokens per second say they do not pay, engine-wide and
      per request) or ``"off"`` (default, until measured to pay);
    * ``"batch_drain"``: ``"auto"`` (default: when nothing waits and
      finished requests are not replaced, drafts are valued as in a
      draining batch, ``DrainValuation``) or ``"off"`` (always as if a
      finished request's slot were taken at once)."""
    from .options import SpecPlugConfigError

    mode = _pop_mode(spec, BATCH_BUDGET_KEY, BATCH_BUDGET_MODES, "auto",
                     notes={"pace": " (\"pace\" was removed on 2026-12-07: measured no faster)"})
    limit = spec.pop(DISABLE_BY_BATCH_SIZE_KEY, None)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or limit < 1):
        raise SpecPlugConfigError(
            f"speculative_config[{DISABLE_BY_BATCH_SIZE_KEY!r}] must be an integer >= 1 "
            f"(the batch size from which speculation is off), got {limit!r}")
    goodput = _pop_mode(spec, GOODPUT_KEY, GOODPUT_MODES, "off",
                        "the goodput controller: drafts cut where measured tokens per second "
                        "say they do not pay")
    drain = _pop_mode(spec, BATCH_DRAIN_KEY, BATCH_DRAIN_MODES, "auto",
                      "how drafts are valued when nothing waits and finished requests are "
                      "not replaced")
    return {BATCH_BUDGET_KEY: mode, DISABLE_BY_BATCH_SIZE_KEY: limit, GOODPUT_KEY: goodput,
            BATCH_DRAIN_KEY: drain}


def _pop_mode(spec: dict, key: str, modes: tuple, default: str, meaning: str = "",
              notes: dict | None = None) -> str:
    """``spec[key]`` (popped; ``default`` when absent), one of ``modes``, else
    a ``SpecPlugConfigError`` naming the key, the modes, what the key does
    (``meaning``) and, for a known wrong value, why (``notes``)."""
    from .options import SpecPlugConfigError

    value = spec.pop(key, default)
    if value not in modes:
        note = (notes or {}).get(value, "") if isinstance(value, str) else ""
        raise SpecPlugConfigError(
            f"speculative_config[{key!r}] must be one of {', '.join(map(repr, modes))}"
            + (f" ({meaning})" if meaning else "") + f", got {value!r}{note}")
    return value
