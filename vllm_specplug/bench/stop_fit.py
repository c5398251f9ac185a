"""Fit ``sam``'s learned stopping rule (``proposers.stop_rule``) from
recorded greedy outputs (``specplug fit-stop``).

Recording replay: ``sam`` with ``sam_stop: "learned"`` drives greedy
decoding of the records as ``bench.simulate.replay`` does (batch size 1,
in file order, one proposer for all); at every step each candidate draft
the rule scores (the request's own automaton, the global store) is
recorded with its feature rows and, from the true output, whether each
position was accepted given the ones before (rows up to and including the
first rejected one). A logistic regression per source is fitted on those
rows (Newton's method, L2), then the replay is repeated with the fitted
model and the union refitted (the features of a request's recent
acceptance depend on what the rule drafted).

Records: ``scripts/record_greedy_hf.py`` files (``bench.curves.load_records``);
fit on the tuning halves (``results/curves/*_even_*``, Spec-Bench's even
half), evaluate on the odd halves.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from ..proposers.stop_rule import FEATURES, SOURCES, LearnedStop, StopModel
from .simulate import accepted_length

BUDGET = 32
#: L2 weight of every coefficient but the bias (rows are thousands)
L2 = 1.0


def initial_model() -> StopModel:
    """The table's own conditional estimate (coefficient 1 on its logit)."""
    w = np.zeros(len(FEATURES))
    w[FEATURES.index("table_logit")] = 1.0
    return StopModel({s: w.copy() for s in ("dynamic", "global")})


def _proposer(model: StopModel | None, relative_token_cost: float, **opts):
    from ..proposers.sam import SamProposer

    sam = SamProposer(BUDGET, **{"sam_stop": "table", **opts})
    if model is not None:   # the learned rule with this model (not the shipped file's)
        sam._stop = LearnedStop(model)
    sam.relative_token_cost = relative_token_cost
    return sam


def common_prefix(tokens: Sequence[int], out: Sequence[int], pos: int) -> int:
    """Tokens of ``tokens`` that match ``out`` from ``pos`` on."""
    a = 0
    while a < len(tokens) and pos + a < len(out) and tokens[a] == out[pos + a]:
        a += 1
    return a


def drive(sam, rows: Sequence[dict], step_of) -> None:
    """Greedy replay of ``rows`` through ``sam`` (as ``simulate.replay``):
    ``step_of(req_id, out, pos)`` proposes a step's draft."""
    for i, r in enumerate(rows):
        prompt, out = list(r["prompt_ids"]), list(r["output_ids"])
        if not out:
            continue
        rid = f"r{i}"
        sam.start(rid, prompt + out[:1])   # the prefill step made out[0]
        pos = 1
        while pos < len(out):
            draft = step_of(rid, out, pos)
            n = min(accepted_length(draft, out, pos) + 1, len(out) - pos)
            sam.observe(rid, out[pos:pos + n])
            pos += n
        sam.complete(rid)
        sam.finish(rid)


def collect(rows: Sequence[dict], model: StopModel, relative_token_cost: float
            ) -> dict[str, tuple[list, list]]:
    """Feature rows and labels per source from a recording replay."""
    sam = _proposer(model, relative_token_cost)
    stop = sam._stop
    data: dict[str, tuple[list, list]] = {s: ([], []) for s in SOURCES}
    step: list[tuple[str, np.ndarray, list[int]]] = []
    stop.record = lambda req_id, source, tokens: step.append(
        (source, stop.last_features, list(tokens)))

    def step_of(rid: str, out: list[int], pos: int):
        step.clear()
        draft = sam.propose(rid, BUDGET)
        for source, X, tokens in step:
            a = common_prefix(tokens, out, pos)
            seen = min(a + 1, len(tokens), len(out) - pos)
            xs, ys = data[source]
            xs.append(X[:seen])
            ys.append((np.arange(seen) < a).astype(np.float64))
        return draft

    drive(sam, rows, step_of)
    return data


def fit_logistic(X: np.ndarray, y: np.ndarray, l2: float = L2, iters: int = 50
                 ) -> np.ndarray:
    """Coefficients of P(y = 1) = sigmoid(X w), penalised log-likelihood
    (L2 on every column but the first), Newton's method."""
    w = np.zeros(X.shape[1])
    reg = np.full(X.shape[1], l2)
    reg[0] = 1e-6
    for _ in range(iters):
        z = np.clip(X @ w, -30, 30)
        p = 1.0 / (1.0 + np.exp(-z))
        g = X.T @ (p - y) + reg * w
        H = (X * (p * (1 - p))[:, None]).T @ X + np.diag(reg)
        step = np.linalg.solve(H, g)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return w


def log_loss(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    p = np.clip(1.0 / (1.0 + np.exp(-np.clip(X @ w, -30, 30))), 1e-9, 1 - 1e-9)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


def fit(row_sets: dict[str, Sequence[dict]], relative_token_costs: Sequence[float],
        rounds: int = 2, log=print) -> tuple[StopModel, dict]:
    """Fit on every row set (name -> records) replayed at each cost;
    returns the model and a summary (rows, log loss per source)."""
    model = initial_model()
    pooled: dict[str, tuple[list, list]] = {s: ([], []) for s in SOURCES}
    for rnd in range(rounds):
        for name, rows in row_sets.items():
            for c in relative_token_costs:
                t = time.time()
                got = collect(rows, model, c)
                for s in SOURCES:
                    pooled[s][0].extend(got[s][0])
                    pooled[s][1].extend(got[s][1])
                log(f"round {rnd}: {name} at cost {c:.4f}: "
                    f"{sum(len(y) for y in got['dynamic'][1])} dynamic rows, "
                    f"{sum(len(y) for y in got['global'][1])} global rows "
                    f"({time.time() - t:.1f} s)")
        coef, summary = {}, {}
        for s in SOURCES:
            xs, ys = pooled[s]
            if not ys or sum(len(y) for y in ys) < 200:
                continue
            X, y = np.concatenate(xs), np.concatenate(ys)
            w = fit_logistic(X, y)
            coef[s] = w
            base = initial_model().coef.get(s, w)
            summary[s] = {"rows": int(y.size), "accept_rate": float(y.mean()),
                          "log_loss": log_loss(X, y, w),
                          "log_loss_table": log_loss(X, y, base)}
        model = StopModel(coef)
        log(f"round {rnd}: fitted {json.dumps(summary)}")
    return model, summary


def default_training_sets() -> dict[str, list[dict]]:
    """The tuning halves of the recorded workloads (this repository's
    ``results/``)."""
    from .curves import load_records

    repo = Path(__file__).resolve().parents[2]
    cur = repo / "results" / "curves"
    return {"pipeline": load_records(cur / "pipeline_even_greedy_hf.jsonl", half=None),
            "agentic": load_records(cur / "agentic_even_greedy_hf.jsonl", half=None),
            "spec_bench": load_records(repo / "results" / "runs" / "global_store"
                                       / "specbench_greedy_hf.jsonl", half="even")}


def main(records: Sequence[str], out: str, half: str | None, costs: Sequence[float],
         rounds: int = 2) -> dict:
    """``specplug fit-stop``: fit on ``records`` (default: this repository's
    tuning halves) and write the model file."""
    from .curves import load_records

    if records:
        sets = {Path(p).stem: load_records(p, half=half) for p in records}
    else:
        sets = default_training_sets()
    for name, rows in sets.items():
        if not rows:
            raise SystemExit(f"{name}: no records (half {half!r})")
    model, summary = fit(sets, costs, rounds=rounds)
    meta = {"fitted_on": {name: len(rows) for name, rows in sets.items()},
            "relative_token_costs": [round(c, 6) for c in costs], "rounds": rounds,
            "summary": summary,
            "note": "coefficients of P(position accepted | earlier ones accepted) per "
                    "source; written by `specplug fit-stop`"}
    data = model.to_dict(meta)
    StopModel.from_dict(json.loads(json.dumps(data)))   # what sam will read back
    Path(out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}")
    return data


def cost_values(lines: Sequence[str]) -> list[float]:
    """Relative token costs of named lines ("cpu", "gpu_like") or numbers."""
    from .curves import cpu_cost_line, gpu_like_cost_line

    named = {"cpu": cpu_cost_line, "gpu_like": gpu_like_cost_line}
    out = []
    for v in lines:
        if v in named:
            out.append(named[v]().relative_token_cost)
        else:
            c = float(v)
            if not (0.0 <= c < 1.0 and math.isfinite(c)):
                raise SystemExit(f"--costs: {v!r} is not a relative token cost in [0, 1)")
            out.append(c)
    return out
