"""VLLM_SPECPLUG_STATS_FILE: the drafter's stats written as JSON (no vLLM)."""
from __future__ import annotations

import json
import os

import pytest

from helpers import make_vllm_config, step
from vllm_specplug.vllm_adapter.v1 import stats_export
from vllm_specplug.vllm_adapter.v1.drafter import SpecPlugDrafter

HIST_A = [5, 6, 7, 8, 5, 6, 7]
HIST_B = [1, 2, 3, 1, 2]


def make(monkeypatch, path, interval="1"):
    if path is None:
        monkeypatch.delenv(stats_export.ENV_FILE, raising=False)
    else:
        monkeypatch.setenv(stats_export.ENV_FILE, str(path))
    monkeypatch.setenv(stats_export.ENV_INTERVAL, interval)
    monkeypatch.setenv("VLLM_SPECPLUG_STEP_COST_CACHE", "0")
    return SpecPlugDrafter(make_vllm_config())


def test_off_by_default(monkeypatch, patch_calls, tmp_path):  # noqa: F811
    """Unset: no exporter, and no write anywhere (a spy on every write, not a
    look at one folder: a default path elsewhere would not show there)."""
    writes = []
    monkeypatch.setattr(stats_export._Exporter, "write",
                        lambda self, drafter: writes.append(self.path))
    monkeypatch.chdir(tmp_path)
    d = make(monkeypatch, None)
    step(d, ["a"], [HIST_A], [[7]])
    step(d, [], [], [])
    d.finish_request("a")
    assert writes == [] and stats_export._exporter(d) is None
    assert list(tmp_path.iterdir()) == []


def test_written_after_a_step_and_when_the_last_request_is_freed(
        monkeypatch, patch_calls, tmp_path):  # noqa: F811
    path = tmp_path / "stats.json"
    d = make(monkeypatch, path, interval="3600")
    step(d, ["a", "b"], [HIST_A, HIST_B], [[7], [2]])
    first = stats_export.read(path)  # the first step always writes
    assert first["active_requests"] == 2 and first["state_bytes"] > 0
    assert first["pid"] == os.getpid() and first["rank"] == 0 and first["method"] == "sam"
    assert first["writes"] == 1
    # within the interval: no write, even when one of two requests is freed
    step(d, ["a", "b"], [HIST_A + [9], HIST_B + [3]], [[9], [3]])
    d.finish_request("b")
    assert stats_export.read(path)["writes"] == 1
    # the last request freed: written at once
    d.finish_request("a")
    last = stats_export.read(path)
    assert last["writes"] == 2
    assert (last["active_requests"], last["state_bytes"], last["trees_held"]) == (0, 0, 0)
    assert last["errors"] == 0
    assert not list(tmp_path.glob("*.tmp*"))


def test_interval_zero_writes_every_step(monkeypatch, patch_calls, tmp_path):  # noqa: F811
    path = tmp_path / "s-{pid}.json"
    d = make(monkeypatch, path, interval="0")
    for i in range(3):
        step(d, ["a"], [HIST_A + [1] * i], [[1]])
    real = tmp_path / f"s-{os.getpid()}.json"
    assert json.loads(real.read_text())["writes"] == 3


def test_unwritable_path_is_logged_and_serving_goes_on(
        monkeypatch, patch_calls, tmp_path, caplog):  # noqa: F811
    d = make(monkeypatch, tmp_path / "no" / "such" / "dir" / "stats.json")
    with caplog.at_level("WARNING", logger="vllm_specplug"):
        step(d, ["a"], [HIST_A], [[7]])
        step(d, ["a"], [HIST_A + [8]], [[8]])
    assert sum("cannot write the drafter stats" in r.message for r in caplog.records) == 1
    d.finish_request("a")
    assert d.stats()["active_requests"] == 0


@pytest.mark.parametrize("bad", ["x", ""])
def test_bad_interval_falls_back(monkeypatch, patch_calls, tmp_path, bad):  # noqa: F811
    path = tmp_path / "stats.json"
    d = make(monkeypatch, path, interval=bad)
    step(d, ["a"], [HIST_A], [[7]])
    assert stats_export.read(path)["active_requests"] == 1
