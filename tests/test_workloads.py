"""Benchmark workloads (bench.workloads): sizes, halves, determinism, chat
messages, prompt lengths; one engine check that sessions run through the
bench worker with identical outputs for plain and sam."""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from vllm_specplug.bench.prompts import load_prompts
from vllm_specplug.bench.run import batch_entry
from vllm_specplug.bench.workloads import (WORKLOADS, batch_plan, build_messages,
                                           load_workload, select, workloads_dir)

KEYS = {"id", "category", "prompt", "session", "turn", "system"}
# the bench engine's max_model_len (offline_engine.engine_kwargs)
MAX_MODEL_LEN = 4096
MAX_TOKENS = 256  # the bench's default output length


def _sessions(rows):
    out = defaultdict(list)
    for r in rows:
        out[r["session"] if r["session"] is not None else "\0" + r["id"]].append(r)
    return out


@pytest.fixture(scope="module")
def generate():
    sys.path.insert(0, str(workloads_dir()))
    try:
        import generate as mod
        yield mod
    finally:
        sys.path.remove(str(workloads_dir()))
        sys.modules.pop("generate", None)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_workload_loads_well_formed(name):
    rows = load_workload(name)
    assert rows and all(set(r) == KEYS for r in rows)
    assert all(isinstance(r["id"], str) and r["prompt"].strip() for r in rows)
    assert len({r["id"] for r in rows}) == len(rows)
    seen = []
    for key, sess in _sessions(rows).items():
        # turns 0..n-1, in order, contiguous in the list
        assert [r["turn"] for r in sess] == list(range(len(sess)))
        first = rows.index(sess[0])
        assert rows[first:first + len(sess)] == sess
        seen.append(key)
    assert len(set(seen)) == len(seen)
    for k in ("description", "source", "licence"):
        assert WORKLOADS[name][k]


def test_sizes_as_documented():
    assert len(load_workload("spec_bench")) == 480
    mt = load_workload("multi_turn")
    assert len(mt) == 160 and len(_sessions(mt)) == 80
    assert all(len(s) == 2 for s in _sessions(mt).values())
    pipe = load_workload("pipeline")
    assert len(pipe) == 160 and all(r["session"] is None and r["turn"] == 0 for r in pipe)
    agent = load_workload("agentic")
    sessions = _sessions(agent)
    assert len(sessions) == 32 and all(4 <= len(s) <= 6 for s in sessions.values())
    assert {len(s) for s in sessions.values()} == {4, 5, 6}


def test_spec_bench_is_load_prompts():
    rows = load_workload("spec_bench", half="odd")
    ref = load_prompts(half="odd")
    assert [(r["id"], r["category"], r["prompt"]) for r in rows] == \
        [(str(p["id"]), p["category"], p["prompt"]) for p in ref]
    assert all(r["session"] is None and r["turn"] == 0 and r["system"] is None for r in rows)


def test_a_short_spec_bench_run_covers_every_category():
    """``limit`` takes Spec-Bench a category at a time (its file starts with
    80 writing prompts: the first 16 would all be writing)."""
    full = load_workload("spec_bench", half="odd")
    categories = list(dict.fromkeys(r["category"] for r in full))
    rows = load_workload("spec_bench", half="odd", limit=len(categories) + 3)
    assert [r["category"] for r in rows[:len(categories)]] == categories
    firsts = {c: next(r for r in full if r["category"] == c) for c in categories}
    assert rows[:len(categories)] == [firsts[c] for c in categories]
    assert [r["category"] for r in rows[len(categories):]] == categories[:3]
    everything = load_workload("spec_bench", half="odd", limit=10_000)
    assert sorted(r["id"] for r in everything) == sorted(r["id"] for r in full)


def test_multi_turn_is_spec_bench_two_turn_questions():
    src = [json.loads(x) for x in open(workloads_dir().parent / "spec_bench_question.jsonl")]
    two = [q for q in src if len(q["turns"]) == 2]
    rows = load_workload("multi_turn")
    assert [r["prompt"] for r in rows] == [t for q in two for t in q["turns"]]
    assert [r["category"] for r in rows[::2]] == [q["category"] for q in two]


def test_pipeline_is_one_template(generate):
    rows = load_workload("pipeline")
    head = generate.PIPELINE_TEMPLATE.split("{record}")[0]
    assert all(r["prompt"].startswith(head) for r in rows)
    records = [r["prompt"][len(head):] for r in rows]
    assert len(set(records)) == len(records)  # varied inputs
    assert {r["category"] for r in rows} == {"extract_json"}


def test_agentic_sessions(generate):
    rows = load_workload("agentic")
    assert {r["system"] for r in rows} == {generate.SYSTEM}
    lib = Path(generate.sysconfig.get_paths()["stdlib"])
    for sess in _sessions(rows).values():
        assert [r["category"] for r in sess[:4]] == ["read", "edit", "fix", "diff"]
        # turn 0 quotes a real function of CPython's Lib/
        first = sess[0]["prompt"]
        path = first.split('read_file("', 1)[1].split('"', 1)[0]
        code = first.split("```python\n", 1)[1].split("\n```", 1)[0]
        assert code.startswith("def ")
        if sys.version_info[:3] == (3, 11, 7):
            assert code in (lib / path[len("Lib/"):]).read_text()


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_halves_disjoint_and_covering(name):
    full = load_workload(name)
    even, odd = load_workload(name, half="even"), load_workload(name, half="odd")
    assert even and odd
    ids = lambda rows: [r["id"] for r in rows]  # noqa: E731
    assert set(ids(even)).isdisjoint(ids(odd))
    assert sorted(ids(even) + ids(odd)) == sorted(ids(full))
    # whole sessions on one side; every category on both sides
    assert not {r["session"] for r in even if r["session"]} & \
        {r["session"] for r in odd if r["session"]}
    if name != "agentic":  # agentic's categories are turn kinds
        assert {r["category"] for r in even} == {r["category"] for r in odd}
    # order kept
    pos = {i: k for k, i in enumerate(ids(full))}
    assert ids(even) == sorted(ids(even), key=pos.get)


@pytest.mark.parametrize("name", sorted(set(WORKLOADS) - {"spec_bench"}))
def test_limit_is_first_sessions(name):
    """(Spec-Bench: a category at a time, the test above.)"""
    full = load_workload(name)
    order = list(_sessions(full))
    rows = load_workload(name, limit=3)
    assert list(_sessions(rows)) == order[:3]
    assert sum(len(s) for s in _sessions(rows).values()) == len(rows)
    odd = load_workload(name, half="odd", limit=2)
    assert list(_sessions(odd)) == list(_sessions(load_workload(name, half="odd")))[:2]


def _as_loaded(obj: dict) -> dict:
    """A generator row as the module doc says load_workload returns it: every
    key present, ``session`` None and ``turn`` 0 for a single request, ``id``
    "session:turn" when the row has none, no system message as None."""
    return {"id": obj.get("id", f"{obj.get('session')}:{obj.get('turn', 0)}"),
            "category": obj["category"], "prompt": obj["prompt"],
            "session": obj.get("session"), "turn": obj.get("turn", 0),
            "system": obj.get("system")}


def test_deterministic_and_matches_generator(generate):
    """The vendored files are what the generator script makes, and
    load_workload returns the generator's rows (the expectation comes from the
    script run here, not from the file the loader reads)."""
    assert generate.pipeline_rows() == generate.pipeline_rows()
    vendored = [json.loads(x) for x in open(workloads_dir() / "pipeline.jsonl")]
    assert generate.pipeline_rows() == vendored
    assert load_workload("pipeline") == [_as_loaded(r) for r in generate.pipeline_rows()]
    if sys.version_info[:3] == (3, 11, 7):  # the functions come from this CPython
        vendored = [json.loads(x) for x in open(workloads_dir() / "agentic.jsonl")]
        assert generate.agentic_rows() == vendored
        assert load_workload("agentic") == [_as_loaded(r) for r in generate.agentic_rows()]


def test_licences_vendored():
    d = workloads_dir()
    assert "PYTHON SOFTWARE FOUNDATION LICENSE" in (d / "LICENSE.cpython").read_text()
    assert "Apache License" in (d / "LICENSE.pipeline").read_text()
    assert (d.parent / "LICENSE.spec_bench").exists()


def test_bad_names_and_arguments():
    with pytest.raises(ValueError, match="agentic.*multi_turn.*pipeline.*spec_bench"):
        load_workload("mt_bench")
    with pytest.raises(ValueError, match="half"):
        load_workload("pipeline", half="first")
    with pytest.raises(ValueError, match="limit"):
        load_workload("pipeline", limit=0)


def test_build_messages_order():
    row = {"id": "s:2", "category": "c", "prompt": "third", "session": "s", "turn": 2,
           "system": "SYS"}
    msgs = build_messages(row, [("first", "out1"), ("second", "out2")])
    assert msgs == [{"role": "system", "content": "SYS"},
                    {"role": "user", "content": "first"}, {"role": "assistant", "content": "out1"},
                    {"role": "user", "content": "second"},
                    {"role": "assistant", "content": "out2"},
                    {"role": "user", "content": "third"}]
    single = load_workload("pipeline", limit=1)[0]
    assert build_messages(single, []) == [{"role": "user", "content": single["prompt"]}]


def test_batch_plan_turn_by_turn():
    rows = load_workload("agentic", limit=5)
    plan = batch_plan(rows, 2)
    flat = [i for b in plan for i in b]
    assert sorted(flat) == list(range(len(rows)))
    assert all(1 <= len(b) <= 2 for b in plan)
    turns = [rows[i]["turn"] for i in flat]
    assert turns == sorted(turns)  # every session's turn t before any turn t+1
    assert all(len({rows[i]["turn"] for i in b}) == 1 for b in plan)
    assert [len(b) for b in batch_plan(rows, 0)] == [5, 5, 5, 5] + \
        [n for n in [sum(r["turn"] == t for r in rows) for t in (4, 5)] if n]
    pipe = load_workload("pipeline")
    assert [len(b) for b in batch_plan(pipe, 16)] == [16] * 10


def test_select_on_load_prompts_rows():
    rows = load_prompts(per_category=2)
    assert select(rows, limit=3) == rows[:3]


def test_batch_entry_compares_by_id():
    def b(ids, toks, seconds):
        return {"seconds": seconds, "generated": sum(map(len, toks)), "drafts": 1,
                "draft_tokens": 4, "accepted": 2, "accepted_per_pos": [1, 1], "batch_size": 2,
                "ids": ids, "token_ids": toks,
                "batches": [{"ids": ids, "seconds": seconds, "generated": sum(map(len, toks)),
                             "drafts": 1, "draft_tokens": 4, "accepted": 2,
                             "accepted_per_pos": [1, 1]}]}
    plain = b(["a", "b"], [[1, 2], [3, 4]], 2.0)
    same = batch_entry(b(["b", "a"], [[3, 4], [1, 2]], 1.0), plain)
    assert same["outputs_differing_from_plain"] == 0 and same["speedup"] == pytest.approx(2.0)
    assert same["batch_size"] == 2 and same["batches"][0]["size"] == 2
    assert same["batches"][0]["tau"] == pytest.approx(4 / 2)
    diff = batch_entry(b(["a", "b"], [[1, 2], [3, 5]], 1.0), plain)
    assert diff["outputs_differing_from_plain"] == 1


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from vllm_specplug.models import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.mark.parametrize("name", ["multi_turn", "pipeline", "agentic"])
def test_prompt_lengths(name, tokenizer):
    """The conversation a session's last turn sends, without the model's
    outputs, stays under 1,500 tokens; with every earlier output at the
    bench's 256 tokens, the last request still fits the bench engine."""
    for sess in _sessions(load_workload(name)).values():
        msgs = build_messages(sess[-1], [(r["prompt"], "") for r in sess[:-1]])
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        n = len(tokenizer(text, add_special_tokens=False).input_ids)
        assert n < 1500, (sess[-1]["id"], n)
        assert n + len(sess) * MAX_TOKENS < MAX_MODEL_LEN, (sess[-1]["id"], n)


# ------------------------------------------------------------------ engine
@pytest.mark.engine
@pytest.mark.slow
def test_sessions_run_turn_by_turn_identical_outputs(model_path, tmp_path, tokenizer):
    """Two agentic sessions x two turns through the bench worker (one
    process per method and pass, as `specplug bench` runs them), at batch
    size 1 and in batches of 2 (a fresh engine): sam's outputs equal
    plain's, and turn 1's prompt holds the method's own turn-0 output.
    Slow tier: four engine processes for the harness's own session logic;
    the default tier's `specplug bench --quick` covers the engine path."""
    from vllm_specplug.bench.run import run_bench

    rows = [r for r in load_workload("agentic", limit=2) if r["turn"] < 2]
    assert len(rows) == 4
    res = run_bench(model_path, ["sam"], rows, max_tokens=16, temperature=0.0,
                    out_dir=tmp_path, batch_size=2, workload="agentic", progress=False,
                    engine={"max_model_len": 2048})
    for m in ("plain", "sam"):
        e = res["methods"][m]
        assert e["outputs_differing_from_plain"] == 0, (m, e["differing_prompt_ids"])
        assert e["batch"]["outputs_differing_from_plain"] == 0
        assert [b["size"] for b in e["batch"]["batches"]] == [2, 2]
        assert (tmp_path / "raw" / f"{m}.batch.json").exists()   # its own engine
        raw = json.loads((tmp_path / "raw" / f"{m}.json").read_text())
        by_id = {r["id"]: r for r in raw["results"]}
        assert [r["id"] for r in raw["results"]] == [r["id"] for r in rows]
        for s in ("agent00", "agent01"):
            out0 = tokenizer.decode(by_id[f"{s}:0"]["token_ids"], skip_special_tokens=True)
            prompt1 = tokenizer.decode(by_id[f"{s}:1"]["prompt_token_ids"])
            assert out0.strip() and out0.strip() in prompt1
            assert by_id[f"{s}:1"]["generated"] > 0
    assert res["settings"]["workload"] == "agentic" and res["settings"]["batch_size"] == 2


def test_bench_cli_selects_workload_rows():
    from vllm_specplug.cli import _bench_prompts, build_parser

    p = build_parser()
    args = p.parse_args(["bench", "--workload", "agentic", "--half", "odd", "--limit", "2",
                         "--batch-size", "16"])
    rows = _bench_prompts(args, args.per_category, args.categories)
    assert rows == load_workload("agentic", half="odd", limit=2) and args.batch_size == 16
    args = p.parse_args(["bench", "--per-category", "1", "--limit", "3"])
    assert _bench_prompts(args, 1, None) == load_prompts(per_category=1)[:3]
    args = p.parse_args(["bench", "--workload", "pipeline", "--per-category", "1"])
    with pytest.raises(SystemExit, match="only with --workload spec_bench"):
        _bench_prompts(args, 1, None)
    with pytest.raises(SystemExit):
        p.parse_args(["bench", "--batch", "--batch-size", "4"])
    with pytest.raises(SystemExit):
        p.parse_args(["bench", "--workload", "nope"])
