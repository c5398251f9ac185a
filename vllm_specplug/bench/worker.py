"""One method in one fresh engine: ``python -m vllm_specplug.bench.worker IN OUT``.

Prints ``@@progress`` lines for the orchestrator's progress bar.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict


def run(cfg: dict) -> dict:
    """Run ``cfg["prompts"]`` (workload rows, ``bench.workloads``) one request
    at a time, each session's turns with the method's own earlier outputs in
    the context; then, with ``batch_size`` (or the older ``batch``: all of a
    turn at once), again in batches (``workloads.batch_plan``)."""
    from vllm import SamplingParams

    from .engine import build_llm, read_drafter_stats

    t0 = time.perf_counter()
    llm = build_llm(cfg["model"], cfg["speculative_config"], **cfg.get("engine", {}))
    start_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=cfg["temperature"], max_tokens=cfg["max_tokens"],
                        seed=cfg.get("seed", 0))
    rows = [normalize(p) for p in cfg["prompts"]]
    # Warm-up (not measured): one short request.
    llm.chat([[{"role": "user", "content": "Say hello."}]],
             SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    results = []
    first_repeat = cfg.get("repeat_index", 0)   # this engine's repeats are numbered from here
    for rep in range(first_repeat, first_repeat + cfg.get("repeat", 1)):
        history: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for r in rows:
            delta, dt, outs = _timed_chat(llm, [r], history, sp)
            out = outs[0]
            ids = list(out.outputs[0].token_ids)
            results.append({"id": r["id"], "category": r["category"], "session": r["session"],
                            "turn": r["turn"], "repeat": rep,
                            "token_ids": ids, "prompt_token_ids": list(out.prompt_token_ids),
                            "generated": len(ids), "seconds": dt,
                            "decode_seconds": decode_seconds(out),
                            "ttft": time_to_first_token(out),
                            # runnable processes, 1-minute average (bench.plausibility)
                            "load_average": os.getloadavg()[0], **delta})
            print("@@progress", flush=True)
    batch = None
    batch_size = batch_size_of(cfg)
    if batch_size is not None:
        batch = _run_batches(llm, rows, batch_size, sp)
    drafter = read_drafter_stats(llm) if cfg["speculative_config"] is not None else None
    return {"engine_start_seconds": start_s, "results": results, "batch": batch,
            "drafter_stats": drafter}


def decode_seconds(out) -> float | None:
    """Engine time from the request's first to its last token (the part of
    its latency that speculation can shorten; the rest is queueing and
    prefill), from vLLM's per-request stats; None when the engine keeps no
    stats (``disable_log_stats``)."""
    m = out.metrics
    if m is None:
        return None
    return max(m.last_token_ts - m.first_token_ts, 0.0)


def time_to_first_token(out) -> float | None:
    """Seconds from the request's arrival to its first token, from vLLM's
    per-request stats (None without stats)."""
    m = out.metrics
    return None if m is None else float(m.first_token_latency)


def normalize(p: dict) -> dict:
    """A prompt row with the workload fields (older callers pass only
    ``id``, ``category``, ``prompt``)."""
    return {"session": None, "turn": 0, "system": None, **p}


def batch_size_of(cfg: dict) -> int | None:
    """The batched run's size: ``batch_size`` (0: all of a turn at once), or
    0 for the older ``batch: true``; None: no batched run."""
    if cfg.get("batch_size") is not None:
        return int(cfg["batch_size"])
    return 0 if cfg.get("batch") else None


def _timed_chat(llm, rows: list[dict], history: dict, sp):
    """One ``llm.chat`` call on ``rows`` (their sessions' history in the
    context); each output joins its session's history. Returns the
    spec-decode counter delta, the seconds and the outputs."""
    from .engine import counter_delta, read_spec_counters
    from .workloads import build_messages, session_key

    msgs = [build_messages(r, history[session_key(r)]) for r in rows]
    before = read_spec_counters(llm)
    t = time.perf_counter()
    outs = llm.chat(msgs, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    delta = counter_delta(read_spec_counters(llm), before)
    for r, o in zip(rows, outs):
        history[session_key(r)].append((r["prompt"], o.outputs[0].text))
    return delta, dt, outs


def _run_batches(llm, rows: list[dict], batch_size: int, sp) -> dict:
    """Every batch of ``workloads.batch_plan``; the totals in today's
    ``batch`` format (token ids in row order, ``ids`` beside them) and each
    batch's own entry under ``batches``."""
    from .workloads import batch_plan

    history: dict[str, list[tuple[str, str]]] = defaultdict(list)
    token_ids: dict[int, list[int]] = {}
    batches = []
    for idx in batch_plan(rows, batch_size):
        delta, dt, outs = _timed_chat(llm, [rows[i] for i in idx], history, sp)
        for i, o in zip(idx, outs):
            token_ids[i] = list(o.outputs[0].token_ids)
        batches.append({"ids": [rows[i]["id"] for i in idx], "seconds": dt,
                        "generated": sum(len(token_ids[i]) for i in idx), **delta})
        print("@@progress", flush=True)
    total = {"seconds": sum(b["seconds"] for b in batches),
             "generated": sum(b["generated"] for b in batches)}
    for k in ("drafts", "draft_tokens", "accepted"):
        total[k] = sum(b[k] for b in batches)
    width = max((len(b["accepted_per_pos"]) for b in batches), default=0)
    total["accepted_per_pos"] = [sum(b["accepted_per_pos"][j] for b in batches
                                     if j < len(b["accepted_per_pos"])) for j in range(width)]
    order = sorted(token_ids)
    return {**total, "batch_size": batch_size, "ids": [rows[i]["id"] for i in order],
            "token_ids": [token_ids[i] for i in order], "batches": batches}


def main() -> None:
    import os

    # lets the report read our drafter's stats from the engine process
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    cfg = json.load(open(sys.argv[1]))
    res = run(cfg)
    with open(sys.argv[2], "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
