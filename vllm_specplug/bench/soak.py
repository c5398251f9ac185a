"""``specplug bench soak``: memory of a long-running server under mixed traffic.

For each method a real server (``python -m vllm_specplug vllm serve`` with the
embedded model, or ``--model``) gets the same traffic:

* prompts of the benchmark workloads (Spec-Bench, pipeline, agentic first
  turns), each cut at a random length;
* random ``max_tokens``, greedy and sampled requests (temperature 0.7 / 1.0),
  stop strings;
* about ``ABORT_SHARE`` of the requests aborted mid-stream (the client hangs
  up after its first chunks: the server aborts the request);
* bursts of ``BURST`` concurrent streamed requests, one burst after another.

Every ``--sample-every`` requests (at a burst boundary, once the drafter holds
no request state) it samples the resident memory (RSS) of the server's whole
process tree (the API server, the engine core and their children, summed) and
of the engine process alone, with the drafter's stats (``stats_export``: the
size of every bounded structure, see docs/architecture.md, "Bounds").

Pass rule (``check``): from the sample at ``--baseline`` requests (1,000 by
default) to the last, each method's tree RSS grows by at most plain
decoding's growth + the global store's own reported byte growth (zero once
it is full) + ``SLACK_MB``.

``--offline --tracemalloc``: the same traffic through an in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so vLLM's worker and our drafter run in
this process, no aborts), with Python allocations traced from the baseline
sample to the end: the top sources of growth, grouped by traceback, go to
the JSON.

Output: ``OUT/<date>_<method>/soak.json`` per method, and with more than one
method ``OUT/<date>_summary.json`` (the pass table) and ``soak.png``.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

BURST = 16
ABORT_SHARE = 0.05
SLACK_MB = 10.0
MB = 1e6
STOPS = [None, None, None, ["."], ["\n"], [",", ";"]]
TEMPERATURES = [0.0, 0.0, 0.7, 1.0]
# prompts are cut at a random length in this range (characters): prefill runs
# at a few hundred tokens a second on a 2-core CPU
PROMPT_CHARS = (80, 700)
MAX_TOKENS = (8, 64)
WORKLOADS = ("spec_bench", "pipeline", "agentic")


# ------------------------------------------------------------------ traffic
def soak_requests(n: int, seed: int = 0) -> list[dict]:
    """``n`` requests (dicts: i, prompt, temperature, max_tokens, stop,
    abort_after (chunks read before the client hangs up, or None), seed)."""
    from .workloads import load_workload

    pool = [r["prompt"] for w in WORKLOADS for r in load_workload(w)
            if int(r.get("turn", 0)) == 0]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = rng.choice(pool)
        cut = rng.randint(*PROMPT_CHARS)
        if len(text) > cut:
            text = text[:cut].rsplit(" ", 1)[0] + " ..."
        temperature = rng.choice(TEMPERATURES)
        out.append({"i": i, "prompt": text, "temperature": temperature,
                    "max_tokens": rng.randint(*MAX_TOKENS), "stop": rng.choice(STOPS),
                    "abort_after": rng.choice([1, 2, 4]) if rng.random() < ABORT_SHARE else None,
                    "seed": rng.randrange(1 << 30) if temperature > 0 else None})
    return out


def speculative_config(method: str) -> dict | None:
    from .run import method_config

    return method_config(method)


# ------------------------------------------------------------------ memory
def tree_rss(pid: int) -> tuple[int, dict[int, int]]:
    """(summed RSS of ``pid`` and all its descendants, RSS by pid)."""
    import psutil

    by_pid = {}
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            by_pid[p.pid] = p.memory_info().rss
        except psutil.Error:
            continue
    return sum(by_pid.values()), by_pid


def memory_kinds(pid: int, large: int = 1 << 30) -> dict[str, float] | None:
    """Where a process's resident memory is, in MB (from /proc/PID/smaps):
    ``heap``, glibc's main heap (brk); ``large``, anonymous mappings of
    ``large`` bytes or more (1 GiB: the KV cache); ``other_anon``, every other anonymous mapping
    (thread arenas, large mallocs, torch); ``file``, mapped files (libraries).
    None when it cannot be read."""
    kinds = {"heap": 0, "large": 0, "other_anon": 0, "file": 0}
    kind = None
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(maxsplit=6)
                if "-" in head[0] and len(head) >= 5 and ":" in head[3]:
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    path = head[5].strip() if len(head) > 5 else ""
                    kind = ("heap" if path == "[heap]" else
                            "file" if path.startswith("/") else
                            "large" if hi - lo >= large else "other_anon")
                elif head[0] == "Rss:" and kind:
                    kinds[kind] += int(head[1])
    except OSError:
        return None
    return {k: round(v / 1024, 1) for k, v in kinds.items()}


def find_key(obj: Any, key: str) -> Any:
    """The first value of ``key`` anywhere in nested dicts (None if absent)."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for v in obj.values():
            found = find_key(v, key)
            if found is not None:
                return found
    return None


# ------------------------------------------------------------------ served
async def _stream(client, r: dict, counts: dict) -> None:
    try:
        stream = await client.chat.completions.create(
            model="soak", messages=[{"role": "user", "content": r["prompt"]}],
            temperature=r["temperature"], max_tokens=r["max_tokens"], stop=r["stop"],
            seed=r["seed"], stream=True)
        chunks = 0
        async for _ in stream:
            chunks += 1
            if r["abort_after"] is not None and chunks >= r["abort_after"]:
                await stream.close()
                counts["aborted"] += 1
                break
        counts["done"] += 1
    except Exception as e:  # noqa: BLE001 - every error is counted and reported
        counts["errors"] += 1
        counts.setdefault("first_errors", []).append(f"{r['i']}: {type(e).__name__}: {e}")


async def _bursts(base: str, reqs: list[dict], counts: dict) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
    try:
        for i in range(0, len(reqs), BURST):
            await asyncio.gather(*[_stream(client, r, counts) for r in reqs[i:i + BURST]])
    finally:
        await client.close()


def _wait_idle(stats_file: Path, timeout: float = 30.0) -> dict | None:
    from ..stats_files import read

    deadline = time.time() + timeout
    stats = None
    while time.time() < deadline:
        try:
            stats = read(str(stats_file))
        except (OSError, ValueError):
            stats = None
        if stats is None or stats.get("active_requests") == 0:
            break
        time.sleep(0.5)
    return stats


def malloc_trim(pid: int) -> str:
    """Ask glibc in process ``pid`` to give its free heap memory back to the
    system (``malloc_trim(0)``, called through gdb); returns gdb's answer.
    What the process's RSS loses is memory glibc held free, not live data."""
    import subprocess

    if shutil.which("gdb") is None:
        raise SystemExit("--trim needs gdb (apt-get install gdb)")
    # only libc's symbols: loading every library's (torch's) takes seconds
    out = subprocess.run(["gdb", "-nx", "-p", str(pid), "-batch",
                          "-iex", "set debuginfod enabled off",
                          "-iex", "set auto-solib-add off",
                          "-ex", r"sharedlibrary libc\.", "-ex", "call (int)malloc_trim(0)"],
                         capture_output=True, text=True, timeout=120)
    return next((ln for ln in out.stdout.splitlines() if ln.startswith("$")),
                out.stderr.strip()[-200:])


def run_served(model: str, method: str, reqs: list[dict], sample_every: int,
               out_dir: Path, max_model_len: int = 2048, spec: dict | None = None,
               trim: str | None = None, on_sample=None,
               extra_env: dict[str, str] | None = None) -> dict:
    """The soak of one method through a server (``spec``: its speculative
    config, default the method's own). ``on_sample(samples, counts)`` runs
    after every sample (main writes the partial result, so a run cut short
    keeps what it measured)."""
    from .server import running_server

    spec = spec if spec is not None else speculative_config(method)
    stats_file = out_dir / "drafter_stats.json"
    args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len),
            "--served-model-name", "soak", "--seed", "0"]
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec)]
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "VLLM_SPECPLUG_STATS_FILE": str(stats_file),
           "VLLM_SPECPLUG_STATS_INTERVAL": "1", **(extra_env or {})}
    samples: list[dict] = []
    counts = {"done": 0, "aborted": 0, "errors": 0}
    t0 = time.time()
    with running_server(model, args, out_dir / "server.log", env=env) as base:
        import psutil

        port = base.rsplit(":", 1)[1]
        server = next(p for p in psutil.Process(os.getpid()).children()
                      if port in " ".join(p.cmdline()))
        started = time.time() - t0
        for done in range(sample_every, len(reqs) + 1, sample_every):
            asyncio.run(_bursts(base, reqs[done - sample_every:done], counts))
            stats = _wait_idle(stats_file) if spec is not None else None
            if trim == "each":     # RSS without what glibc holds free: live memory
                for pid in tree_rss(server.pid)[1]:
                    malloc_trim(pid)
            total, by_pid = tree_rss(server.pid)
            engine_pid = stats["pid"] if stats else None
            samples.append(_sample(done, t0, total, by_pid, engine_pid, stats, counts))
            _progress(method, samples[-1])
            if on_sample is not None:
                on_sample(samples, counts)
        after_trim = None
        if trim == "end":    # after the last sample: how much of the RSS is glibc's free memory
            answers = {str(pid): malloc_trim(pid) for pid in by_pid}
            total, by_pid = tree_rss(server.pid)
            after_trim = dict(_sample(samples[-1]["requests"], t0, total, by_pid, engine_pid,
                                      None, counts), malloc_trim=answers)
            print(f"soak {method}: after malloc_trim(0) in every server process, tree RSS "
                  f"{after_trim['tree_rss_mb']:.1f} MB (was {samples[-1]['tree_rss_mb']:.1f})",
                  flush=True)
    return {"method": method, "mode": "served", "speculative_config": spec,
            "after_trim": after_trim, "trim": trim, "extra_env": extra_env or {},
            "ld_preload": os.environ.get("LD_PRELOAD"),
            "server_start_s": round(started, 1), "counts": counts, "samples": samples}


def _sample(done: int, t0: float, total: int, by_pid: dict, engine_pid, stats, counts) -> dict:
    return {"requests": done, "seconds": round(time.time() - t0, 1),
            "tree_rss_mb": round(total / MB, 2),
            "engine_rss_mb": (round(by_pid[engine_pid] / MB, 2)
                              if engine_pid in by_pid else None),
            "rss_by_pid_mb": {str(k): round(v / MB, 2) for k, v in by_pid.items()},
            "memory_kinds_mb": {str(k): memory_kinds(k) for k in by_pid},
            "errors": counts["errors"], "drafter": stats}


def _progress(method: str, s: dict) -> None:
    print(f"soak {method}: {s['requests']} requests, {s['seconds']} s, tree RSS "
          f"{s['tree_rss_mb']:.1f} MB, engine {s['engine_rss_mb']}, errors {s['errors']}",
          flush=True)


# ------------------------------------------------------------------ offline
def run_offline(model: str, method: str, reqs: list[dict], sample_every: int,
                baseline: int, trace: bool, top: int = 30) -> dict:
    """The same traffic through an in-process engine (no aborts); with
    ``trace``, tracemalloc from the ``baseline`` sample to the end."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import gc
    import tracemalloc

    from vllm import SamplingParams

    from .engine import build_llm, read_drafter_stats

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    llm = build_llm(model, speculative_config(method), max_model_len=2048)
    samples, counts, snap0, t0 = [], {"done": 0, "aborted": 0, "errors": 0}, None, time.time()
    for done in range(sample_every, len(reqs) + 1, sample_every):
        part = reqs[done - sample_every:done]
        for i in range(0, len(part), BURST):
            burst = part[i:i + BURST]
            llm.chat([[{"role": "user", "content": r["prompt"]}] for r in burst],
                     [SamplingParams(temperature=r["temperature"], max_tokens=r["max_tokens"],
                                     stop=r["stop"], seed=r["seed"]) for r in burst],
                     use_tqdm=False)
            counts["done"] += len(burst)
        gc.collect()
        total, by_pid = tree_rss(os.getpid())
        stats = read_drafter_stats(llm)
        samples.append(_sample(done, t0, total, by_pid, os.getpid(), stats, counts))
        if trace:
            samples[-1]["traced_mb"] = (round(tracemalloc.get_traced_memory()[0] / MB, 2)
                                        if tracemalloc.is_tracing() else None)
        _progress(method, samples[-1])
        if trace and done >= baseline and snap0 is None:
            tracemalloc.start(25)
            snap0 = tracemalloc.take_snapshot()
    out = {"method": method, "mode": "offline", "speculative_config": speculative_config(method),
           "counts": counts, "samples": samples}
    if trace and snap0 is not None:
        snap1 = tracemalloc.take_snapshot()
        out["tracemalloc"] = top_growth(snap0, snap1, top)
        tracemalloc.stop()
    return out


def top_growth(snap0, snap1, top: int) -> dict:
    """The ``top`` sources of growth between two snapshots, grouped by
    traceback and by file, and the total."""
    import tracemalloc

    filters = [tracemalloc.Filter(False, tracemalloc.__file__)]
    snap0, snap1 = snap0.filter_traces(filters), snap1.filter_traces(filters)
    out: dict = {"total_diff_kb": round(sum(s.size_diff for s in snap1.compare_to(
        snap0, "filename")) / 1e3, 1)}
    for key in ("traceback", "filename"):
        out[f"by_{key}"] = [
            {"size_diff_kb": round(stat.size_diff / 1e3, 1), "count_diff": stat.count_diff,
             "size_kb": round(stat.size / 1e3, 1),
             "where": [f"{f.filename}:{f.lineno}" for f in stat.traceback][-12:]}
            for stat in snap1.compare_to(snap0, key)[:top]]
    return out


# ------------------------------------------------------------------ pass rule
def growth(result: dict, baseline: int, until: int | None = None) -> dict:
    """Tree RSS and store byte growth from the sample at ``baseline``
    requests (the first at or past it) to the last (the last at or below
    ``until`` when given)."""
    samples = [s for s in result["samples"] if until is None or s["requests"] <= until]
    if not samples:
        return {"from": None, "to": None, "rss_mb": None, "store_mb": None}
    base = next((s for s in samples if s["requests"] >= baseline), None)
    last = samples[-1]
    if base is None or base is last:
        return {"from": None, "to": last["requests"], "rss_mb": None, "store_mb": None}
    store0 = find_key(base.get("drafter"), "global_store_bytes") or 0
    store1 = find_key(last.get("drafter"), "global_store_bytes") or 0
    return {"from": base["requests"], "to": last["requests"],
            "rss_mb": round(last["tree_rss_mb"] - base["tree_rss_mb"], 2),
            "store_mb": round(max(store1 - store0, 0) / MB, 2)}


def check(results: dict[str, dict], baseline: int, slack_mb: float = SLACK_MB) -> dict:
    """Per method: its growth, the allowance (plain's growth + its store's
    byte growth + ``slack_mb``) and whether it passes. Every method is
    judged over the same requests: up to the last sample all of them reached
    (a run cut short, ``complete: false``, shortens the window for all)."""
    until = min((res["samples"][-1]["requests"] for res in results.values() if res["samples"]),
                default=None)
    plain = growth(results["plain"], baseline, until) if "plain" in results else None
    table = {}
    for method, res in results.items():
        g = growth(res, baseline, until)
        row = {**g, "allowance_mb": None, "pass": None}
        if method != "plain" and plain and plain["rss_mb"] is not None \
                and g["rss_mb"] is not None:
            row["allowance_mb"] = round(plain["rss_mb"] + g["store_mb"] + slack_mb, 2)
            row["pass"] = g["rss_mb"] <= row["allowance_mb"]
        table[method] = row
    return table


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for method, res in results.items():
        xs = [s["requests"] for s in res["samples"]]
        ax.plot(xs, [s["tree_rss_mb"] for s in res["samples"]], marker=".", label=method)
    ax.set_xlabel("requests finished")
    ax.set_ylabel("RSS of the server's process tree (MB)")
    ax.set_title("specplug bench soak")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_results(paths: list[Path]) -> dict[str, dict]:
    out = {}
    for p in paths:
        res = json.loads(Path(p).read_text())
        out[res["method"]] = res
    return out


# ------------------------------------------------------------------ command
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specplug bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="plain,sam,token_recycling,sam_tr",
                   help="comma-separated; plain is the reference of the pass rule")
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--sample-every", type=int, default=100,
                   help="requests between memory samples (a multiple of the burst, 16, "
                        "is not needed: bursts are cut at samples)")
    p.add_argument("--baseline", type=int, default=1000,
                   help="the pass rule measures growth from this many requests on")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--seed", type=int, default=0, help="the traffic's seed")
    p.add_argument("--out", default="results/soak")
    p.add_argument("--tag", default=None, help="folder name prefix (default: today's date)")
    p.add_argument("--offline", action="store_true",
                   help="an in-process engine instead of a server (no aborts)")
    p.add_argument("--tracemalloc", action="store_true",
                   help="with --offline: trace Python allocations from --baseline on")
    p.add_argument("--trim", nargs="?", const="end", choices=("end", "each"), default=None,
                   help="served, needs gdb: call glibc's malloc_trim(0) in every server "
                        "process; 'end' (the default with --trim): after the last sample, then "
                        "sample again (the RSS that goes is free memory glibc kept, not live "
                        "data); 'each': before every sample, so the samples and the pass rule "
                        "see live memory only")
    p.add_argument("--malloc-trim-s", default=None, metavar="SECONDS",
                   help="the servers' VLLM_SPECPLUG_MALLOC_TRIM_S (the plugin's own trim of "
                        "glibc's free memory in the drafter's process; default: the "
                        "plugin's default, 60; 0: off)")
    p.add_argument("--combine", nargs="*", default=None, metavar="SOAK_JSON",
                   help="no run: the pass table and plot of earlier soak.json files")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    tag = args.tag or datetime.date.today().isoformat()
    out = Path(args.out)
    if args.combine is not None:
        results = load_results([Path(p) for p in args.combine])
    else:
        if args.trim and (args.offline or shutil.which("gdb") is None):
            raise SystemExit("--trim: served runs only, and it needs gdb (apt-get install gdb)")
        if args.tracemalloc and not args.offline:
            raise SystemExit("--tracemalloc needs --offline (the engine in this process)")
        if args.requests < args.sample_every:
            raise SystemExit(f"--requests {args.requests} is below --sample-every "
                             f"{args.sample_every}")
        extra_env = {}
        if args.malloc_trim_s is not None:
            from ..malloc_trim import ENV, interval_from_env

            interval_from_env({ENV: args.malloc_trim_s})   # a bad value fails here
            extra_env[ENV] = args.malloc_trim_s
        model = args.model
        if model is None:
            from ..models import default_model_path

            model = default_model_path()
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        for m in methods:
            speculative_config(m)  # unknown names fail before any server starts
        reqs = soak_requests(args.requests, args.seed)
        results = {}
        info = {"requests": args.requests, "seed": args.seed, "burst": BURST,
                "abort_share": ABORT_SHARE, "command": "specplug bench soak " + " ".join(argv)}
        for method in methods:
            d = out / f"{tag}_{method}{'_offline' if args.offline else ''}"
            d.mkdir(parents=True, exist_ok=True)
            if args.offline:
                os.environ.update(extra_env)      # the engine runs in this process
                res = run_offline(model, method, reqs, args.sample_every, args.baseline,
                                  args.tracemalloc)
            else:
                def partial(samples, counts, d=d, method=method):
                    (d / "soak.json").write_text(json.dumps(dict(
                        info, method=method, mode="served", trim=args.trim, counts=counts,
                        samples=samples, complete=False), indent=1))

                res = run_served(model, method, reqs, args.sample_every, d, trim=args.trim,
                                 on_sample=partial, extra_env=extra_env)
            res.update(info, complete=True)
            (d / "soak.json").write_text(json.dumps(res, indent=1))
            results[method] = res
    table = check(results, args.baseline)
    for method, row in table.items():
        print(f"{method}: RSS {row['rss_mb']} MB from request {row['from']} to {row['to']}, "
              f"store +{row['store_mb']} MB, allowance {row['allowance_mb']}, "
              f"pass {row['pass']}")
    if len(results) > 1:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{tag}_summary.json").write_text(json.dumps(
            {"baseline": args.baseline, "slack_mb": SLACK_MB, "table": table}, indent=1))
        plot(results, out / f"{tag}_soak.png")
    return 0 if all(r["pass"] in (True, None) for r in table.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
