"""``specplug bench matrix`` (vllm_specplug/bench/matrix.py) without engines:
the worker and the served run are stand-ins returning synthetic outputs
(token ids, seconds, accepted drafts), so the table's ratios, the identity
check, reuse of raw cells, option checks and the plot are tested in a
second or two. The served client (bench/served.py) runs against a fake
``post``."""
from __future__ import annotations

import json
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest

from vllm_specplug.bench import matrix, served
from vllm_specplug.bench.server import serve_args

# tokens/s of plain decoding per cell, and each method's speedup over it
PLAIN_RATE = {"bs1": 10.0, "bs4": 30.0, "c1": 9.0, "c8": 50.0, "c4": 25.0}
CELL_INDEX = {c: i for i, c in enumerate(PLAIN_RATE)}
MULT = {"plain": 1.0, "ngram": 1.2, "suffix": 1.5, "sam": 1.8, "sam_tr": 1.6,
        "token_recycling": 1.1}
TAU = {"plain": 1.0, "ngram": 1.5, "suffix": 2.0, "sam": 2.5, "sam_tr": 2.2,
       "token_recycling": 1.25}
GENERATED = 8


def mult(method: str, cell: str) -> float:
    """Speedup over plain, different in every cell: an entry computed
    against another cell's plain (or suffix) would come out wrong."""
    return 1.0 if method == "plain" else MULT[method] * (1 + 0.1 * CELL_INDEX[cell])


def ids_of(row_id: str, cell: str) -> list[int]:
    """Plain decoding's output of a row in a cell; every cell's differ (as
    batched kernels may), so a check against another cell's plain fails."""
    seed = zlib.crc32(f"{row_id}|{cell}".encode())
    return [(seed >> k) % 1000 for k in range(GENERATED)]


class Engines:
    """Stand-ins for the worker and the served run: which cells ran, and
    outputs to plant that differ from plain's ({(method, cell): row index})."""

    def __init__(self, differ: dict | None = None):
        self.calls: list[tuple[str, str]] = []
        self.differ = differ or {}
        self.lock = threading.Lock()

    def outputs(self, method: str, cell: str, rows: list[dict]) -> dict:
        with self.lock:
            self.calls.append((method, cell))
        token_ids = [ids_of(r["id"], cell) for r in rows]
        if (method, cell) in self.differ:
            i = self.differ[method, cell]
            token_ids[i] = token_ids[i][:-1] + [token_ids[i][-1] + 1]
        generated = GENERATED * len(rows)
        accepted = round(generated - generated / TAU[method])
        drafts = 0 if method == "plain" else generated - accepted
        return {"ids": [r["id"] for r in rows], "token_ids": token_ids,
                "generated": generated,
                "seconds": generated / (PLAIN_RATE[cell] * mult(method, cell)),
                "accepted": accepted, "drafts": drafts, "draft_tokens": 2 * drafts,
                "accepted_per_pos": [accepted] if accepted else []}

    @staticmethod
    def method_of(spec: dict | None, name: str | None = None) -> str:
        return name or ("plain" if spec is None else spec["method"])

    def run_worker(self, cfg: dict, log_path: Path, raw_path: Path, on_progress=None) -> dict:
        assert cfg["repeat"] == 0 and cfg["temperature"] == 0.0
        batch = self.outputs(cfg["method_name"], f"bs{cfg['batch_size']}", cfg["prompts"])
        batch.update(batch_size=cfg["batch_size"],
                     batches=[{k: batch[k] for k in ("ids", "seconds", "generated", "accepted",
                                                     "drafts", "draft_tokens",
                                                     "accepted_per_pos")}])
        out = {"engine_start_seconds": 1.0, "results": [], "batch": batch,
               "drafter_stats": None}
        raw_path.write_text(json.dumps(out))
        return out

    def serve_run(self, model, spec, rows, concurrency, max_tokens, log, stats_file,
                  max_model_len=4096) -> dict:
        out = self.outputs(self.method_of(spec), f"c{concurrency}", rows)
        return {**out, "latency_seconds": [0.1] * len(rows), "engine_start_seconds": 2.0,
                "in_flight": min(concurrency, len(rows))}


@pytest.fixture
def engines(monkeypatch):
    e = Engines()
    monkeypatch.setattr(matrix, "run_worker", e.run_worker)
    monkeypatch.setattr(served, "serve_run", e.serve_run)
    monkeypatch.setattr(matrix, "suffix_available", lambda: True)
    return e


def run(tmp_path, **kw):
    opts = dict(workloads=["spec_bench", "agentic"], limit=3, max_tokens=GENERATED,
                batch_sizes=[1, 4], concurrency=[1, 8], log=lambda line: None)
    opts.update(kw)
    return matrix.run_matrix("model-dir", tmp_path, **opts)


def test_entries_are_tokens_per_second_against_plain_and_suffix_of_the_same_cell(
        engines, tmp_path):
    res = run(tmp_path)
    assert list(res["workloads"]) == ["spec_bench", "agentic"]
    md = (tmp_path / "matrix.md").read_text()
    assert json.loads((tmp_path / "results.json").read_text()) == json.loads(json.dumps(res))
    for w, entry in res["workloads"].items():
        assert entry["cells"] == ["bs1", "bs4", "c1", "c8"]
        assert list(entry["methods"]) == list(matrix.DEFAULT_METHODS)   # plain first
        section = md.split(f"## {w} ")[1].split("\n## ")[0]
        assert "| method | bs1 | bs4 | c1 | c8 |" in section
        for m, by_cell in entry["methods"].items():
            for cell, e in by_cell.items():
                tps = PLAIN_RATE[cell] * mult(m, cell)
                assert e["tokens_per_second"] == pytest.approx(tps)
                assert e["speedup"] == pytest.approx(mult(m, cell))
                assert e["vs_suffix"] == pytest.approx(mult(m, cell) / mult("suffix", cell))
                assert e["tau"] == pytest.approx(TAU[m], rel=0.05)
                assert e["identical"] == e["requests"] == entry["requests"]
                assert e["kind"] == ("batch" if cell.startswith("bs") else "serve")
            row = next(x for x in section.splitlines() if x.startswith(f"| {m} |"))
            texts = [x.strip() for x in row.strip("|").split("|")][1:]
            for cell, text in zip(entry["cells"], texts):
                tps = f"{PLAIN_RATE[cell] * mult(m, cell):.1f}"
                want = {"plain": tps,
                        "suffix": f"{tps} / {mult(m, cell):.2f}x"}.get(
                    m, f"{tps} / {mult(m, cell):.2f}x / "
                       f"{mult(m, cell) / mult('suffix', cell):.2f}x")
                assert text == want, (w, m, cell)
    # every method x cell ran once, each cell's plain first
    cells = [(m, c) for w in res["workloads"] for c in ["bs1", "bs4", "c1", "c8"]
             for m in matrix.DEFAULT_METHODS]
    assert engines.calls == cells


def test_an_output_differing_from_plain_is_flagged(engines, tmp_path):
    engines.differ = {("token_recycling", "bs4"): 1, ("sam", "c8"): 0}
    res = run(tmp_path, workloads=["spec_bench"])
    entry = res["workloads"]["spec_bench"]
    ids = [r["id"] for r in matrix.make_plan(["spec_bench"], ["plain"], [1], [], limit=3,
                                             max_tokens=8).rows["spec_bench"]]
    flagged = {(m, c): (e["identical"], e["differing_ids"])
               for m, by_cell in entry["methods"].items() for c, e in by_cell.items()
               if e["identical"] != e["requests"]}
    assert flagged == {("token_recycling", "bs4"): (2, [ids[1]]), ("sam", "c8"): (2, [ids[0]])}
    md = (tmp_path / "matrix.md").read_text()
    assert md.count("≠") - md.count("**≠k/n**") == 2
    tr_row = next(x for x in md.splitlines() if x.startswith("| token_recycling |"))
    sam_row = next(x for x in md.splitlines() if x.startswith("| sam |"))
    assert tr_row.split("|")[3].strip().endswith("≠1/3")    # column bs4
    assert sam_row.split("|")[5].strip().endswith("≠1/3")   # column c8


def test_the_command_warns_about_differing_outputs(engines, tmp_path, monkeypatch, capsys):
    engines.differ = {("sam", "bs1"): 2}
    monkeypatch.setattr("vllm_specplug.models.default_model_path", lambda: "model-dir")
    assert matrix.main(["--workloads", "pipeline", "--limit", "3", "--batch-sizes", "1",
                        "--no-serve", "--methods", "plain,suffix,sam",
                        "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "WARNING" in err and "pipeline sam bs1" in err


def test_reuse_raw_reads_cells_back_and_refuses_other_settings(engines, tmp_path):
    first = run(tmp_path, workloads=["spec_bench"])
    n = len(engines.calls)
    raw = tmp_path / "raw" / "spec_bench.sam.bs4.json"
    assert raw.exists() and not list((tmp_path / "raw").glob("*.worker.json"))
    cell = json.loads(raw.read_text())
    cell["seconds"] /= 2                       # read back, not run again: twice as fast
    raw.write_text(json.dumps(cell))
    (tmp_path / "raw" / "spec_bench.ngram.c8.json").unlink()
    again = run(tmp_path, workloads=["spec_bench"], reuse_raw=True)
    assert engines.calls[n:] == [("ngram", "c8")]
    sam = again["workloads"]["spec_bench"]["methods"]["sam"]["bs4"]
    assert sam["speedup"] == pytest.approx(
        2 * first["workloads"]["spec_bench"]["methods"]["sam"]["bs4"]["speedup"])
    # without --reuse-raw every cell runs again
    run(tmp_path, workloads=["spec_bench"])
    assert len(engines.calls) == 2 * n + 1
    # a cell run with other settings is not mixed in
    with pytest.raises(matrix.MatrixError, match="--reuse-raw.*max_tokens"):
        run(tmp_path, workloads=["spec_bench"], reuse_raw=True, max_tokens=GENERATED + 1)
    with pytest.raises(matrix.MatrixError, match="--reuse-raw.*speculative_config"):
        run(tmp_path, workloads=["spec_bench"], reuse_raw=True,
            overrides={"sam": {"num_speculative_tokens": 8}})


@pytest.mark.parametrize("kw, message", [
    ({"methods": "plain,sma"}, r"--methods: unknown method 'sma'.*'sam'"),
    ({"workloads": "spec-bench"}, r"--workloads: unknown \['spec-bench'\].*'spec_bench'"),
    ({"batch_sizes": "1,x"}, r"--batch-sizes '1,x': give integers"),
    ({"concurrency": "0,8"}, r"--concurrency '0,8': every size must be at least 1"),
    ({"batch_sizes": [], "concurrency": []}, r"no cells"),
    ({"overrides": {"sam@8": {"num_speculative_tokens": 8}}},
     r"--speculative-config: \['sam@8'\] not in --methods"),
    ({"limit": 0}, r"--limit 0"),
    ({"max_tokens": 0}, r"--max-tokens 0"),
    ({"methods": "plain,eagle2"}, r"--methods: .*--eagle-head"),
])
def test_bad_options_fail_before_any_engine_starts(engines, tmp_path, monkeypatch, kw,
                                                   message):
    def no_model():
        raise AssertionError("the model was prepared before the options were checked")

    monkeypatch.setattr("vllm_specplug.models.default_model_path", no_model)
    opts = dict(workloads="spec_bench", limit=2, log=lambda line: None)
    opts.update(kw)
    with pytest.raises(matrix.MatrixError, match=message):
        matrix.run_matrix(None, tmp_path / "out", **opts)
    assert engines.calls == [] and not (tmp_path / "out").exists()


def test_missing_suffix_fails_naming_the_fix(engines, monkeypatch, tmp_path):
    monkeypatch.setattr(matrix, "suffix_available", lambda: False)
    with pytest.raises(matrix.MatrixError, match="arctic-inference.*drop suffix"):
        run(tmp_path)
    run(tmp_path, methods="plain,sam", workloads=["spec_bench"])   # without suffix it runs
    md = (tmp_path / "matrix.md").read_text()
    sam_row = next(x for x in md.splitlines() if x.startswith("| sam |"))
    assert sam_row.split("|")[2].strip().endswith("x / -")     # no suffix to compare with


def test_the_command_line_checks_options_and_applies_quick(engines, tmp_path, monkeypatch):
    monkeypatch.setattr("vllm_specplug.models.default_model_path", lambda: "model-dir")
    with pytest.raises(SystemExit, match="bench matrix: --methods: unknown method 'bogus'"):
        matrix.main(["--methods", "plain,bogus", "--out", str(tmp_path / "bad")])
    assert engines.calls == []
    assert matrix.main(["--quick", "--methods", "plain,suffix,sam",
                        "--out", str(tmp_path / "q")]) == 0
    res = json.loads((tmp_path / "q" / "results.json").read_text())
    s = res["settings"]
    assert list(res["workloads"]) == ["spec_bench"]
    assert (s["limit"], s["max_tokens"], s["batch_sizes"], s["concurrency"], s["half"]) == (
        4, 32, [1, 4], [1, 4], "odd")
    assert res["workloads"]["spec_bench"]["cells"] == ["bs1", "bs4", "c1", "c4"]
    # options given beside --quick win; --no-serve drops the served cells
    assert matrix.main(["--quick", "--methods", "plain,sam", "--no-serve", "--max-tokens", "16",
                        "--workloads", "pipeline", "--out", str(tmp_path / "q2")]) == 0
    res = json.loads((tmp_path / "q2" / "results.json").read_text())
    assert list(res["workloads"]) == ["pipeline"]
    assert res["workloads"]["pipeline"]["cells"] == ["bs1", "bs4"]
    assert res["settings"]["max_tokens"] == 16


def test_the_plot_is_written(engines, tmp_path):
    run(tmp_path)
    png = (tmp_path / "matrix.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width > 2 * height    # a panel per workload, side by side


def test_the_cli_routes_bench_matrix(engines, monkeypatch):
    from vllm_specplug import cli

    seen = []
    monkeypatch.setattr(matrix, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["bench", "matrix", "--quick"]) == 0
    assert seen == [["--quick"]]
    bench = cli.build_parser()._subparsers._group_actions[0].choices["bench"]
    assert "specplug bench matrix --help" in bench.format_help().replace("\n", " ")


# ------------------------------------------------------------------ served client
def test_drive_sends_sessions_turn_by_turn_with_their_history_at_most_c_at_once():
    from vllm_specplug.bench.workloads import load_workload

    rows = load_workload("agentic", half="odd", limit=5)
    assert len(rows) > 5 and len({r["session"] for r in rows}) == 5
    active, most, lock, sent = [0], [0], threading.Lock(), []

    def answer(users: list[str]) -> str:
        return f"A{zlib.crc32(json.dumps(users).encode())}"

    def post(messages):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
            sent.append(messages)
        time.sleep(0.02)
        with lock:
            active[0] -= 1
        users = [m["content"] for m in messages if m["role"] == "user"]
        return [len(messages), zlib.crc32(messages[-1]["content"].encode())], answer(users)

    out = served.drive(post, rows, concurrency=3)
    assert most[0] == 3 and out["in_flight"] == 3
    assert len(sent) == len(rows)
    assert out["ids"] == [r["id"] for r in rows]
    assert out["generated"] == 2 * len(rows) and out["seconds"] > 0
    for i, r in enumerate(rows):
        earlier = [x for x in rows if x["session"] == r["session"] and x["turn"] < r["turn"]]
        users = [x["prompt"] for x in earlier] + [r["prompt"]]
        msgs = next(m for m in sent if [x["content"] for x in m if x["role"] == "user"] == users)
        # the session's earlier answers, in order, between its prompts
        assert [m["content"] for m in msgs if m["role"] == "assistant"] == [
            answer(users[:k + 1]) for k in range(len(earlier))]
        assert [m["role"] for m in msgs if m["role"] != "system"] == \
            ["user", "assistant"] * len(earlier) + ["user"]
        # each output back in its row's place
        assert out["token_ids"][i] == [len(msgs), zlib.crc32(r["prompt"].encode())]


def test_spec_metrics_are_read_from_prometheus_text():
    text = "\n".join([
        "# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.",
        "# TYPE vllm:spec_decode_num_drafts counter",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="specplug"} 12.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="specplug"} 1.7e+09',
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="specplug"} 3.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="specplug"} 40.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="specplug"} 21.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="s",'
        'position="1"} 5.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="s",'
        'position="0"} 9.0',
        'vllm:generation_tokens_total{engine="0",model_name="specplug"} 99.0'])
    assert served.parse_spec_metrics(text) == {"drafts": 15, "draft_tokens": 40,
                                               "accepted": 21, "accepted_per_pos": [9, 5]}
    assert served.parse_spec_metrics("vllm:generation_tokens_total 3.0") == {
        "drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}


def test_served_runs_use_the_offline_engine_settings():
    from vllm_specplug.offline_engine import engine_kwargs

    kw = engine_kwargs("m", None)
    args = serve_args(None, "specplug")
    assert "--speculative-config" not in args
    assert args[args.index("--max-model-len") + 1] == str(kw["max_model_len"])
    assert args[args.index("--dtype") + 1] == kw["dtype"]
    assert args[args.index("--seed") + 1] == str(kw["seed"])
    args = serve_args({"method": "sam", "num_speculative_tokens": 32}, "x")
    assert json.loads(args[args.index("--speculative-config") + 1])["method"] == "sam"


# ------------------------------------------------------------------ scripts/bench_batches.py
def test_bench_batches_script_runs_on_the_shared_batch_pass(engines, tmp_path, monkeypatch,
                                                            capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        import bench_batches
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(bench_batches, "default_model_path", lambda: "model-dir")
    monkeypatch.setattr(sys, "argv", ["bench_batches.py", "--workload", "pipeline", "--limit",
                                      "3", "--batch-size", "4", "--methods", "plain,sam",
                                      "--out", str(tmp_path)])
    bench_batches.main()
    res = json.loads((tmp_path / "results.json").read_text())
    assert engines.calls == [("plain", "bs4"), ("sam", "bs4")]
    assert res["methods"]["sam"]["speedup"] == pytest.approx(mult("sam", "bs4"))
    assert res["methods"]["sam"]["outputs_differing_from_plain"] == 0
    assert (tmp_path / "raw" / "sam.batch.json").exists()
    assert "| sam |" in capsys.readouterr().out
