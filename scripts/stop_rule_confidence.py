"""Would the target's confidence on the last tokens help sam's learned
stopping rule? A replay test of separation, before any engine work.

    python scripts/stop_rule_confidence.py > confidence.txt   # ~2 min, one core

At propose time the engine could know the target's log-probabilities of the
tokens it just committed (the adapter already hands the target's top-k to
proposers that ask, ``Proposer.wants_target_topk``). This script replays
``sam`` with the shipped learned rule (``data/sam_stop.json``) over the
recorded greedy outputs, and for every candidate draft position the rule
scores it takes the rule's own features (``stop_rule.FEATURES``) and five
more from the recorded top-8 (``record_greedy_hf.py topk``): the top-1
log-probability of the last committed token, its margin over the top-2,
the minimum top-1 over the last 4 tokens, the mean over the last 8, and
depth times the first. Per source, two logistic models are fitted on the
tuning halves (the even halves of pipeline, agentic and Spec-Bench): the
rule's features alone, and with the five. Printed per odd half: positions,
acceptance, log loss and ROC AUC of the shipped model, the refit, and the
refit with confidence (the accepted-given-the-previous label, as
``bench.stop_fit.collect``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vllm_specplug.bench import curves as C  # noqa: E402
from vllm_specplug.bench import stop_fit as F  # noqa: E402
from vllm_specplug.proposers import stop_rule as SR  # noqa: E402

R = REPO / "results"
GS = R / "runs" / "global_store" / "specbench_greedy_hf.jsonl"
HALVES = {
    "even": {"pipeline": (R / "curves/pipeline_even_greedy_hf.jsonl",
                          R / "curves/pipeline_even_topk8.npz", None),
             "agentic": (R / "curves/agentic_even_greedy_hf.jsonl",
                         R / "curves/agentic_even_topk8.npz", None),
             "spec_bench": (GS, R / "curves/spec_bench_topk8.npz", "even")},
    "odd": {"pipeline": (R / "curves/pipeline_greedy_hf.jsonl",
                         R / "curves/pipeline_topk8.npz", "odd"),
            "agentic": (R / "curves/agentic_greedy_hf.jsonl",
                        R / "curves/agentic_topk8.npz", "odd"),
            "spec_bench": (GS, R / "curves/spec_bench_topk8.npz", "odd")},
}
CONF = ("last_top1", "last_margin", "min_top1_4", "mean_top1_8", "depth_x_last_top1")


def confidence(lp: np.ndarray, pos: int, depths: int) -> np.ndarray:
    """The five confidence columns for a draft after output position pos - 1
    (``lp``: the record's top-k log-probabilities, row j predicting output j)."""
    top1 = np.maximum(lp[:, 0].astype(np.float64), -12.0)
    margin = np.minimum((lp[:, 0] - lp[:, 1]).astype(np.float64), 12.0)
    last = top1[pos - 1]
    X = np.empty((depths, len(CONF)))
    X[:, 0] = last
    X[:, 1] = margin[pos - 1]
    X[:, 2] = top1[max(0, pos - 4):pos].min()
    X[:, 3] = top1[max(0, pos - 8):pos].mean()
    X[:, 4] = np.log1p(np.arange(depths)) * last
    return X


def collect(rows, model: SR.StopModel, cost: float) -> dict:
    """Per source: (rule features, confidence features, labels)."""
    sam = F._proposer(model, cost)
    stop = sam._stop
    data = {s: ([], [], []) for s in SR.SOURCES}
    step: list = []
    stop.record = lambda req_id, source, tokens: step.append(
        (source, stop.last_features, list(tokens)))
    lp_of: dict = {}

    def step_of(rid, out, pos):
        step.clear()
        draft = sam.propose(rid, F.BUDGET)
        for source, X, tokens in step:
            a = F.common_prefix(tokens, out, pos)
            seen = min(a + 1, len(tokens), len(out) - pos)
            xs, cs, ys = data[source]
            xs.append(X[:seen])
            cs.append(confidence(lp_of["lp"], pos, seen))
            ys.append((np.arange(seen) < a).astype(np.float64))
        return draft

    for r in rows:   # one request at a time, the proposer (and its store) shared
        lp_of["lp"] = r["topk"][1]
        F.drive(sam, [r], step_of)
    return {s: tuple(np.concatenate(v[i]) for i in range(3))
            for s, v in data.items() if v[2]}


def auc(p: np.ndarray, y: np.ndarray) -> float:
    order = np.argsort(p, kind="stable")
    ranks = np.empty(len(p))
    ranks[order] = np.arange(1, len(p) + 1)
    n1 = y.sum()
    n0 = len(y) - n1
    return float((ranks[y == 1].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def main() -> None:
    model = SR.StopModel.load()
    cost = C.cpu_cost_line().relative_token_cost
    got = {h: {w: collect(C.load_records(rec, topk, half=half), model, cost)
               for w, (rec, topk, half) in ws.items()}
           for h, ws in HALVES.items()}
    print(f"replay: sam, learned rule (shipped model), budget {F.BUDGET}, "
          f"CPU line relative cost {cost:.4f}; confidence columns {list(CONF)}")
    for s in ("dynamic", "global"):
        parts = [got["even"][w][s] for w in got["even"] if s in got["even"][w]]
        Xe, Ce, ye = (np.concatenate([p[i] for p in parts]) for i in range(3))
        w0 = F.fit_logistic(Xe, ye)
        w1 = F.fit_logistic(np.hstack([Xe, Ce]), ye)
        print(f"{s}: {len(ye)} tuning positions; confidence coefficients "
              f"{np.round(w1[-len(CONF):], 3).tolist()}")
        print("  odd half     positions accepted | log loss: shipped  refit  +conf "
              "| AUC: shipped  refit  +conf")
        for w, parts in got["odd"].items():
            if s not in parts:
                continue
            Xo, Co, yo = parts[s]
            XC = np.hstack([Xo, Co])
            sig = lambda z: 1.0 / (1.0 + np.exp(-np.clip(z, -30, 30)))  # noqa: E731
            print(f"  {w:11s} {len(yo):9d} {yo.mean():8.3f} |"
                  f" {F.log_loss(Xo, yo, model.coef[s]):15.4f} {F.log_loss(Xo, yo, w0):6.4f}"
                  f" {F.log_loss(XC, yo, w1):6.4f} |"
                  f" {auc(sig(Xo @ model.coef[s]), yo):12.4f} {auc(sig(Xo @ w0), yo):6.4f}"
                  f" {auc(sig(XC @ w1), yo):6.4f}")


if __name__ == "__main__":
    main()
