"""``specplug bench matrix``: every method on every workload, in fixed
batches and served at several concurrencies, in one command.

Cells: ``bsN``, the workload offline in fixed batches of N (every session's
turn t before turn t+1, ``workloads.batch_plan``) in a fresh engine
(``bench.worker``); ``cC``, the workload sent to a fresh ``vllm serve`` by C
concurrent clients (``bench.served``: sessions turn by turn, at most C in
flight). Every method runs every cell in a process of its own, one engine
or server at a time: cross-request memory (sam's global store, suffix's
response cache, Token Recycling's matrix) never holds a cell's own outputs
from an earlier cell. Greedy; every output of every cell is compared with
plain decoding's in the same cell (token ids).

Writes OUT/raw/WORKLOAD.METHOD.CELL.json (each cell's outputs and counters;
``--reuse-raw`` reads these back instead of running the cell again, when
they were run with the same settings), OUT/results.json, OUT/matrix.md (a
table per workload: methods against cells, each entry tokens/s, x plain's,
x suffix's, and a mark where outputs differ from plain's) and OUT/matrix.png
(speedup over plain per cell, a panel per workload). The engine and server
logs go to OUT/engine.log and OUT/server/.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import served
from .plausibility import LOAD_SLACK
from .run import (BenchError, batch_entry, differing_ids, environment, method_config,
                  parse_overrides, run_worker, suffix_available)
from .workloads import WORKLOADS, load_workload, session_key

DEFAULT_METHODS = ("plain", "ngram", "suffix", "sam", "sam_tr", "token_recycling")
DEFAULT_WORKLOADS = ("spec_bench", "pipeline", "agentic")
DEFAULT_BATCH_SIZES = (1, 4, 16)
DEFAULT_CONCURRENCY = (1, 8, 32)
DEFAULT_MAX_TOKENS = 96
DEFAULT_HALF = "odd"
#: ``--quick``: a smoke test of every kind of cell (options given beside it win)
QUICK = {"workloads": ["spec_bench"], "limit": 4, "max_tokens": 32, "batch_sizes": [1, 4],
         "concurrency": [1, 4]}
#: the offline engine's (``offline_engine.engine_kwargs``) and the server's
MAX_MODEL_LEN = 4096
#: the method every entry is also compared with
REFERENCE = "suffix"


class MatrixError(ValueError):
    """A bad option (raised before any engine starts) or a failed cell."""


@dataclass
class Plan:
    """What a matrix runs, checked: workload rows loaded, every method's
    speculative config resolved."""
    workloads: list[str]
    methods: list[str]                      # plain first
    configs: dict[str, dict | None]
    batch_sizes: list[int]
    concurrency: list[int]
    max_tokens: int
    half: str | None
    limit: int | None
    rows: dict[str, list[dict]] = field(default_factory=dict)

    @property
    def cells(self) -> list[str]:
        return [f"bs{b}" for b in self.batch_sizes] + [f"c{c}" for c in self.concurrency]


def parse_sizes(text: str | list[int] | tuple[int, ...], option: str) -> list[int]:
    """``"1,4,16"`` (or a list) as distinct positive integers, in order."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[int] = []
    for item in items:
        if isinstance(item, str) and not item.strip():
            continue
        try:
            n = int(item)
        except (TypeError, ValueError):
            raise MatrixError(f"{option} {text!r}: give integers, e.g. 1,4,16") from None
        if n < 1:
            raise MatrixError(f"{option} {text!r}: every size must be at least 1")
        if n not in out:
            out.append(n)
    return out


def _names(text: str | list[str] | tuple[str, ...]) -> list[str]:
    items = text.split(",") if isinstance(text, str) else list(text)
    return list(dict.fromkeys(x.strip() for x in items if x.strip()))


def make_plan(workloads=DEFAULT_WORKLOADS, methods=DEFAULT_METHODS,
              batch_sizes=DEFAULT_BATCH_SIZES, concurrency=DEFAULT_CONCURRENCY, *,
              max_tokens: int = DEFAULT_MAX_TOKENS, half: str | None = DEFAULT_HALF,
              limit: int | None = None, overrides: dict[str, dict] | None = None,
              eagle_head: str | None = None) -> Plan:
    """Check every option and load the workloads; raises ``MatrixError``
    naming the option to change. Starts nothing."""
    workloads = _names(workloads)
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise MatrixError(f"--workloads: unknown {unknown}; choose from {sorted(WORKLOADS)}")
    if not workloads:
        raise MatrixError("--workloads: name at least one workload")
    methods = ["plain"] + [m for m in _names(methods) if m != "plain"]
    overrides = overrides or {}
    stray = sorted(set(overrides) - set(methods))
    if stray:
        raise MatrixError(f"--speculative-config: {stray} not in --methods {methods}; add "
                          f"them to --methods or drop the override")
    configs = {}
    for m in methods:
        try:
            configs[m] = method_config(m, overrides, eagle_head)
        except BenchError as e:
            raise MatrixError(f"--methods: {e}") from None
    if REFERENCE in methods and not suffix_available():
        raise MatrixError("--methods: vLLM `suffix` needs arctic-inference, which is not "
                          "installed (`pip install --no-build-isolation arctic-inference==0.3.0`, "
                          "as scripts/setup.sh does); install it or drop suffix from --methods")
    batch_sizes = parse_sizes(batch_sizes, "--batch-sizes")
    concurrency = parse_sizes(concurrency, "--concurrency")
    if not batch_sizes and not concurrency:
        raise MatrixError("no cells: give --batch-sizes or --concurrency (without --no-serve)")
    if max_tokens < 1:
        raise MatrixError(f"--max-tokens {max_tokens}: must be at least 1")
    if limit is not None and limit < 1:
        raise MatrixError(f"--limit {limit}: must be at least 1")
    if half not in (None, "all", "even", "odd"):
        raise MatrixError(f"--half {half!r}: choose even, odd or all")
    if half == "all":
        half = None
    plan = Plan(workloads, methods, configs, batch_sizes, concurrency, max_tokens, half, limit)
    for w in workloads:
        try:
            plan.rows[w] = load_workload(w, half=half, limit=limit)
        except (OSError, ValueError) as e:
            raise MatrixError(f"--workloads {w}: {e}") from None
        if not plan.rows[w]:
            raise MatrixError(f"--workloads {w}: no requests selected (--half, --limit)")
    return plan


# ------------------------------------------------------------------ cells
def run_batch_pass(model: str, method: str, speculative_config: dict | None,
                   prompts: list[dict], batch_size: int, max_tokens: int, log: Path,
                   raw_path: Path, engine: dict | None = None) -> dict:
    """``prompts`` in batches of ``batch_size`` (only: no one-at-a-time pass)
    in a fresh engine (``bench.worker``); its output (``batch`` holds the
    token ids) is kept at ``raw_path``, with the 1-minute load average after
    it (``load_1min``)."""
    cfg = {"method_name": method, "model": model, "speculative_config": speculative_config,
           "prompts": prompts, "max_tokens": max_tokens, "temperature": 0.0,
           "repeat": 0, "batch_size": batch_size, "engine": engine or {}}
    out = run_worker(cfg, log, raw_path)
    out["load_1min"] = os.getloadavg()[0]
    return out


def cell_header(plan: Plan, model: str, workload: str, method: str, cell: str) -> dict:
    """What a cell's result depends on: ``--reuse-raw`` reads a raw cell back
    only when its header is this one."""
    return {"workload": workload, "method": method, "cell": cell, "model": model,
            "speculative_config": plan.configs[method], "max_tokens": plan.max_tokens,
            "half": plan.half, "limit": plan.limit, "max_model_len": MAX_MODEL_LEN,
            "request_ids": [r["id"] for r in plan.rows[workload]]}


def run_cell(plan: Plan, model: str, workload: str, method: str, cell: str,
             out: Path) -> dict:
    """Run one cell in a fresh engine or server; its outputs and counters."""
    rows = plan.rows[workload]
    stem = f"{workload}.{method}.{cell}"
    if cell.startswith("bs"):
        part = out / "raw" / f"{stem}.worker.json"
        res = run_batch_pass(model, method, plan.configs[method], rows, int(cell[2:]),
                             plan.max_tokens, out / "engine.log", part,
                             engine={"max_model_len": MAX_MODEL_LEN})
        part.unlink(missing_ok=True)   # its content is the cell's
        cell_out = {**res["batch"], "kind": "batch", "size": int(cell[2:]),
                    "engine_start_seconds": res["engine_start_seconds"],
                    "drafter_stats": res.get("drafter_stats"), "load_1min": res["load_1min"]}
    else:
        (out / "server").mkdir(exist_ok=True)
        try:
            cell_out = served.serve_run(model, plan.configs[method], rows, int(cell[1:]),
                                        plan.max_tokens, out / "server" / f"{stem}.log",
                                        out / "server" / f"{stem}.drafter_stats.json",
                                        MAX_MODEL_LEN)
        except (RuntimeError, OSError) as e:
            raise BenchError(f"{stem}: {e}") from None
        cell_out.update(kind="serve", size=int(cell[1:]), load_1min=os.getloadavg()[0])
    return cell_out


def _cell_raw(plan: Plan, model: str, workload: str, method: str, cell: str, out: Path,
              reuse_raw: bool) -> tuple[dict, bool]:
    """The cell's raw result, read back (``reuse_raw`` and a raw file with
    the same header) or run now and written; and whether it was run."""
    path = out / "raw" / f"{workload}.{method}.{cell}.json"
    header = cell_header(plan, model, workload, method, cell)
    if reuse_raw and path.exists():
        raw = json.loads(path.read_text())
        old = raw.get("header") or {}
        changed = sorted(k for k in set(header) | set(old) if header.get(k) != old.get(k))
        if changed:
            raise MatrixError(f"--reuse-raw: {path} was run with other settings "
                              f"({', '.join(changed)} differ); rerun without --reuse-raw, "
                              f"or with another --out")
        return raw, False
    try:
        raw = run_cell(plan, model, workload, method, cell, out)
    except BenchError as e:
        raise MatrixError(f"cell {workload} {method} {cell} failed: {e}") from None
    raw["header"] = header
    path.write_text(json.dumps(raw))
    return raw, True


def run_matrix(model: str | None = None, out: Path | str = "bench_matrix", *,
               workloads=DEFAULT_WORKLOADS, methods=DEFAULT_METHODS,
               batch_sizes=DEFAULT_BATCH_SIZES, concurrency=DEFAULT_CONCURRENCY,
               max_tokens: int = DEFAULT_MAX_TOKENS, half: str | None = DEFAULT_HALF,
               limit: int | None = None, overrides: dict[str, dict] | None = None,
               eagle_head: str | None = None, reuse_raw: bool = False,
               log: Callable[[str], None] = print) -> dict:
    """Run the matrix (see the module doc): every option is checked and every
    workload loaded before the first engine starts (``MatrixError``).
    ``model`` None: the embedded model. Returns results.json's object."""
    plan = make_plan(workloads, methods, batch_sizes, concurrency, max_tokens=max_tokens,
                     half=half, limit=limit, overrides=overrides, eagle_head=eagle_head)
    if model is None:
        from ..models import default_model_path

        model = default_model_path()
    out = Path(out)
    (out / "raw").mkdir(parents=True, exist_ok=True)
    log_path = out / "engine.log"
    if not (reuse_raw and log_path.exists()):
        log_path.write_text("")
    todo = [(w, cell, m) for w in plan.workloads for cell in plan.cells for m in plan.methods]
    log(f"bench matrix: {len(plan.workloads)} workload(s) x {len(plan.cells)} cells x "
        f"{len(plan.methods)} methods = {len(todo)} runs, each in a fresh engine or server")
    raws: dict[tuple[str, str, str], dict] = {}
    for k, (w, cell, m) in enumerate(todo, 1):
        t = time.perf_counter()
        raw, ran = _cell_raw(plan, model, w, m, cell, out, reuse_raw)
        raws[w, m, cell] = raw
        tps = raw["generated"] / raw["seconds"] if raw["seconds"] else float("nan")
        log(f"[{k}/{len(todo)}] {w} {cell} {m}: {tps:.1f} tokens/s"
            + (f" ({time.perf_counter() - t:.0f} s)" if ran else " (raw read back)"))
    res = analyse(plan, model, raws)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "matrix.md").write_text(markdown(res))
    try:
        plot(res, out / "matrix.png")
    except ImportError:
        log("matplotlib is not installed: no matrix.png")
    return res


# ------------------------------------------------------------------ analysis
def analyse(plan: Plan, model: str, raws: dict[tuple[str, str, str], dict]) -> dict:
    """Per workload, method and cell: tokens/s, tau, the ratios to plain's
    and to suffix's tokens/s in the same cell, and how many outputs are
    identical to plain's."""
    busy_load = (os.cpu_count() or 1) + LOAD_SLACK
    res: dict = {"model": model, "environment": environment(),
                 "settings": {"methods": plan.methods, "speculative_configs": plan.configs,
                              "batch_sizes": plan.batch_sizes,
                              "concurrency": plan.concurrency, "max_tokens": plan.max_tokens,
                              "half": plan.half, "limit": plan.limit,
                              "max_model_len": MAX_MODEL_LEN, "temperature": 0.0},
                 "workloads": {}, "busy_cells": []}
    for w in plan.workloads:
        rows = plan.rows[w]
        entry: dict = {"requests": len(rows), "sessions": len({session_key(r) for r in rows}),
                       "cells": plan.cells, "methods": {}}
        for m in plan.methods:
            entry["methods"][m] = {}
            for cell in plan.cells:
                raw, plain = raws[w, m, cell], raws[w, "plain", cell]
                e = batch_entry(raw, plain)
                e.pop("batches", None)
                diff = differing_ids(raw, plain)
                e.update(kind=raw["kind"], size=raw["size"], requests=len(raw["token_ids"]),
                         identical=len(raw["token_ids"]) - len(diff), differing_ids=diff,
                         load_1min=raw.get("load_1min"),
                         engine_start_seconds=raw.get("engine_start_seconds"))
                if raw["kind"] == "serve":
                    e["in_flight"] = raw.get("in_flight")
                if (raw.get("load_1min") or 0) > busy_load:
                    res["busy_cells"].append(f"{w} {cell} {m} (load {raw['load_1min']:.1f})")
                entry["methods"][m][cell] = e
        for m in plan.methods:
            for cell in plan.cells:
                e = entry["methods"][m][cell]
                ref = entry["methods"].get(REFERENCE, {}).get(cell)
                e["vs_suffix"] = (e["tokens_per_second"] / ref["tokens_per_second"]
                                  if ref and ref["tokens_per_second"] else None)
        res["workloads"][w] = entry
    return res


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None or x != x else f"{x:{spec}}{suffix}"


def entry_text(e: dict, method: str) -> str:
    """A table entry: tokens/s, then (not for plain) x plain and x suffix;
    ``≠k/n`` where k of the cell's n outputs differ from plain's."""
    text = _fmt(e["tokens_per_second"], ".1f")
    if method != "plain":
        text += f" / {_fmt(e.get('speedup'), '.2f', 'x')}"
        if method != REFERENCE:
            text += f" / {_fmt(e.get('vs_suffix'), '.2f', 'x')}"
    if e["identical"] != e["requests"]:
        text += f" ≠{e['requests'] - e['identical']}/{e['requests']}"
    return text


def markdown(res: dict) -> str:
    s, env = res["settings"], res["environment"]
    cells = next(iter(res["workloads"].values()))["cells"]
    kinds = []
    if any(c.startswith("bs") for c in cells):
        kinds.append("`bsN`: offline in fixed batches of N (sessions turn by turn)")
    if any(c.startswith("c") for c in cells):
        kinds.append("`cC`: `vllm serve` driven by C concurrent clients (sessions turn by "
                     "turn, at most C in flight)")
    lines = ["# Benchmark matrix", "",
             f"{env.get('date')}, commit `{env.get('commit')}`, {env.get('cpu')} "
             f"({env.get('cores')} cores), vLLM {env.get('vllm')}; model {res['model']}; "
             f"greedy, {s['max_tokens']} tokens; half {s['half'] or 'all'}"
             + (f", first {s['limit']} sessions" if s["limit"] else "")
             + "; each method in a fresh engine or server per cell.", "",
             "; ".join(kinds) + ".", "",
             f"Entry: tokens/s / x plain / x `{REFERENCE}` (same cell); plain: tokens/s; "
             f"`{REFERENCE}`: tokens/s / x plain. **≠k/n**: k of the cell's n outputs differ "
             f"from plain decoding's (token ids); no mark: all identical.", ""]
    for w, entry in res["workloads"].items():
        lines += [f"## {w} ({entry['requests']} requests, {entry['sessions']} sessions)", "",
                  "| method | " + " | ".join(cells) + " |", "|---|" + "---|" * len(cells)]
        for m, by_cell in entry["methods"].items():
            lines.append(f"| {m} | " + " | ".join(entry_text(by_cell[c], m) for c in cells)
                         + " |")
        few = [c for c in cells if c.startswith("c") and int(c[1:]) > entry["sessions"]]
        if few:
            lines += ["", f"{', '.join(few)}: at most {entry['sessions']} sessions in flight "
                          f"(the workload has no more)."]
        lines.append("")
    if res["busy_cells"]:
        lines += [f"Busy machine (1-minute load above cores + {LOAD_SLACK}) after: "
                  + "; ".join(res["busy_cells"]) + ".", ""]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    """Speedup over plain per cell, a panel per workload, a bar per method;
    hatched bars: some outputs differ from plain's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(res["workloads"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4.2),
                             squeeze=False)
    for ax, w in zip(axes[0], workloads):
        entry = res["workloads"][w]
        cells = entry["cells"]
        methods = [m for m in entry["methods"] if m != "plain"]
        width = 0.8 / max(len(methods), 1)
        for j, m in enumerate(methods):
            es = [entry["methods"][m][c] for c in cells]
            xs = [i - 0.4 + width * (j + 0.5) for i in range(len(cells))]
            bars = ax.bar(xs, [e.get("speedup") or 0.0 for e in es], width, label=m)
            for bar, e in zip(bars, es):
                if e["identical"] != e["requests"]:
                    bar.set_hatch("//")
                    bar.set_edgecolor("black")
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks(range(len(cells)), cells)
        ax.set_title(f"{w} ({entry['requests']} requests)")
        ax.set_ylabel("tokens/s over plain's (same cell)")
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=max(len(labels), 1), fontsize=8)
    fig.suptitle("specplug bench matrix (hatched: outputs differ from plain)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ command
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specplug bench matrix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=None,
                   help=f"comma-separated, of {', '.join(sorted(WORKLOADS))} "
                        f"(default: {','.join(DEFAULT_WORKLOADS)})")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="comma-separated: plain (always run: the reference), vLLM's ngram "
                        "and suffix, our methods, NAME@LABEL variants (default: %(default)s)")
    p.add_argument("--batch-sizes", default=None, metavar="N,N,...",
                   help="fixed offline batch sizes (default: "
                        f"{','.join(map(str, DEFAULT_BATCH_SIZES))})")
    p.add_argument("--concurrency", default=None, metavar="C,C,...",
                   help="concurrent clients of a served run (default: "
                        f"{','.join(map(str, DEFAULT_CONCURRENCY))})")
    p.add_argument("--no-serve", action="store_true", help="fixed batches only")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="only the first N sessions (requests) of each workload, after --half "
                   "(Spec-Bench: a category at a time, so every category is in)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"tokens per request (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--half", choices=("even", "odd", "all"), default=DEFAULT_HALF,
                   help="the sessions at odd (default: the half not tuned on) or even positions "
                        "in each category, or all")
    p.add_argument("--speculative-config", action="append", default=[], metavar="METHOD=JSON",
                   help="override a method's config (METHOD@LABEL=JSON: a variant; name it in "
                        "--methods)")
    p.add_argument("--eagle-head", default=None, metavar="DIR",
                   help="EAGLE head folder for eagle, eagle2 and sam_eagle2")
    p.add_argument("--model", default=None,
                   help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="bench_matrix")
    p.add_argument("--reuse-raw", action="store_true",
                   help="cells already in OUT/raw with the same settings (an interrupted run) "
                        "are read back, not run again")
    p.add_argument("--quick", action="store_true",
                   help="a smoke test: spec_bench, limit 4, 32 tokens, batch sizes 1,4, "
                        "concurrency 1,4 (options given beside it win)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    q = QUICK if args.quick else {}

    def pick(given, key, default):
        return given if given is not None else q.get(key, default)

    concurrency = [] if args.no_serve else pick(args.concurrency, "concurrency",
                                                DEFAULT_CONCURRENCY)
    if args.model is not None and not Path(args.model).exists() and "/" not in args.model:
        raise SystemExit(f"--model {args.model!r}: no such folder (no model hub is used here)")
    t0 = time.perf_counter()
    try:
        res = run_matrix(args.model, Path(args.out),
                         workloads=pick(args.workloads, "workloads", DEFAULT_WORKLOADS),
                         methods=args.methods,
                         batch_sizes=pick(args.batch_sizes, "batch_sizes", DEFAULT_BATCH_SIZES),
                         concurrency=concurrency,
                         max_tokens=pick(args.max_tokens, "max_tokens", DEFAULT_MAX_TOKENS),
                         half=args.half, limit=pick(args.limit, "limit", None),
                         overrides=parse_overrides(args.speculative_config),
                         eagle_head=args.eagle_head, reuse_raw=args.reuse_raw)
    except MatrixError as e:
        raise SystemExit(f"bench matrix: {e}")
    print(markdown(res))
    print(f"Took {time.perf_counter() - t0:.0f} s; written to {args.out}/ (matrix.md, "
          f"matrix.png, results.json, raw/)")
    differing = [f"{w} {m} {c}" for w, e in res["workloads"].items()
                 for m, by_cell in e["methods"].items() for c, x in by_cell.items()
                 if x["identical"] != x["requests"]]
    if differing:
        print(f"WARNING: outputs differ from plain decoding's in {len(differing)} cell(s): "
              f"{'; '.join(differing)}", file=sys.stderr)
    return 0
