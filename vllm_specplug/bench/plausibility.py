"""Flags for benchmark measurements that cannot be right, or were made on a
busy machine.

Speculation cannot beat its tau: a verify step does at least the work of a
plain decoding step (plus drafting), and prefill is the same work for both,
so a method's speedup over plain decoding is at most its tau (tokens per
target step), on every prompt and overall. A measured speedup above tau means
the timing was disturbed: plain decoding ran slower than it can (the machine
was busy), or the method ran while plain's run was slowed. Such numbers are
flagged, not presented as results.

Busy machine: the worker records the 1-minute load average after each request;
a method whose mean exceeds the number of cores by more than ``LOAD_SLACK``
shared them with other work. vLLM's CPU engine alone keeps every core busy
(its OpenMP threads plus the engine core): on the 2-core machine, runs with
nothing else on it measured means of 1.64-2.01 per method
(``results/runs/readme_2026-12-04/``); a second engine adds
about 1.

Time to first token: a method whose first or median TTFT is far above
plain's did start-up work inside its requests (``TTFT_FACTOR``).

Tolerances: overall, 5% above tau; per prompt, 10% (a single prompt's time is
noisier). In the repository's quiet runs (``results/runs/hybrid_corpus.json``,
``eagle2.json``, ``scorers_*.json``: 13 and 6 prompts, 12 methods) no prompt
crossed the per-prompt bound; in the runs made on a loaded machine
(``results/benchmarks.json``, ``del_sweep_full.json``) up to 18 of 65 prompts
did, by up to 1.55x.
"""
from __future__ import annotations

from dataclasses import dataclass

OVERALL_TOLERANCE = 0.05
# a mean 1-minute load average above cores + this means other work shared them
LOAD_SLACK = 0.5
PROMPT_TOLERANCE = 0.10
# Time to first token: speculation does not change prefill (the first token
# comes from the prompt's forward pass), so a method's TTFT should be
# plain's. Flagged when its first request's or its median TTFT exceeds
# plain's by more than this factor plus TTFT_SLACK_S (a proposer's own work
# at request start, e.g. matching a long prompt, stays below it): start-up
# work inside a request (a JIT compile, a cold cache) that its tokens/s
# include.
TTFT_FACTOR = 1.5
TTFT_SLACK_S = 0.25


@dataclass(frozen=True)
class Flag:
    method: str          # the flagged method ("plain" for the baseline itself)
    message: str


def _tau(generated: int, accepted: int) -> float:
    steps = generated - accepted
    return generated / steps if steps > 0 else float("nan")


def _tps(row: dict) -> float:
    return row["generated"] / row["seconds"] if row["seconds"] > 0 else float("nan")


def speedup_above_tau(tau: float, speedup: float, tolerance: float) -> bool:
    """True when ``speedup`` exceeds ``tau`` by more than ``tolerance`` (a share
    of tau); NaNs (no tokens, no time) are never flagged."""
    return speedup == speedup and tau == tau and speedup > tau * (1.0 + tolerance)


def check(res: dict) -> list[Flag]:
    """Flags for a ``bench.run.analyse`` result: methods whose overall speedup
    exceeds their tau; methods whose speedup exceeds tau on single prompts;
    prompts on which most speculative methods exceed tau (plain decoding
    itself was slowed there)."""
    methods = res["methods"]
    if "plain" not in methods:
        return []
    plain = {(r["id"], r["repeat"]): r for r in methods["plain"]["per_prompt"]}
    flags: list[Flag] = []
    over_by_prompt: dict[tuple, list[str]] = {}
    spec = [m for m in methods if m != "plain"]
    for m in spec:
        o = methods[m]["overall"]
        sp = o.get("speedup", float("nan"))
        if speedup_above_tau(o["tau"], sp, OVERALL_TOLERANCE):
            flags.append(Flag(m, f"{m}: speedup {sp:.2f}x is above its tau {o['tau']:.2f}, "
                                 f"which speculation cannot do; the machine was busy during "
                                 f"this run or plain's: rerun on a quiet machine"))
        over = []
        for r in methods[m]["per_prompt"]:
            base = plain.get((r["id"], r["repeat"]))
            if base is None:
                continue
            tau = _tau(r["generated"], r["accepted"])
            sp = _tps(r) / _tps(base)
            if speedup_above_tau(tau, sp, PROMPT_TOLERANCE):
                over.append(r["id"])
                over_by_prompt.setdefault((r["id"], r["repeat"]), []).append(m)
        if over:
            flags.append(Flag(m, f"{m}: on {len(over)} of {len(methods[m]['per_prompt'])} "
                                 f"prompts its speedup is more than "
                                 f"{PROMPT_TOLERANCE:.0%} above its tau there "
                                 f"(prompt ids {_ids(over)})"))
    flags += ttft_flags(methods)
    cores = (res.get("environment") or {}).get("cores")
    for m in methods:
        loads = [r["load_average"] for r in methods[m]["per_prompt"] if "load_average" in r]
        if cores and loads and sum(loads) / len(loads) > cores + LOAD_SLACK:
            flags.append(Flag(m, f"{m}: the machine was busy during its run (1-minute load "
                                 f"average {sum(loads) / len(loads):.1f} on {cores} cores; this "
                                 f"benchmark's own engine keeps them busy, another adds about "
                                 f"1): its tokens/s and every speedup against it are suspect"))
    if len(spec) >= 2:
        slow = [key for key, ms in over_by_prompt.items() if 2 * len(ms) > len(spec)]
        if slow:
            flags.append(Flag("plain", f"plain: on prompt ids {_ids([k[0] for k in slow])} "
                                       f"most methods beat their tau: plain decoding was "
                                       f"slowed there, so every speedup is inflated"))
    return flags


def ttft_far_above(ttft: float, plain: float) -> bool:
    return ttft > TTFT_FACTOR * plain + TTFT_SLACK_S


def ttft_flags(methods: dict) -> list[Flag]:
    """Methods whose first or median time to first token is far above
    plain's (``TTFT_FACTOR``, ``TTFT_SLACK_S``)."""
    base = methods["plain"].get("ttft")
    if not base:
        return []
    flags = []
    for m, entry in methods.items():
        t = entry.get("ttft")
        if m == "plain" or not t:
            continue
        slow = [f"{what} {t[key]:.2f} s against plain's {base[key]:.2f} s"
                for key, what in (("first", "first request"), ("median", "median"))
                if ttft_far_above(t[key], base[key])]
        if slow:
            flags.append(Flag(m, f"{m}: time to first token {'; '.join(slow)}: speculation "
                                 f"does not change prefill, so this is start-up work inside "
                                 f"requests (a compile, a cold cache), and its tokens/s and "
                                 f"speedup include it"))
    return flags


def _ids(ids: list) -> str:
    shown = ", ".join(str(i) for i in ids[:8])
    return shown + (f" and {len(ids) - 8} more" if len(ids) > 8 else "")
