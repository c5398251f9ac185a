"""Offline measurements of `sam`'s global store (issue 20). No engine.

    python scripts/measure_global_store.py replay RECORDS.jsonl [...]   # tau, tuned/held out
    python scripts/measure_global_store.py cost                          # memory and step cost

``replay``: RECORDS are JSONL rows ``{"category", "pos", "prompt_ids",
"output_ids"}`` (greedy outputs of the target; ``pos`` is the prompt's
position within its category). The prompts at even positions tune the
settings (``sam_min_accept_prob``, ``sam_global_prompts``) of each config,
the odd ones report them: each half is replayed in file order at batch size
1 with one proposer (``bench.simulate.replay_many``), so a request can draft
from the outputs of the requests before it in its half. Prints one
``RESULT {...}`` line per config and half.

``cost``: the store's resident bytes and the per-step cost of a request's
match (one committed token, the match brought up to date, the best segment
and an 8-token most-frequent continuation), and the re-match of a request
(its last 128 tokens in every segment, after documents arrived), at 10k and
1M stored tokens, for Zipf(1.2) ids and uniform ids of a 150k vocabulary.
"""
from __future__ import annotations

import json
import sys
import time
from collections import defaultdict

import numpy as np

from vllm_specplug.bench.simulate import replay_many
from vllm_specplug.proposers.global_store import GlobalMatch, GlobalStore
from vllm_specplug.proposers.sam import SamProposer

K = 8
CONFIGS = {
    "sam": {"sam_global_tokens": 0},
    "sam_global": {},
}
TUNE = {"sam_min_accept_prob": [0.05, 0.1, 0.2], "sam_global_prompts": [False, True]}


def load(paths):
    rows = []
    for p in paths:
        with open(p) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def run(rows, opts):
    prop = SamProposer(K, **opts)
    t = time.perf_counter()
    res = replay_many(prop, [(r["prompt_ids"], r["output_ids"]) for r in rows], K)
    res["proposer_us_per_step"] = 1e6 * (time.perf_counter() - t) / max(res["steps"], 1)
    res["stats"] = prop.debug_stats()
    return res


def by_category(rows, opts):
    """tau per category, each category replayed on its own (a fresh proposer)."""
    cats = defaultdict(list)
    for r in rows:
        cats[r["category"]].append(r)
    return {c: round(run(rs, opts)["tau"], 3) for c, rs in cats.items()}


def replay_main(paths):
    rows = load(paths)
    halves = {"tune": [r for r in rows if r["pos"] % 2 == 0],
              "report": [r for r in rows if r["pos"] % 2 == 1]}
    for name, base in CONFIGS.items():
        grid = [{}]
        for key, values in TUNE.items():
            if key == "sam_global_prompts" and base.get("sam_global_tokens") == 0:
                continue
            grid = [{**g, key: v} for g in grid for v in values]
        scored = [(run(halves["tune"], {**base, **g})["tau"], g) for g in grid]
        tau, best = max(scored, key=lambda s: s[0])
        print("TUNE", json.dumps({"config": name, "grid": [[round(t, 4), g] for t, g in scored]}))
        for half in ("tune", "report"):
            res = run(halves[half], {**base, **best})
            out = {"config": name, "half": half, "settings": best, "requests": len(halves[half]),
                   **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}}
            if half == "report":
                out["tau_by_category"] = by_category(halves[half], {**base, **best})
            print("RESULT", json.dumps(out), flush=True)


def cost_main():
    rng = np.random.default_rng(0)
    for ids in ("zipf", "uniform150k"):
        for total in (10_000, 1_000_000):
            g = GlobalStore(total)
            # load (or compile) the numba functions before timing anything
            warm = GlobalStore(1024)
            warm.add([1, 2, 3, 1, 2, 4])
            seg, st, _ = warm.match([1, 2])
            warm.continuation(seg, st, K)
            warm.continuation(seg, st, K, "first")
            t = time.perf_counter()
            n = 0
            add_times = []
            while n < total * 1.25:     # past the bound: at least one segment dropped
                doc = (rng.zipf(1.2, 256) % 150_000 if ids == "zipf"
                       else rng.integers(0, 150_000, 256))
                t1 = time.perf_counter()
                g.add(doc)
                add_times.append(time.perf_counter() - t1)
                n += doc.size
            build = time.perf_counter() - t
            ctx = (rng.zipf(1.2, 2000) % 150_000 if ids == "zipf"
                   else rng.integers(0, 150_000, 2000)).tolist()
            m = GlobalMatch()
            g.refresh(m, ctx[:200])
            steps = 1800
            lengths = []
            t = time.perf_counter()
            for i in range(steps):
                # one decoding step's use of the store, as sam makes it
                g.advance(m, ctx[200 + i:201 + i])
                g.refresh(m, ctx[:201 + i])
                seg, st, ln = g.best(m)
                g.continuation(seg, st, K)
                lengths.append(ln)
            step = (time.perf_counter() - t) / steps
            t = time.perf_counter()
            for _ in range(200):
                g.refresh(GlobalMatch(), ctx)
            refresh = (time.perf_counter() - t) / 200
            print("COST", json.dumps({
                "ids": ids, "bound": total, "tokens": g.num_tokens,
                "segments": len(g.segments), "dropped": g.segments_dropped,
                "resident_MB": round(g.resident_nbytes() / 1e6, 2),
                "bytes_per_token": round(g.resident_nbytes() / g.num_tokens, 1),
                "allocated_MB": round(g.allocated_nbytes() / 1e6, 2),
                "insert_us_per_token": round(1e6 * build / n, 3),
                "max_add_ms": round(1e3 * max(add_times), 2),
                "step_us": round(1e6 * step, 2),
                "mean_match_len": round(float(np.mean(lengths)), 2),
                "rematch_after_add_us": round(1e6 * refresh, 2)}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["cost"]:
        cost_main()
    elif sys.argv[1:2] == ["replay"] and len(sys.argv) > 2:
        replay_main(sys.argv[2:])
    else:
        sys.exit(__doc__)
