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
