"""scripts/bench_serve.py's helpers that need no server: per-round prompt
files and named configs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_serve  # noqa: E402


def test_round_datasets_differ_by_round_and_level_and_repeat(tmp_path):
    a = bench_serve.round_dataset(tmp_path, 32, 0, 64).read_text()
    (tmp_path / "again").mkdir()
    again = bench_serve.round_dataset(tmp_path / "again", 32, 0, 64).read_text()
    b = bench_serve.round_dataset(tmp_path, 32, 1, 64).read_text()
    c16 = bench_serve.round_dataset(tmp_path, 16, 0, 32).read_text()
    assert a == again  # every method of a round gets the same prompts
    rows = [json.loads(x) for x in a.splitlines()]
    assert len(rows) == 64 and all(r["turns"][0] for r in rows)
    assert len({r["question_id"] for r in rows}) == 64
    ids = [{json.loads(x)["question_id"] for x in t.splitlines()} for t in (a, b, c16)]
    # Different rounds and levels draw mostly different prompts (random
    # overlap of two 64-of-480 draws is about 8.5 prompts).
    assert len(ids[0] & ids[1]) < 24 and len(ids[0] & ids[2]) < 16


def test_named_configs_join_the_methods():
    from vllm_specplug.bench.engine import METHOD_CONFIGS

    names = bench_serve.add_method_configs(
        ['sam_nodraft={"method": "sam", "disable_by_batch_size": 1}'])
    try:
        assert names == ["sam_nodraft"]
        args = bench_serve.serve_args_for("sam_nodraft")
        assert json.loads(args[args.index("--speculative-config") + 1]) == {
            "method": "sam", "disable_by_batch_size": 1}
    finally:
        METHOD_CONFIGS.pop("sam_nodraft", None)


@pytest.mark.parametrize("bad", ["noequals", '={"method": "sam"}', "x={not json",
                                 'x=["sam"]', 'x={"num_speculative_tokens": 3}'])
def test_bad_named_configs_exit_with_a_message(bad):
    with pytest.raises(SystemExit) as e:
        bench_serve.add_method_configs([bad])
    assert "--config" in str(e.value)
