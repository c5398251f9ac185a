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


def test_idle_trims_once_per_interval_busy_once_per_busy_factor():
    t, clock, calls = _trimmer(60.0)
    assert not t.maybe(idle=True)                 # not one interval since start
    clock.t += 59.9
    assert not t.maybe(idle=True)
    clock.t += 0.2
    assert t.maybe(idle=True) and calls == [0]
    clock.t += 30
    assert not t.maybe(idle=True)                 # the interval counts from the last trim
    clock.t += 31
    assert not t.maybe(idle=False)                # busy: BUSY_FACTOR intervals
    clock.t += 60 * (M.BUSY_FACTOR - 1) - 1.1
    assert not t.maybe(idle=False)
    clock.t += 1
    assert t.maybe(idle=False) and len(calls) == 2
    assert t.stats()["calls"] == 2 and t.stats()["on"]


def test_off_never_trims():
    t = M.Trimmer(0.0, lambda pad: 1, clock=Clock())
    t.clock.t += 1e9
    assert not t.maybe(idle=True)
    assert t.stats()["on"] is False and t.stats()["why_off"] == f"{M.ENV}=0"


def test_a_failing_trim_turns_itself_off_and_never_raises(caplog):
    t, clock, calls = _trimmer(1.0, fail=True)
    clock.t += 2
    assert not t.maybe(idle=True)
    clock.t += 100
    assert not t.maybe(idle=True) and len(calls) == 1   # not tried again
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
        "t.last -= t.interval_s\n"
        "assert t.maybe(idle=True)\n"
        "after = M.resident_bytes()\n"
        "print(before >> 20, after >> 20, t.stats()['freed_mb'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after, freed = (float(v) for v in out.stdout.split())
    assert before - after > 300, out.stdout
    assert freed > 300, out.stdout
