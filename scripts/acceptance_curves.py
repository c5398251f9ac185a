"""Acceptance curves of the model-free methods, and expected speedups (issue 20).

    python scripts/acceptance_curves.py run [--workloads spec_bench,multi_turn,...]
    python scripts/acceptance_curves.py report [--gpu-cost FILE[:KEY]] [--cpu-cost FILE]

``run``: for every workload whose greedy record exists, replays each method
(``bench.curves.METHODS``) at node budgets 1, 2, 4, ..., 64 on the odd half
of the record (``--half``), one proposer per method and budget for the whole
half in file order (batch size 1, so cross-request memory works as in a
serving engine), and writes ``results/curves/curves_<workload>.json``. It also
replays the 13 prompts of the engine runs in docs/benchmarks.md, "Trees"
(Spec-Bench position 0 of each category, 128 tokens) with the
engine's settings, to compare replay tau with engine tau
(``results/curves/engine_compare.json``).

``report``: reads those files, combines each curve with the verify-cost
lines (this CPU's measured line, the GPU-like line of
``bench.curves.gpu_like_cost_line``, and with ``--gpu-cost`` a measured one:
``scripts/device_gpu_checks.py``'s ``gpu_checks.json``, KEY a context/batch
fit such as ``1024/1``, or a JSON ``{"a": .., "b": ..}``), writes
``results/curves/report.json`` / ``report.md`` (tables) and the plots
``docs/img/curves_<workload>.png``.

Records: ``scripts/record_greedy_hf.py`` rows (prompt and greedy output ids)
and their target top-8 (``record_greedy_hf.py topk``), see ``RECORDS``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_specplug.bench import curves as C  # noqa: E402

OUT = REPO / "results" / "curves"
IMG = REPO / "docs" / "img"
GS = REPO / "results" / "runs" / "global_store"
#: workload -> (records, top-k .npz)
RECORDS = {
    "spec_bench": (GS / "specbench_greedy_hf.jsonl", OUT / "spec_bench_topk8.npz"),
    "multi_turn": (GS / "multiturn_greedy_hf.jsonl", OUT / "multi_turn_topk8.npz"),
    "pipeline": (OUT / "pipeline_greedy_hf.jsonl", OUT / "pipeline_topk8.npz"),
    "agentic": (OUT / "agentic_greedy_hf.jsonl", OUT / "agentic_topk8.npz"),
}
# Engine runs to compare with (docs/benchmarks.md; results/runs/*.json): the
# replay of the same 13 prompts with the same settings.
ENGINE_RUNS = {
    "hybrid_corpus": REPO / "results" / "runs" / "hybrid_corpus.json",   # hybrid and static corpus
    "tr_budgets": REPO / "results" / "runs" / "tr_budgets.json",         # Token Recycling budgets
    "eagle2": REPO / "results" / "runs" / "eagle2.json",                 # EAGLE-2
}
# Engine-measured points of the methods the replay cannot run (the EAGLE
# head needs the target's hidden states): projected with the cost lines.
ENGINE_ONLY = {"eagle2": "eagle2", "eagle2@d4k4n8": "eagle2", "sam_eagle2": "eagle2"}
# Methods of the GPU projection table (docs/gpu.md, "Projected speedups").
GPU_TABLE = ("token_recycling", "sam_tr", "sam_global", "suffix")


def engine_configs(cpu: C.CostLine) -> dict:
    """Engine method name -> (factory, budget) replaying its settings."""
    rel = cpu.relative_token_cost   # StepCostModel.relative_token_cost(1)

    def auto(make):
        def build(_n):
            p = make()
            p.relative_token_cost = rel
            return p
        return build

    # the engine runs predate sam's cost-based cut: the fixed threshold rule
    # they ran with (sam_min_accept_prob 0.1) is replayed
    old_sam = {"sam_min_accept_prob": 0.1}

    from vllm_specplug.proposers.hybrid import SamTokenRecyclingProposer
    from vllm_specplug.proposers.sam import SamProposer
    from vllm_specplug.proposers.token_recycling import TokenRecyclingProposer

    return {
        "ngram": (lambda n: C.NgramBaseline(8), 8),
        "suffix": (lambda n: C.SuffixBaseline(8), 8),
        "sam": (auto(lambda: SamProposer(8, sam_global_tokens=0, **old_sam)), 8),
        "sam (global store)": (auto(lambda: SamProposer(8, **old_sam)), 8),
        "token_recycling@8": (lambda n: TokenRecyclingProposer(8), 8),
        "token_recycling@16": (lambda n: TokenRecyclingProposer(16), 16),
        "token_recycling@32": (lambda n: TokenRecyclingProposer(32), 32),
        "token_recycling": (auto(lambda: TokenRecyclingProposer(64, auto_budget=True)), 64),
        "sam_tr": (auto(lambda: SamTokenRecyclingProposer(64, auto_budget=True, **old_sam)),
                   64),
    }


def engine_tau() -> dict:
    out = {}
    for run, path in ENGINE_RUNS.items():
        if path.exists():
            data = json.loads(path.read_text())
            for m, v in data["methods"].items():
                pp = v["per_prompt"]
                if m != "plain" and not sum(p["draft_tokens"] for p in pp):
                    continue   # drafted nothing (tr_budgets' "token_recycling": broken run)
                steps = sum(p["generated"] - p["accepted"] for p in pp)
                out.setdefault(m, {})[run] = {
                    "tau": sum(p["generated"] for p in pp) / steps if steps else None,
                    "nodes_per_step": sum(p["draft_tokens"] for p in pp) / steps
                    if steps else None,
                    "prompts": [p["id"] for p in pp]}
    return out


def cmd_run(args) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    budgets = [int(x) for x in args.budgets.split(",")]
    methods = args.methods.split(",")
    for w in filter(None, args.workloads.split(",")):
        recs, topk = RECORDS[w]
        if not recs.exists():
            print(f"{w}: no record {recs}, skipped", flush=True)
            continue
        rows = C.load_records(recs, topk if topk.exists() else None, args.half)
        res = {"workload": w, "half": args.half, "records": str(recs.relative_to(REPO)),
               "topk": str(topk.relative_to(REPO)) if topk.exists() else None,
               "requests": len(rows), "output_tokens": sum(len(r["output_ids"]) for r in rows),
               "budgets": budgets, "methods": {}}
        for m in methods:
            t = time.perf_counter()
            # one replay per cost line: the adapter hands proposers the line's
            # relative token cost, by which sam sizes its drafts
            by_line = {ln.name: C.curve(m, rows, budgets,
                                        relative_token_cost=ln.relative_token_cost)
                       for ln in (C.cpu_cost_line(), C.gpu_like_cost_line())}
            pts = by_line["gpu_like"]
            res["methods"][m] = {"description": C.METHODS[m][1], "points": pts,
                                 "points_by_line": by_line,
                                 "seconds": round(time.perf_counter() - t, 2)}
            print(w, m, " ".join(f"{p['budget']}:{p['tau']:.3f}" for p in pts),
                  f"({res['methods'][m]['seconds']} s)", flush=True)
        (OUT / f"curves_{w}.json").write_text(json.dumps(res, indent=1))
    if args.engine_compare:
        cmd_engine_compare()


def cmd_engine_compare() -> None:
    recs, topk = RECORDS["spec_bench"]
    rows = [r for r in C.load_records(recs, topk if topk.exists() else None, None)
            if r["pos"] == 0]
    cpu = C.cpu_cost_line()
    eng = engine_tau()
    res = {"prompts": [r["id"] for r in rows], "note": (
        "replay of Spec-Bench position 0 of each category (the 13 prompts of the engine runs "
        "under 'Trees' in docs/benchmarks.md), HF greedy outputs of 128 tokens, the engine's "
        "settings; auto budgets with relative_token_cost = b / (a + b) of the CPU line"),
           "methods": {}}
    for m, (make, n) in engine_configs(cpu).items():
        pts = C.curve(m, rows, [n], factory=make)[0]
        key = m.replace(" (global store)", "")
        res["methods"][m] = {"replay": pts, "engine": eng.get(key, {})
                             if m != "sam (global store)" else {}}
        e = res["methods"][m]["engine"]
        print("engine-compare", m, f"replay {pts['tau']:.3f}",
              {run: round(v["tau"], 3) for run, v in e.items() if v["tau"]}, flush=True)
    (OUT / "engine_compare.json").write_text(json.dumps(res, indent=1))


# ------------------------------------------------------------------ report

def cost_lines(args) -> list[C.CostLine]:
    cpu = C.load_cost_line(args.cpu_cost, "cpu") if args.cpu_cost else C.cpu_cost_line()
    lines = [cpu, C.gpu_like_cost_line()]
    if args.gpu_cost:
        lines.append(C.load_cost_line(args.gpu_cost, "gpu_measured"))
    return lines


def line_points(v: dict, line: C.CostLine) -> list[dict]:
    """The replay made with this line's relative token cost; for a line not
    replayed (a measured GPU line), the one of the nearest b/a."""
    by_line = v.get("points_by_line") or {"gpu_like": v["points"]}
    if line.name in by_line:
        return by_line[line.name]
    known = {ln.name: ln for ln in (C.cpu_cost_line(), C.gpu_like_cost_line())}
    name = min(by_line, key=lambda k: abs(math.log((known[k].b / known[k].a) /
                                                   max(line.b / line.a, 1e-9))))
    return by_line[name]


def plot(w: str, data: dict, lines: list[C.CostLine], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 1 + len(lines), figsize=(5 * (1 + len(lines)), 4))
    for m, v in data["methods"].items():
        pts = v["points"]
        x = [p["budget"] for p in pts]
        axes[0].plot(x, [p["tau"] for p in pts], marker="o", label=m)
        for ax, line in zip(axes[1:], lines):
            ax.plot(x, [line.speedup(p["tau"], p["nodes_per_step"])
                        for p in line_points(v, line)], marker="o", label=m)
    axes[0].set_title(f"{w}: tau vs budget (replay, odd half)")
    axes[0].set_ylabel("tau (tokens per target step)")
    for ax, line in zip(axes[1:], lines):
        ax.set_title(f"expected speedup, {line.name} line (b/a = {line.b / line.a:.4f})")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_ylabel("speedup over plain")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("draft tokens / nodes per step (budget n)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def cmd_report(args) -> None:
    lines = cost_lines(args)
    report = {"cost_lines": [ln.as_dict() for ln in lines], "workloads": {}}
    md = ["Cost lines: " + "; ".join(f"**{ln.name}** a = {ln.a:.4g}, b = {ln.b:.4g} "
                                     f"(b/a = {ln.b / ln.a:.4f}; {ln.source})" for ln in lines),
          ""]
    for w in args.workloads.split(","):
        f = OUT / f"curves_{w}.json"
        if not f.exists():
            continue
        data = json.loads(f.read_text())
        budgets = data["budgets"]
        wr = report["workloads"][w] = {"requests": data["requests"],
                                       "output_tokens": data["output_tokens"], "methods": {}}
        md += [f"### {w} ({data['requests']} requests, {data['output_tokens']} output tokens, "
               f"{data['half']} half)", "",
               "tau per budget n, replayed with the GPU-like line's relative token cost (draft nodes per step actually verified in brackets; `sam` cuts its drafts by this cost, so with the CPU line its tau is a little lower: `curves_<workload>.json`, `points_by_line`):", "",
               "| method | " + " | ".join(f"n={n}" for n in budgets) + " |",
               "|---|" + "---|" * len(budgets)]
        for m, v in data["methods"].items():
            pts = v["points"]
            md.append(f"| {m} | " + " | ".join(f"{p['tau']:.3f} ({p['nodes_per_step']:.1f})"
                                               for p in pts) + " |")
            wr["methods"][m] = {"tau": {p["budget"]: round(p["tau"], 4) for p in pts},
                                "nodes_per_step": {p["budget"]: round(p["nodes_per_step"], 3)
                                                   for p in pts},
                                "best": {ln.name: C.best_budget(line_points(v, ln), ln)
                                         for ln in lines}}
        md += ["", "Best budget and expected speedup per cost line:", "",
               "| method | " + " | ".join(f"{ln.name}: best n, speedup" for ln in lines) + " |",
               "|---|" + "---|" * len(lines)]
        for m, v in wr["methods"].items():
            md.append(f"| {m} | " + " | ".join(
                f"{v['best'][ln.name]['budget']}, {v['best'][ln.name]['speedup']:.2f}x"
                for ln in lines) + " |")
        md.append("")
        n_cat = args.category_budget
        cats = {m: next((p["tau_by_category"] for p in v["points"] if p["budget"] == n_cat), {})
                for m, v in data["methods"].items()}
        names = sorted({c for t in cats.values() for c in t})
        if len(names) > 1:
            ms = list(cats)
            md += [f"tau per category at n = {n_cat}:", "",
                   "| category | " + " | ".join(ms) + " |", "|---|" + "---|" * len(ms)]
            md += [f"| {c} | " + " | ".join(f"{cats[m].get(c, float('nan')):.3f}" for m in ms)
                   + " |" for c in names]
            for ours in ("sam", "sam_global", "sam_tr"):
                if ours in cats and "suffix" in cats:
                    k = sum(cats[ours][c] >= cats["suffix"][c] for c in names)
                    md.append(f"\n`{ours}` tau >= `suffix` tau in {k} of {len(names)} "
                              f"categories at n = {n_cat}.")
                    wr.setdefault("categories_at_or_above_suffix", {})[ours] = k
            wr["tau_by_category"] = {"budget": n_cat, **cats}
            md.append("")
        if not args.no_plots:
            plot(w, data, lines, IMG / f"curves_{w}.png")
    cmp_path = OUT / "engine_compare.json"
    if cmp_path.exists():
        cmp = json.loads(cmp_path.read_text())
        md += ["### Replay against the engine (13 Spec-Bench prompts, 128 tokens)", "",
               "| method | replay tau | engine tau (run) | replay nodes/step | engine nodes/step |",
               "|---|---|---|---|---|"]
        for m, v in cmp["methods"].items():
            r = v["replay"]
            eng = v["engine"]
            et = ", ".join(f"{e['tau']:.3f} ({run})" for run, e in eng.items() if e["tau"])
            en = ", ".join(f"{e['nodes_per_step']:.2f}" for e in eng.values() if e["tau"])
            md.append(f"| {m} | {r['tau']:.3f} | {et or 'n/a'} | {r['nodes_per_step']:.2f} | "
                      f"{en or 'n/a'} |")
        report["engine_compare"] = cmp
    gpu_md = gpu_projection(report, lines)
    (OUT / "gpu_projection.md").write_text(gpu_md)
    md += ["", gpu_md]
    (OUT / "report.json").write_text(json.dumps(report, indent=1))
    (OUT / "report.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def gpu_projection(report: dict, lines: list[C.CostLine]) -> str:
    """The table of docs/gpu.md's "Projected speedups": per workload and
    method, tau at n = 64, and the best budget and speedup per cost line;
    then the engine-measured EAGLE points projected the same way."""
    md = ["| workload | method | tau at n=64 | " + " | ".join(
        f"{ln.name}: best n, tau, speedup" for ln in lines) + " |",
        "|---|---|---|" + "---|" * len(lines)]
    for w, wr in report["workloads"].items():
        for m in GPU_TABLE:
            v = wr["methods"].get(m)
            if v is None:
                continue
            md.append(f"| {w} | {m} | {v['tau'][max(v['tau'])]:.2f} | " + " | ".join(
                f"{b['budget']}, {b['tau']:.2f}, {b['speedup']:.2f}x"
                for b in (v["best"][ln.name] for ln in lines)) + " |")
    eng = engine_tau()
    pts = [(m, eng[m][run]) for m, run in ENGINE_ONLY.items() if run in eng.get(m, {})]
    if pts:
        md += ["", "Engine-measured EAGLE points (13 Spec-Bench prompts, 128 tokens, "
               "`results/runs/eagle2.json`), verify cost only (the head's own forward "
               "passes not counted):", "",
               "| method | engine tau | draft nodes/step | " + " | ".join(
                   f"{ln.name} speedup" for ln in lines) + " |",
               "|---|---|---|" + "---|" * len(lines)]
        for m, e in pts:
            md.append(f"| {m} | {e['tau']:.2f} | {e['nodes_per_step']:.2f} | " + " | ".join(
                f"{ln.speedup(e['tau'], e['nodes_per_step']):.2f}x" for ln in lines) + " |")
    return "\n".join(md) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--workloads", default="spec_bench,multi_turn,pipeline,agentic")
    r.add_argument("--methods", default=",".join(C.METHODS))
    r.add_argument("--budgets", default=",".join(map(str, C.BUDGETS)))
    r.add_argument("--half", default="odd", choices=("odd", "even"))
    r.add_argument("--no-engine-compare", dest="engine_compare", action="store_false")
    p = sub.add_parser("report")
    p.add_argument("--workloads", default="spec_bench,multi_turn,pipeline,agentic")
    p.add_argument("--gpu-cost", default="", help="FILE[:KEY]: a measured GPU cost line")
    p.add_argument("--cpu-cost", default="", help="FILE: a CPU cost line replacing the fit")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--category-budget", type=int, default=8,
                   help="budget of the per-category table (8: the engine's default K)")
    args = ap.parse_args(argv)
    (cmd_run if args.cmd == "run" else cmd_report)(args)


if __name__ == "__main__":
    main()
