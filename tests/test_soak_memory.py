"""`specplug bench soak`'s memory breakdown (no engine): where a process's
resident memory is, read from /proc/PID/smaps."""
from __future__ import annotations

import os

import numpy as np

from vllm_specplug.bench.soak import memory_kinds


def test_a_touched_large_mapping_is_counted_as_large_and_untouched_is_not():
    before = memory_kinds(os.getpid(), large=48 << 20)
    a = np.empty(64 << 20, dtype=np.uint8)          # mmapped, not yet resident
    untouched = memory_kinds(os.getpid(), large=48 << 20)
    a[::4096] = 1                                   # touch every page
    touched = memory_kinds(os.getpid(), large=48 << 20)
    assert untouched["large"] - before["large"] < 8
    assert 60 <= touched["large"] - before["large"] <= 72, (before, touched)
    assert touched["file"] > 0 and touched["heap"] > 0
    del a


def test_an_unreadable_process_gives_none():
    assert memory_kinds(2 ** 22 + 12345) is None


def test_malloc_trim_gives_back_what_glibc_held_free():
    """A process that freed 400 MB below a live block keeps it resident
    until malloc_trim; the soak's --trim measures exactly that."""
    import shutil
    import subprocess
    import sys
    import time

    import psutil
    import pytest

    from vllm_specplug.bench.soak import malloc_trim

    if shutil.which("gdb") is None:
        pytest.skip("gdb is not installed")
    code = ("import sys, time\n"
            "x = [bytearray(4000) for _ in range(100_000)]\n"
            "keep = bytearray(4000)\n"       # above them on the heap: no automatic trim
            "del x\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        before = psutil.Process(p.pid).memory_info().rss
        assert before > 300 << 20, before
        assert malloc_trim(p.pid).startswith("$1 = 1")
        after = psutil.Process(p.pid).memory_info().rss
        assert after < before - (300 << 20), (before, after)
    finally:
        p.kill()


def test_trim_modes():
    from vllm_specplug.bench.soak import build_parser

    p = build_parser()
    assert p.parse_args([]).trim is None
    assert p.parse_args(["--trim"]).trim == "end"
    assert p.parse_args(["--trim", "each"]).trim == "each"
