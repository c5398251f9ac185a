"""Benchmark statistics on synthetic counter snapshots (no engine)."""
from __future__ import annotations

import json
import math

import pytest

from vllm_specplug.bench.engine import counter_delta
from vllm_specplug.bench.run import BenchError, analyse, method_config
from vllm_specplug.bench.stats import Counters, speedup, summary, total


def test_tau_counts_every_step_including_undrafted_ones():
    # 100 tokens; 30 accepted drafts -> 70 target steps (drafted or not).
    c = Counters(generated=100, accepted=30, drafts=20, draft_tokens=80, seconds=5.0)
    assert c.steps == 70
    assert c.tau == pytest.approx(100 / 70)
    # vLLM's "mean acceptance length" would be 1 + 30/20 = 2.5: drafted steps only.
    assert c.tau < 1 + c.accepted / c.drafts
    assert c.tokens_per_second == pytest.approx(20.0)
    assert c.draft_tokens_per_step == pytest.approx(80 / 70)
    assert c.acceptance_rate == pytest.approx(30 / 80)


def test_plain_decoding_has_tau_one():
    c = Counters(generated=64, accepted=0, drafts=0, draft_tokens=0, seconds=2.0)
    assert c.tau == 1.0
    assert math.isnan(c.acceptance_rate)


def test_per_position_rates_and_totals():
    a = Counters(10, 4, 3, 12, 1.0, [3, 1, 0])
    b = Counters(20, 6, 4, 16, 2.0, [3, 2, 1, 0])
    t = total([a, b])
    assert (t.generated, t.accepted, t.drafts, t.draft_tokens) == (30, 10, 7, 28)
    assert t.seconds == pytest.approx(3.0)
    assert t.accepted_per_pos == [6, 3, 1, 0]
    assert t.acceptance_per_position() == pytest.approx([6 / 7, 3 / 7, 1 / 7, 0.0])


def test_speedup_and_summary():
    base = Counters(100, 0, 0, 0, 10.0)
    spec = Counters(100, 40, 30, 90, 8.0)
    assert speedup(spec.tokens_per_second, base.tokens_per_second) == pytest.approx(1.25)
    s = summary(spec, base)
    assert s["speedup"] == pytest.approx(1.25)
    assert s["tau"] == pytest.approx(100 / 60)
    assert math.isnan(speedup(1.0, 0.0))


def test_counter_delta():
    before = {"drafts": 2, "draft_tokens": 10, "accepted": 3, "accepted_per_pos": [2, 1]}
    after = {"drafts": 5, "draft_tokens": 22, "accepted": 9, "accepted_per_pos": [4, 3, 2]}
    d = counter_delta(after, before)
    assert d == {"drafts": 3, "draft_tokens": 12, "accepted": 6, "accepted_per_pos": [2, 2, 2]}


def _row(pid, cat, ids, accepted=0, seconds=1.0, drafts=0, draft_tokens=0):
    return {"id": pid, "category": cat, "repeat": 0, "token_ids": ids, "generated": len(ids),
            "seconds": seconds, "accepted": accepted, "drafts": drafts,
            "draft_tokens": draft_tokens, "accepted_per_pos": []}


def test_analyse_counts_differing_outputs_and_categories():
    prompts = [{"id": 1, "category": "a", "prompt": "x"}, {"id": 2, "category": "b", "prompt": "y"}]
    raw = {
        "plain": {"engine_start_seconds": 1, "batch": None,
                  "results": [_row(1, "a", [1, 2, 3, 4]), _row(2, "b", [5, 6])]},
        "sam": {"engine_start_seconds": 1, "batch": None,
                "results": [_row(1, "a", [1, 2, 3, 4], accepted=2, seconds=0.5, drafts=1,
                                 draft_tokens=3),
                            _row(2, "b", [5, 7], seconds=1.0)]},
    }
    res = analyse("m", ["plain", "sam"], {"plain": None, "sam": {"method": "sam"}}, prompts,
                  raw, [], max_tokens=4, temperature=0.0, repeat=1, batch=False)
    assert res["methods"]["plain"]["overall"]["tau"] == 1.0
    assert res["methods"]["plain"]["outputs_differing_from_plain"] == 0
    sam = res["methods"]["sam"]
    assert sam["outputs_differing_from_plain"] == 1 and sam["differing_prompt_ids"] == [2]
    assert sam["categories"]["a"]["tau"] == pytest.approx(4 / 2)
    assert sam["categories"]["a"]["speedup"] == pytest.approx(2.0)
    assert sam["categories"]["b"]["tau"] == 1.0
    assert "token_ids" not in sam["per_prompt"][0]


def test_decode_rate_leaves_out_each_requests_first_token_and_rows_without_stats():
    from vllm_specplug.bench.run import counters_of

    rows = [dict(_row(1, "a", [1] * 11, seconds=2.0), decode_seconds=0.5),
            dict(_row(2, "a", [1] * 5, seconds=1.0), decode_seconds=0.3),
            _row(3, "a", [1] * 4, seconds=1.0),                      # older raw result
            dict(_row(4, "a", [1] * 4, seconds=1.0), decode_seconds=None),  # no stats
            dict(_row(5, "a", [1], seconds=0.2), decode_seconds=0.0)]     # one token
    c = counters_of(rows)
    assert (c.decode_tokens, c.decode_seconds) == (10 + 4, pytest.approx(0.8))
    assert c.decode_tokens_per_second == pytest.approx(14 / 0.8)
    assert c.tokens_per_second == pytest.approx(25 / 5.2)
    base = Counters(generated=25, seconds=10.0, decode_tokens=14, decode_seconds=1.6)
    s = summary(c, base)
    assert s["decode_speedup"] == pytest.approx(2.0)
    assert math.isnan(Counters(generated=3, seconds=1.0).decode_tokens_per_second)


def test_method_config_variants_and_errors():
    assert method_config("plain") is None
    assert method_config("ngram")["prompt_lookup_max"] == 5
    v = method_config("sam@x", {"sam@x": {"sam_min_accept_prob": 0.0}})
    assert v == {"method": "sam", "num_speculative_tokens": 32, "sam_min_accept_prob": 0.0}
    with pytest.raises(BenchError, match="unknown method"):
        method_config("nope")
    with pytest.raises(BenchError, match="plain"):
        method_config("plain", {"plain": {"x": 1}})


def test_prompt_halves_are_disjoint_and_cover_every_category():
    """``--half even`` (benchmark) and ``--half odd`` (corpus answers) split
    each category's prompts in two, alternating, with nothing shared."""
    from vllm_specplug.bench.prompts import load_prompts

    all_rows = load_prompts()
    even, odd = load_prompts(half="even"), load_prompts(half="odd")
    assert {r["id"] for r in even}.isdisjoint({r["id"] for r in odd})
    assert len(even) + len(odd) == len(all_rows)
    for cat in {r["category"] for r in all_rows}:
        ids = [r["id"] for r in all_rows if r["category"] == cat]
        assert [r["id"] for r in even if r["category"] == cat] == ids[0::2]
        assert [r["id"] for r in odd if r["category"] == cat] == ids[1::2]
    assert len(load_prompts(half="even", per_category=2)) == 2 * len({r["category"]
                                                                      for r in all_rows})
    with pytest.raises(ValueError, match="half"):
        load_prompts(half="first")


def test_output_logprobs_match_a_token_by_token_computation(model_path):
    """The batched scoring of an output equals scoring each of its tokens
    from its own prefix (real embedded model, transformers on CPU)."""
    import torch

    from vllm_specplug.bench.quality import _load, mean_logprob, output_logprobs

    prompt, output = [1, 504, 3458, 314, 253], [1345, 28, 30, 2]
    [(total, n)] = output_logprobs(model_path, [(prompt, output)])
    model = _load(model_path)
    want = 0.0
    with torch.inference_mode():
        for i, tok in enumerate(output):
            logits = model(torch.tensor([prompt + output[:i]])).logits[0, -1]
            want += float(torch.log_softmax(logits, -1)[tok])
    assert n == len(output)
    assert total == pytest.approx(want, abs=1e-3)
    assert mean_logprob([(total, n), (0.0, 0)]) == pytest.approx(want / n)



def test_ttft_first_and_median_are_reported_beside_decode_rate():
    from vllm_specplug.bench import report
    from vllm_specplug.bench.run import ttft_summary

    prompts = [{"id": i, "category": "a", "prompt": "x"} for i in range(3)]
    plain = [dict(_row(i, "a", [1, 2, 3]), ttft=t, decode_seconds=0.5)
             for i, t in enumerate([0.30, 0.20, 0.25])]
    sam = [dict(_row(i, "a", [1, 2, 3]), ttft=t, decode_seconds=0.4)
           for i, t in enumerate([5.5, 0.22, 0.26])]
    raw = {"plain": {"engine_start_seconds": 1, "batch": None, "results": plain},
           "sam": {"engine_start_seconds": 1, "batch": None, "results": sam}}
    res = analyse("m", ["plain", "sam"], {"plain": None, "sam": {"method": "sam"}}, prompts,
                  raw, [], max_tokens=3, temperature=0.0, repeat=1, batch=False)
    assert res["methods"]["sam"]["ttft"] == {"first": 5.5, "median": 0.26, "requests": 3}
    assert res["methods"]["plain"]["ttft"]["median"] == pytest.approx(0.25)
    md = report.markdown(res)
    assert "TTFT median (first)" in md
    sam_line = next(line for line in md.splitlines() if line.startswith("| sam |"))
    assert "0.26 s (5.50 s)" in sam_line
    # rows without stats (older raw results) report none
    assert ttft_summary([_row(1, "a", [1])]) is None


def test_repeats_run_in_fresh_engines(tmp_path, monkeypatch):
    """``--repeat`` runs each repeat in its own engine: in one engine the
    later repeats would draft from cross-request memory holding this run's
    own outputs of the same prompts."""
    from vllm_specplug.bench import report, run

    calls = []

    def fake_worker(cfg, log_path, raw_path, on_progress=None):
        calls.append((cfg["method_name"], cfg["repeat"], cfg.get("repeat_index", 0)))
        rows = [dict(_row(p["id"], p["category"], [1, 2]), repeat=rep, ttft=0.1)
                for rep in range(cfg.get("repeat_index", 0),
                                 cfg.get("repeat_index", 0) + cfg["repeat"])
                for p in cfg["prompts"]]
        out = {"engine_start_seconds": 2.0, "results": rows, "batch": None,
               "drafter_stats": None, "process_seconds": 3.0}
        raw_path.write_text(json.dumps(out))
        return out

    monkeypatch.setattr(run, "run_worker", fake_worker)
    prompts = [{"id": 1, "category": "a", "prompt": "x"}, {"id": 2, "category": "a",
                                                            "prompt": "y"}]
    res = run.run_bench("m", ["sam"], prompts, max_tokens=2, temperature=0.0,
                        out_dir=tmp_path, repeat=3, progress=False)
    assert calls == [(m, 1, r) for m in ("plain", "sam") for r in range(3)]
    sam = res["methods"]["sam"]
    assert sorted(r["repeat"] for r in sam["per_prompt"]) == [0, 0, 1, 1, 2, 2]
    assert sam["outputs_differing_from_plain"] == 0 and sam["process_seconds"] == 9.0
    assert res["settings"]["repeat_in_fresh_engines"]
    assert "(each repeat in a fresh engine)" in report.markdown(res)
    assert json.loads((tmp_path / "raw" / "sam.json").read_text())["results"][-1]["repeat"] == 2
    calls.clear()
    run.run_bench("m", ["sam"], prompts, max_tokens=2, temperature=0.0, out_dir=tmp_path,
                  repeat=1, progress=False)
    assert calls == [("plain", 1, 0), ("sam", 1, 0)]
