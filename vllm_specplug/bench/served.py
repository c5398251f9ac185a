"""Workload rows against a running ``vllm serve`` at C concurrent clients.

Each client takes the next session (a single request is a one-turn session)
and sends its turns in order, each with the session's earlier prompts and
the server's own earlier answers in the context (``workloads.build_messages``),
as a chat user or an agent loop would; at most C sessions are in flight.
Requests are greedy and ask for the generated token ids
(``return_token_ids``), so that every output can be compared with plain
decoding's. The spec-decode counters come from the server's ``/metrics``.
Standard library only (urllib, threads): no vLLM import in this process.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from .engine import SPEC_COUNTERS, counter_delta
from .workloads import build_messages, session_key

#: one chat request: messages -> (generated token ids, generated text)
Post = Callable[[list[dict]], tuple[list[int], str]]

SERVED_NAME = "specplug"
WARMUP = [{"role": "user", "content": "Say hello."}]


def chat_post(base: str, max_tokens: int, model: str = SERVED_NAME,
              timeout: float = 900.0) -> Post:
    """A ``Post`` sending greedy chat completions of ``max_tokens`` to ``base``."""
    def post(messages: list[dict]) -> tuple[list[int], str]:
        body = {"model": model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0.0, "seed": 0, "return_token_ids": True}
        req = urllib.request.Request(base + "/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                out = json.load(r)
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"the server answered {e.code}: "
                               f"{e.read().decode(errors='replace')[:500]}") from e
        choice = out["choices"][0]
        if choice.get("token_ids") is None:
            raise RuntimeError("the server returned no token ids (return_token_ids needs "
                               "vLLM >= 0.10.2)")
        return list(choice["token_ids"]), choice["message"].get("content") or ""
    return post


def drive(post: Post, rows: list[dict], concurrency: int) -> dict:
    """Send ``rows`` (workload rows, each session's turns in order) with at
    most ``concurrency`` sessions in flight. Returns the outputs in row
    order (``ids``, ``token_ids``), each request's seconds, the total
    generated tokens and the wall-clock seconds from the first request to
    the last answer."""
    sessions: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        sessions.setdefault(session_key(r), []).append(i)
    token_ids: list[list[int] | None] = [None] * len(rows)
    latency = [0.0] * len(rows)

    def run_session(idx: list[int]) -> None:
        history: list[tuple[str, str]] = []
        for i in idx:
            t = time.perf_counter()
            ids, text = post(build_messages(rows[i], history))
            latency[i] = time.perf_counter() - t
            token_ids[i] = list(ids)
            history.append((rows[i]["prompt"], text))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(run_session, idx) for idx in sessions.values()]
        try:
            for f in futures:
                f.result()
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    seconds = time.perf_counter() - t0
    return {"ids": [r["id"] for r in rows], "token_ids": token_ids, "seconds": seconds,
            "generated": sum(len(t or ()) for t in token_ids), "latency_seconds": latency,
            "in_flight": min(concurrency, len(sessions))}


def parse_spec_metrics(text: str) -> dict:
    """The spec-decode counters (``engine.SPEC_COUNTERS``' names, summed over
    engines) in a Prometheus ``/metrics`` page; zeros without speculation."""
    out: dict = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    per_pos: dict[int, int] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode_num_"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        if not name.endswith("_total"):
            continue               # a counter's _created sample
        name = name[:-len("_total")]
        if name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[name]] += int(float(value))
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            pos = int(labels.split('position="', 1)[1].split('"', 1)[0])
            per_pos[pos] = per_pos.get(pos, 0) + int(float(value))
    out["accepted_per_pos"] = [per_pos.get(i, 0) for i in range(max(per_pos, default=-1) + 1)]
    return out


def read_spec_metrics(base: str) -> dict:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        return parse_spec_metrics(r.read().decode())


def serve_run(model: str, speculative_config: dict | None, rows: list[dict], concurrency: int,
              max_tokens: int, log: Path, stats_file: Path, max_model_len: int = 4096) -> dict:
    """One method served by a fresh ``vllm serve`` (its cross-request memory
    empty): a warm-up request (not measured), then ``drive`` at
    ``concurrency``; the spec-decode counters over the driven requests and
    the drafter's stats file beside the outputs."""
    from ..stats_files import read
    from .server import running_server, serve_args, server_env

    t0 = time.perf_counter()
    with running_server(model, serve_args(speculative_config, SERVED_NAME, max_model_len), log,
                        env=server_env(stats_file)) as base:
        start = time.perf_counter() - t0
        chat_post(base, 8)(WARMUP)
        before = read_spec_metrics(base)
        out = drive(chat_post(base, max_tokens), rows, concurrency)
        time.sleep(0.5)   # the API server counts a step just after handing on its outputs
        out.update(counter_delta(read_spec_metrics(base), before))
        if stats_file.exists():
            time.sleep(1.5)   # the drafter writes its stats at most once a second
            out["drafter_stats"] = read(str(stats_file))
    out["engine_start_seconds"] = start
    return out
