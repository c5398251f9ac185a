"""Serving-mode benchmark: vLLM's own `vllm bench serve --dataset-name spec_bench`
against `vllm serve` (through `specplug vllm`), one server per method, at one
or several client concurrencies.

Usage: python scripts/bench_serve.py [--methods plain,sam] [--num-prompts 26]
           [--output-len 128] [--concurrency 1[,4,16,32]] [--out serve_bench]
           [--rounds R] [--config NAME=JSON ...]
Writes OUT/<method>_c<C>.json (vLLM's result file) and OUT/<method>_c<C>.txt
(its report); with several concurrencies also OUT/concurrency.md (throughput
and p50/p99 time per output token against concurrency) and
OUT/concurrency.png. With several concurrencies, each level sends
max(--num-prompts, 2 * C) prompts. With --rounds R, every method's server
runs at once and each level is R interleaved rounds (OUT/interleaved.md:
paired per-round ratios to plain, which machine drift does not bias; round r
draws its own prompts, the same for every method). The benchmark workloads'
sessions at several concurrencies, outputs checked against plain's:
`specplug bench matrix` (one implementation of the server settings:
vllm_specplug/bench/server.py).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def serve_args_for(method: str) -> list[str]:
    from vllm_specplug.bench.engine import METHOD_CONFIGS
    from vllm_specplug.bench.server import serve_args

    return serve_args(METHOD_CONFIGS[method], "smollm2")


def add_method_configs(specs: list[str]) -> list[str]:
    """``--config NAME=JSON``: a named speculative config (e.g. a method with
    one option changed) benchmarked like the built-in ones. Returns the names."""
    from vllm_specplug.bench.engine import METHOD_CONFIGS

    names = []
    for spec in specs:
        name, sep, text = spec.partition("=")
        if not sep or not name:
            sys.exit(f"--config {spec!r}: give NAME=JSON, e.g. "
                     "sam_off='{\"method\": \"sam\", \"disable_by_batch_size\": 1}'")
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as e:
            sys.exit(f"--config {name}: not JSON ({e})")
        if not isinstance(cfg, dict) or "method" not in cfg:
            sys.exit(f"--config {name}: give a JSON object with a \"method\" key")
        METHOD_CONFIGS[name] = cfg
        names.append(name)
    return names


def bench_command(base: str, model: str, name: str, num_prompts: int, concurrency: int,
                  output_len: int, out: Path, dataset: Path | None = None) -> list[str]:
    """``vllm bench serve`` on Spec-Bench prompts (or the JSONL ``dataset``),
    greedy, result in OUT/NAME.json."""
    from vllm_specplug.bench.prompts import spec_bench_path

    return [sys.executable, "-m", "vllm_specplug.cli", "vllm", "bench", "serve",
            "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--base-url", base, "--model", "smollm2", "--tokenizer", model,
            "--dataset-name", "spec_bench", "--dataset-path", str(dataset or spec_bench_path()),
            "--num-prompts", str(num_prompts), "--spec-bench-output-len", str(output_len),
            "--max-concurrency", str(concurrency), "--seed", "0", "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(out), "--result-filename", f"{name}.json"]


def round_dataset(out: Path, concurrency: int, round_: int, n: int) -> Path:
    """The prompts of one round at one concurrency: ``n`` Spec-Bench questions
    drawn with seed 1000 * concurrency + round (vLLM's spec_bench loader
    ignores ``--seed``, so each round gets its own file), the same for every
    method."""
    import random

    from vllm_specplug.bench.prompts import spec_bench_path

    lines = [x for x in spec_bench_path().read_text().splitlines() if x.strip()]
    path = out / f"prompts_c{concurrency}_r{round_}.jsonl"
    path.write_text("\n".join(random.Random(1000 * concurrency + round_).sample(lines, n)) + "\n")
    return path


def server_env(method: str, out: Path) -> dict[str, str]:
    """``bench.server.server_env``, the drafter's counters in OUT/METHOD.drafter_stats.json."""
    from vllm_specplug.bench.server import server_env as env

    return env(out / f"{method}.drafter_stats.json")


def run_method(method: str, model: str, args: argparse.Namespace, out: Path,
               concurrencies: list[int]) -> dict[int, dict]:
    from vllm_specplug.bench.server import running_server

    serve_args = serve_args_for(method)
    env = server_env(method, out)
    # copied after each concurrency level
    stats_file = Path(env["VLLM_SPECPLUG_STATS_FILE"])
    log = out / f"{method}.server.log"
    results: dict[int, dict] = {}
    try:
        with running_server(model, serve_args, log, env=env) as base:
            for c in concurrencies:
                name = f"{method}_c{c}"
                n = args.num_prompts if len(concurrencies) == 1 else max(args.num_prompts,
                                                                         2 * c)
                r = subprocess.run(bench_command(base, model, name, n, c, args.output_len, out),
                                   capture_output=True, text=True)
                (out / f"{name}.txt").write_text(r.stdout + r.stderr)
                if r.returncode != 0:
                    sys.exit(f"vllm bench serve failed for {name}; see {out / (name + '.txt')}")
                start = r.stdout.find("============ Serving Benchmark Result")
                print(f"## {name}\n{r.stdout[start:] if start >= 0 else r.stdout[-3000:]}",
                      flush=True)
                results[c] = json.loads((out / f"{name}.json").read_text())
                if stats_file.exists():
                    time.sleep(1.5)  # the drafter writes at most once a second
                    (out / f"{name}.drafter_stats.json").write_text(stats_file.read_text())
    except RuntimeError as e:
        sys.exit(f"{method}: {e}")
    return results


def concurrency_report(results: dict[str, dict[int, dict]], out: Path) -> str:
    """Markdown table (and a plot) of output throughput and p50/p99 TPOT."""
    methods = list(results)
    levels = sorted({c for r in results.values() for c in r})
    lines = ["| method | " + " | ".join(f"c={c}: tok/s, p50/p99 TPOT ms" for c in levels)
             + " |", "|---|" + "---|" * len(levels)]
    for m in methods:
        cells = []
        for c in levels:
            r = results[m].get(c)
            cells.append("n/a" if r is None else
                         f"{r['output_throughput']:.1f}, {r.get('p50_tpot_ms', float('nan')):.0f}"
                         f"/{r.get('p99_tpot_ms', float('nan')):.0f}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    if "plain" in results:
        lines += ["", "Throughput relative to plain decoding at the same concurrency:", "",
                  "| method | " + " | ".join(f"c={c}" for c in levels) + " |",
                  "|---|" + "---|" * len(levels)]
        for m in methods:
            cells = []
            for c in levels:
                r, p = results[m].get(c), results["plain"].get(c)
                cells.append("n/a" if not r or not p else
                             f"{r['output_throughput'] / p['output_throughput']:.2f}x")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    md = "\n".join(lines) + "\n"
    (out / "concurrency.md").write_text(md)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for m in methods:
            cs = [c for c in levels if c in results[m]]
            axes[0].plot(cs, [results[m][c]["output_throughput"] for c in cs], "o-", label=m)
            axes[1].plot(cs, [results[m][c].get("p50_tpot_ms") for c in cs], "o-", label=m)
        for ax, title in zip(axes, ("output tokens/s", "p50 time per output token (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent clients")
            ax.set_title(title)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "concurrency.png", dpi=110)
        plt.close(fig)
    except ImportError:
        pass
    return md


def run_interleaved(methods: list[str], model: str, args: argparse.Namespace, out: Path,
                    concurrencies: list[int]) -> str:
    """Every method's server up at once; at each concurrency, ``--rounds``
    rounds, each driving every server once in turn (the order rotates each
    round). Machine drift then hits all methods alike, and each round gives
    one paired ratio to plain. Each round draws its own prompts
    (``round_dataset``), the same for every method, so later rounds do not run
    on prompts the servers' prefix caches already hold. Writes OUT/interleaved.json and .md."""
    import statistics
    from contextlib import ExitStack

    from vllm_specplug.bench.server import running_server

    rows: list[dict] = []
    with ExitStack() as stack:
        bases = {}
        for m in methods:
            try:
                bases[m] = stack.enter_context(running_server(
                    model, serve_args_for(m), out / f"{m}.server.log", env=server_env(m, out)))
            except RuntimeError as e:
                sys.exit(f"{m}: {e}")
        for c in concurrencies:
            n = max(args.num_prompts, 2 * c)
            for r in range(args.rounds):
                dataset = None if args.same_prompts else round_dataset(out, c, r, n)
                order = methods[r % len(methods):] + methods[:r % len(methods)]
                for m in order:
                    name = f"{m}_c{c}_r{r}"
                    res = subprocess.run(bench_command(bases[m], model, name, n, c,
                                                       args.output_len, out, dataset),
                                         capture_output=True, text=True)
                    (out / f"{name}.txt").write_text(res.stdout + res.stderr)
                    if res.returncode != 0:
                        sys.exit(f"vllm bench serve failed for {name}; see {out / (name + '.txt')}")
                    result = json.loads((out / f"{name}.json").read_text())
                    rows.append({"method": m, "concurrency": c, "round": r, "position":
                                 order.index(m), "output_throughput": result["output_throughput"],
                                 "p50_tpot_ms": result.get("p50_tpot_ms"),
                                 "p99_tpot_ms": result.get("p99_tpot_ms")})
                    print(f"{name}: {result['output_throughput']:.1f} tok/s", flush=True)
    (out / "interleaved.json").write_text(json.dumps(rows, indent=1))
    prompts = ("the same prompts every round" if args.same_prompts else
               "each round its own prompts, seed 1000 * c + round")
    lines = [f"{args.rounds} interleaved rounds per level ({prompts}), "
             f"{args.output_len} output tokens, greedy; throughput in output tok/s (median of "
             "rounds), ratio to plain per round (geometric mean, and min-max over rounds)", "",
             "| method | c | tok/s (median) | ratio to plain per round | geo-mean | min-max |",
             "|---|---|---|---|---|---|"]
    for c in concurrencies:
        plain = {x["round"]: x["output_throughput"] for x in rows
                 if x["method"] == "plain" and x["concurrency"] == c}
        for m in methods:
            mine = {x["round"]: x["output_throughput"] for x in rows
                    if x["method"] == m and x["concurrency"] == c}
            med = statistics.median(mine.values())
            if m == "plain" or not plain:
                lines.append(f"| {m} | {c} | {med:.1f} | | | |")
                continue
            ratios = [mine[r] / plain[r] for r in sorted(mine) if r in plain]
            geo = statistics.geometric_mean(ratios)
            lines.append(f"| {m} | {c} | {med:.1f} | "
                         + ", ".join(f"{x:.2f}" for x in ratios)
                         + f" | {geo:.2f}x | {min(ratios):.2f}-{max(ratios):.2f} |")
    md = "\n".join(lines) + "\n"
    (out / "interleaved.md").write_text(md)
    return md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="plain,sam")
    ap.add_argument("--num-prompts", type=int, default=26)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", default="1", help="one level or a comma-separated list")
    ap.add_argument("--out", default="serve_bench")
    ap.add_argument("--rounds", type=int, default=0,
                    help="interleave: all servers up at once, this many rounds per level, "
                         "methods driven in turn (paired ratios to plain)")
    ap.add_argument("--same-prompts", action="store_true",
                    help="with --rounds: every round sends the same prompts (rounds after the "
                         "first then hit warm prefix caches: decode-dominated)")
    ap.add_argument("--config", action="append", default=[], metavar="NAME=JSON",
                    help="a named speculative config usable in --methods (repeatable)")
    args = ap.parse_args()
    methods = args.methods.split(",")
    from vllm_specplug.bench.engine import METHOD_CONFIGS
    from vllm_specplug.models import default_model_path

    add_method_configs(args.config)

    unknown = [m for m in methods if m not in METHOD_CONFIGS]
    if unknown:
        sys.exit(f"unknown method(s) {unknown}; choose from {sorted(METHOD_CONFIGS)}")
    try:
        concurrencies = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        sys.exit(f"--concurrency {args.concurrency!r}: give integers, e.g. 1,4,16,32")
    model = default_model_path()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.rounds > 0:
        print(run_interleaved(methods, model, args, out, concurrencies))
        return
    results = {m: run_method(m, model, args, out, concurrencies) for m in methods}
    if len(concurrencies) > 1:
        print(concurrency_report(results, out))


if __name__ == "__main__":
    main()
