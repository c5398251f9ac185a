"""Give the memory glibc holds free back to the system while serving.

A server that runs for weeks grows in resident memory (RSS) even when no
object leaks: glibc's allocator keeps freed chunks in its heap and returns
memory to the system only from the top of the heap. Tree verification runs
more distinct batch shapes than chains, so torch's CPU tensors come in more
sizes and the worker's heap holds more free memory (docs/soak.md: 2,000
requests of mixed traffic, `token_recycling`'s server tree grew 296 MB
where plain decoding grew 186 MB; after ``malloc_trim(0)`` it was smaller
than at request 100).

The drafter calls ``Trimmer.maybe`` only in a step that schedules nothing
(vLLM runs one after the last running requests finish, to free them), after
their state is freed, in its own process (the one that runs the model:
vLLM's worker, or the engine core without multiprocessing). It calls glibc's
``malloc_trim(0)`` there at most once per interval (default 60 s). A trim
blocks its thread (13 ms at 256 MB of free heap, 59 ms at 1 GB, measured on
this project's 2-core CPU), so it never runs inside a step that runs the
model: under load without a pause it does not run at all, and glibc keeps
what it holds (its high-water mark, docs/soak.md). Under tensor
parallelism every rank sees the same scheduler output, so the ranks trim in
the same idle steps; the interval is counted in wall-clock buckets
(``floor(time / interval)``), which every rank of synchronised clocks
computes alike (issue 45 item 4).

``VLLM_SPECPLUG_MALLOC_TRIM_S``: the interval in seconds (default 60); 0
turns it off. It does nothing when the C library is not glibc or when
``LD_PRELOAD`` names another allocator (tcmalloc, jemalloc, mimalloc: they
return memory by their own rules). Counts, time spent and memory given back
are in the drafter's stats (``malloc_trim``). No vLLM, no torch.
"""
from __future__ import annotations

import ctypes
import logging
import math
import os
import time
from typing import Callable

from .options import SpecPlugConfigError

logger = logging.getLogger("vllm_specplug")

ENV = "VLLM_SPECPLUG_MALLOC_TRIM_S"
DEFAULT_INTERVAL_S = 60.0
#: allocators that replace glibc's malloc when preloaded
OTHER_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


class MallocTrimConfigError(SpecPlugConfigError):
    """``VLLM_SPECPLUG_MALLOC_TRIM_S`` is not a number of seconds >= 0."""


def interval_from_env(environ=os.environ) -> float:
    """The interval in seconds (0: off). Raises ``MallocTrimConfigError``
    naming the variable when its value is not a number >= 0."""
    raw = environ.get(ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise MallocTrimConfigError(
            f"{ENV}={raw!r}: give the seconds between trims of glibc's free memory "
            f"(a number >= 0; 0 turns it off; default {DEFAULT_INTERVAL_S:g})")
    return value


def glibc_trim() -> tuple[Callable[[int], int] | None, str]:
    """(glibc's ``malloc_trim``, "") or (None, why not)."""
    preload = os.environ.get("LD_PRELOAD", "")
    other = next((a for a in OTHER_ALLOCATORS if a in preload), None)
    if other is not None:
        return None, f"LD_PRELOAD names {other}"
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version          # glibc only
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None, "the C library is not glibc"
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn, ""


def resident_bytes() -> int:
    """This process's RSS (0 when /proc cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Trimmer:
    """When to call ``trim`` (glibc's ``malloc_trim``), and what it did."""

    def __init__(self, interval_s: float, trim: Callable[[int], int] | None,
                 clock: Callable[[], float] = time.time,
                 rss: Callable[[], int] = resident_bytes, why_off: str = "") -> None:
        self.interval_s = float(interval_s)
        self.trim = trim if self.interval_s > 0 else None
        self.why_off = why_off or ("" if self.trim is not None else f"{ENV}=0")
        self.clock = clock
        self.rss = rss
        # the first trim comes in the interval after the one of the start
        self.last_bucket = self._bucket() if self.trim is not None else 0
        self.calls = 0
        self.seconds = 0.0
        self.freed_bytes = 0

    def _bucket(self) -> int:
        return math.floor(self.clock() / self.interval_s)

    def maybe(self) -> bool:
        """Trim unless this interval (a wall-clock bucket) already had one.
        The caller calls it only in steps that schedule nothing. Never raises."""
        if self.trim is None:
            return False
        bucket = self._bucket()
        if bucket <= self.last_bucket:
            return False
        self.last_bucket = bucket
        try:
            before = self.rss()
            started = time.perf_counter()
            self.trim(0)
            self.seconds += time.perf_counter() - started
            self.freed_bytes += max(before - self.rss(), 0)
            self.calls += 1
        except Exception as e:  # noqa: BLE001 - memory hygiene must never break serving
            logger.warning("vllm_specplug: malloc_trim failed (%s); it stays off in this "
                           "process", e)
            self.trim, self.why_off = None, f"failed: {e}"
            return False
        return True

    def stats(self) -> dict:
        return {"interval_s": self.interval_s, "on": self.trim is not None,
                "why_off": self.why_off, "calls": self.calls,
                "seconds": round(self.seconds, 4),
                "freed_mb": round(self.freed_bytes / (1 << 20), 1)}


def from_env() -> Trimmer:
    """The process's trimmer as ``VLLM_SPECPLUG_MALLOC_TRIM_S`` and the C
    library allow (off, with the reason in its stats, when they do not)."""
    interval = interval_from_env()
    if interval <= 0:
        return Trimmer(0.0, None)
    fn, why = glibc_trim()
    return Trimmer(interval, fn, why_off=why)
