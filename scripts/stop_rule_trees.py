"""Would shallow trees separate sam's accepted draft positions from the
rejected ones better than the learned rule's logistic model? A replay test
on the same features, before any engine work.

    pip install scikit-learn   # this script only; the package does not need it
    python scripts/stop_rule_trees.py [--depth 3 --iters 60 --rounds 1] > trees.txt

Per source (dynamic, global), a gradient-boosted ensemble of shallow trees
(scikit-learn's ``HistGradientBoostingClassifier``) is fitted on the rule's
own features (``stop_rule.FEATURES``) and labels (accepted given the
previous positions, as ``bench.stop_fit.collect``), recorded by replaying
the tuning halves (the even halves of pipeline, agentic and Spec-Bench) at
this CPU's cost line and the GPU-like line, as ``specplug fit-stop`` does.
With ``--rounds 2`` the second round's recording uses the trees' own choices.
Then the odd halves are replayed (``bench.stop_fit.replay_speedup``: batch
size 1, budget 32) twice: with the shipped logistic model and with the
trees in its place, the online calibration and the cut unchanged. Printed:
ROC AUC and log loss of both on the odd halves' positions, and the replay's
tau, nodes, loss accounting and speedup against ``suffix`` and the oracle
(``results/curves/oracle_bound.json``) on both lines.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from acceptance_curves import RECORDS  # noqa: E402
from stop_rule_confidence import auc  # noqa: E402
from vllm_specplug.bench import curves as C  # noqa: E402
from vllm_specplug.bench import stop_fit as F  # noqa: E402
from vllm_specplug.proposers import stop_rule as SR  # noqa: E402

LOGISTIC = SR.LearnedStop.conditional
TREES: dict = {}


def tree_conditional(self, req_id, source, match_len, table_p, shares, depths, in_prompt,
                     agree=None, support=None):
    """``LearnedStop.conditional`` with the trees of ``TREES`` for a source
    that has them (the logistic model otherwise)."""
    r = self._req[req_id]
    s = SR.SOURCES.index(source)
    ewma = (r.num[s] + 1.0) / (r.den[s] + 2.0)
    X = SR.features(depths, match_len, table_p, shares, ewma, r.drafts[s], r.since_reject,
                    in_prompt, r.generated, r.last_full, agree, support)
    if self.record is not None:
        self.last_features = X
    trees = TREES.get(source)
    if trees is None:
        return 1.0 / (1.0 + np.exp(-(X @ self.model.coef[source])))
    return np.clip(trees.predict_proba(X[:, 1:])[:, 1], 1e-4, 1 - 1e-4)


def main(argv=None) -> None:
    from sklearn.ensemble import HistGradientBoostingClassifier

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args(argv)
    model = SR.StopModel.load()
    lines = [C.cpu_cost_line(), C.gpu_like_cost_line()]
    pooled = {s: ([], []) for s in SR.SOURCES}
    print(f"trees: depth {args.depth}, {args.iters} rounds of boosting, learning rate 0.1, "
          f"l2 1.0; recording rounds {args.rounds}")
    for rnd in range(args.rounds):
        SR.LearnedStop.conditional = tree_conditional if rnd else LOGISTIC
        for rows in F.default_training_sets().values():
            for ln in lines:
                got = F.collect(rows, model, ln.relative_token_cost)
                for s in SR.SOURCES:
                    pooled[s][0].extend(got[s][0])
                    pooled[s][1].extend(got[s][1])
        for s in ("dynamic", "global"):
            X, y = np.concatenate(pooled[s][0]), np.concatenate(pooled[s][1])
            TREES[s] = HistGradientBoostingClassifier(
                max_depth=args.depth, max_iter=args.iters, learning_rate=0.1,
                l2_regularization=1.0, random_state=0).fit(X[:, 1:], y)
            print(f"round {rnd}: {s} fitted on {len(y)} tuning positions")
    SR.LearnedStop.conditional = LOGISTIC
    cpu = lines[0]
    print("\nseparation on the odd halves' positions (recorded with the shipped model, CPU line)")
    print("  source   workload    positions accepted | AUC: logistic trees | log loss: logistic trees")
    odd = {w: C.load_records(RECORDS[w][0], None, half="odd")
           for w in ("pipeline", "agentic", "spec_bench")}
    for w, rows in odd.items():
        got = F.collect(rows, model, cpu.relative_token_cost)
        for s in ("dynamic", "global"):
            if not got[s][1]:
                continue
            X, y = np.concatenate(got[s][0]), np.concatenate(got[s][1])
            pl = 1.0 / (1.0 + np.exp(-np.clip(X @ model.coef[s], -30, 30)))
            pt = np.clip(TREES[s].predict_proba(X[:, 1:])[:, 1], 1e-9, 1 - 1e-9)
            ll = lambda p: float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())  # noqa: E731
            print(f"  {s:8s} {w:11s} {len(y):9d} {y.mean():8.3f} | {auc(pl, y):14.4f} "
                  f"{auc(pt, y):5.4f} | {ll(np.clip(pl, 1e-9, 1 - 1e-9)):19.4f} {ll(pt):5.4f}")
    oracle = json.loads((REPO / "results" / "curves" / "oracle_bound.json").read_text())
    print("\nreplay of the odd halves (batch size 1, budget 32)")
    for w, rows in odd.items():
        for ln in lines:
            ob = oracle["workloads"][w][f"speedup@{ln.name}"]
            o, su = ob["oracle"], ob["suffix"]
            for name, fn in (("logistic", LOGISTIC), ("trees", tree_conditional)):
                SR.LearnedStop.conditional = fn
                t = time.time()
                r = F.replay_speedup(rows, ln, "learned")
                print(f"{w:10s} {ln.name:8s} {name:8s} tau {r['tau']:.3f} nodes "
                      f"{r['nodes_per_step']:.2f} rejected {r['rejected_per_step']:.2f} "
                      f"cut early {r['cut_early_per_step']:.2f} source "
                      f"{r['wrong_source_per_step']:.2f} speedup {r['speedup']:.3f} "
                      f"({r['speedup'] / su:.3f}x suffix, oracle {o / su:.3f}x; fraction "
                      f"{(r['speedup'] - su) / (o - su):+.2f}) drafting ms a step "
                      f"{r['draft_ms_per_step']:.2f} [{time.time() - t:.0f} s]", flush=True)
    SR.LearnedStop.conditional = LOGISTIC


if __name__ == "__main__":
    main()
