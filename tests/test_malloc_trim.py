"""Giving glibc's free memory back while serving (``vllm_specplug.malloc_trim``):
the interval's validation, when a trim happens, that a failing trim never
breaks serving, and the effect on a real process. No engine."""
from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_specplug import malloc_trim as M
from vllm_specplug.options import SpecPlugConfigError


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _trimmer(interval=60.0, fail=False):
    calls = []

    def trim(pad):
        calls.append(pad)
        if fail:
            raise OSError("no")
        return 1

    clock = Clock()
    return M.Trimmer(interval, trim, clock=clock, rss=lambda: 0), clock, calls


@pytest.mark.parametrize("raw, want", [(None, 60.0), ("", 60.0), ("0", 0.0), ("2.5", 2.5),
                                       ("600", 600.0)])
def test_the_interval_from_the_environment(raw, want):
    env = {} if raw is None else {M.ENV: raw}
    assert M.interval_from_env(env) == want


@pytest.mark.parametrize("raw", ["abc", "-1", "inf", "nan", "1e400"])
def test_a_bad_interval_fails_before_the_engine_naming_the_variable(raw, monkeypatch):
    with pytest.raises(M.MallocTrimConfigError, match=M.ENV):
        M.interval_from_env({M.ENV: raw})
    # the speculative config's check (engine args, before the engine starts)
    from vllm_specplug.config import translate

    monkeypatch.setenv(M.ENV, raw)
    with pytest.raises(SpecPlugConfigError, match="number >= 0"):
        translate({"method": "sam"})


def test_trims_at_most_once_per_wall_clock_interval():
    t, clock, calls = _trimmer(60.0)
    clock.t = 1000 * 60 + 30.0          # half-way through an interval
    t.last_bucket = t._bucket()         # as if started now
    assert not t.maybe()                # the start's interval
    clock.t += 29.9
    assert not t.maybe()
    clock.t += 0.2                      # the next interval: one trim
    assert t.maybe() and calls == [0]
    clock.t += 59
    assert not t.maybe() and len(calls) == 1
    clock.t += 1.0
    assert t.maybe() and len(calls) == 2
    assert t.stats()["calls"] == 2 and t.stats()["on"]


def test_ranks_started_apart_trim_in_the_same_intervals():
    """Under tensor parallelism each rank has its own trimmer, started at
    slightly different times; called in the same idle steps, they trim in
    the same ones (wall-clock buckets, not each rank's own last trim)."""
    (a, ca, ta), (b, cb, tb) = _trimmer(10.0), _trimmer(10.0)
    ca.t, cb.t = 1003.0, 1009.9
    a.last_bucket, b.last_bucket = a._bucket(), b._bucket()
    trims = []
    for now in (1010.5, 1013.0, 1019.95, 1021.0, 1055.0, 1056.0):
        ca.t = cb.t = now
        trims.append((a.maybe(), b.maybe()))
    assert all(x == y for x, y in trims) and sum(x for x, _ in trims) == 3, trims


def test_off_never_trims():
    t = M.Trimmer(0.0, lambda pad: 1, clock=Clock())
    t.clock.t += 1e9
    assert not t.maybe()
    assert t.stats()["on"] is False and t.stats()["why_off"] == f"{M.ENV}=0"


def test_a_failing_trim_turns_itself_off_and_never_raises(caplog):
    t, clock, calls = _trimmer(1.0, fail=True)
    clock.t += 2
    assert not t.maybe()
    clock.t += 100
    assert not t.maybe() and len(calls) == 1   # not tried again
    assert t.stats()["on"] is False and "failed" in t.stats()["why_off"]
    assert "malloc_trim failed" in caplog.text


def test_another_preloaded_allocator_turns_it_off(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    fn, why = M.glibc_trim()
    assert fn is None and "tcmalloc" in why
    t = M.from_env()
    assert t.stats()["on"] is False and "tcmalloc" in t.stats()["why_off"]


def test_a_trim_gives_back_what_glibc_held_free():
    """A process that freed 400 MB below a live block keeps it resident;
    the trimmer's call (glibc's malloc_trim, in the process) gives it back,
    and its stats count it."""
    code = (
        "from vllm_specplug import malloc_trim as M\n"
        "t = M.from_env()\n"
        "assert t.stats()['on'], t.stats()\n"
        "x = [bytearray(4000) for _ in range(100_000)]\n"
        "keep = bytearray(4000)\n"     # above them on the heap: glibc keeps the freed pages
        "del x\n"
        "before = M.resident_bytes()\n"
        "t.last_bucket -= 1\n"
        "assert t.maybe()\n"
        "after = M.resident_bytes()\n"
        "print(before >> 20, after >> 20, t.stats()['freed_mb'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after, freed = (float(v) for v in out.stdout.split())
    assert before - after > 300, out.stdout
    assert freed > 300, out.stdout
