"""Hardware-aware draft budgets (Sequoia / EAGLE "auto total tokens" idea).

The cost of a target step grows with the tokens it verifies: on a GPU a few
dozen extra tokens are nearly free, on this 2-core CPU each one costs several
percent of a step. ``StepCostModel`` learns ``seconds = a + b * tokens`` from
the engine's own decode steps (the drafter times consecutive steps), starting
from a prior, so the estimate is this machine's, this model's and this batch
size's. ``best_node_count`` then picks how many draft nodes to verify: the
count maximising expected tokens per second,

    (1 + sum of the n best nodes' acceptance estimates) / (a + b * (B + n))

for a batch of B rows (the nodes' estimates sorted in decreasing order, each
the probability that the node lies on the accepted path).

The fit is cached per machine, model and parallel layout (``save_fit`` /
``load_prior``): an engine starts from the cost ratio b / a the previous
engine measured, with more weight than the built-in prior, and keeps
learning.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

# Prior: a step of one token costs 1 (relative units), each extra token 0.08
# (what this project measured for SmolLM2-135M on a 2-core AVX2 CPU, where
# extra tokens are expensive; on a GPU the fit drives b towards 0 quickly).
PRIOR_A = 1.0
PRIOR_B = 0.08
PRIOR_WEIGHT = 8.0
DECAY = 0.99
# Weight of a cached fit used as the prior, and how often it is re-saved.
CACHED_PRIOR_WEIGHT = 32.0
SAVE_EVERY = 256


class StepCostModel:
    """Online weighted least squares of step time against tokens in the step."""

    def __init__(self, prior_a: float = PRIOR_A, prior_b: float = PRIOR_B,
                 prior_weight: float = PRIOR_WEIGHT, decay: float = DECAY) -> None:
        self.decay = decay
        self.prior = (prior_a, prior_b, prior_weight)
        # sums over (weight, x, x^2, y, x*y); the prior enters as two points at
        # x = 1 and x = 17 scaled to the first measurement (so units cancel)
        self._s = np.zeros(5)
        self._scale: float | None = None
        self.samples = 0

    def _with_prior(self) -> np.ndarray:
        a, b, w = self.prior
        scale = self._scale or 1.0
        s = self._s.copy()
        for x in (1.0, 17.0):
            y = (a + b * x) * scale
            s += (w / 2) * np.array([1.0, x, x * x, y, x * y])
        return s

    def fit(self) -> tuple[float, float]:
        """(a, b) in seconds (in prior units before any measurement)."""
        w, sx, sxx, sy, sxy = self._with_prior()
        det = w * sxx - sx * sx
        b = (w * sxy - sx * sy) / det if det > 0 else self.prior[1]
        a = (sy - b * sx) / w
        b = max(b, 0.0)
        a = max(a, 1e-9)
        return a, b

    def add(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not seconds > 0:
            return
        if self._scale is None:
            a, b = self.prior[:2]
            self._scale = seconds / (a + b * tokens)
        else:
            a, b = self.fit()
            if seconds > 5 * (a + b * tokens):  # a stall (GC, scheduler): ignore
                return
        self._s *= self.decay
        self._s += np.array([1.0, tokens, tokens * tokens, seconds, tokens * seconds])
        self.samples += 1

    def relative_token_cost(self, batch_tokens: int = 1) -> float:
        """Cost of one more token relative to a step of ``batch_tokens``."""
        a, b = self.fit()
        return b / (a + b * max(batch_tokens, 1))


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
    """Write the fitted cost ratio (atomically; JSON)."""
    a, b = model.fit()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": 1, "a_s": a, "b_s": b, "ratio": b / a, "samples": model.samples}
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def load_prior(path: Path) -> StepCostModel | None:
    """A model whose prior is the cached ratio; None when there is no usable
    cache (missing, unreadable or implausible values are ignored)."""
    try:
        data = json.loads(Path(path).read_text())
        ratio = float(data["ratio"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (0.0 <= ratio < 10.0) or data.get("format") != 1:
        return None
    return StepCostModel(prior_a=1.0, prior_b=ratio, prior_weight=CACHED_PRIOR_WEIGHT)
