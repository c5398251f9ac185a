"""The benchmark report flags implausible measurements (no engine):
a speedup above tau, overall or on single prompts, and a plain baseline
slowed on some prompts."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_specplug.bench import report
from vllm_specplug.bench.plausibility import check, speedup_above_tau
from vllm_specplug.bench.run import analyse


def _row(pid, generated, accepted, seconds):
    return {"id": pid, "category": f"c{pid % 2}", "repeat": 0, "token_ids": list(range(generated)),
            "generated": generated, "seconds": seconds, "accepted": accepted,
            "drafts": accepted, "draft_tokens": 2 * accepted, "accepted_per_pos": []}


def _result(plain_rows, method_rows: dict):
    prompts = [{"id": r["id"], "category": r["category"], "prompt": "x"} for r in plain_rows]
    raw = {"plain": {"engine_start_seconds": 1, "batch": None, "results": plain_rows}}
    for m, rows in method_rows.items():
        raw[m] = {"engine_start_seconds": 1, "batch": None, "results": rows}
    methods = ["plain", *method_rows]
    configs = {m: None if m == "plain" else {"method": m} for m in methods}
    return analyse("m", methods, configs, prompts, raw, [], max_tokens=96, temperature=0.0,
                   repeat=1, batch=False)


def test_the_demo_case_ngram_above_tau_is_flagged_and_marked():
    # the demo run: ngram tau 1.25 but 1.91x plain's tokens/s
    plain = [_row(i, 96, 0, 96 * 0.100) for i in range(3)]
    ngram = [_row(i, 96, round(96 * (1 - 1 / 1.25)), 96 * 0.100 / 1.91) for i in range(3)]
    sam = [_row(i, 96, 48, 48 * 0.110) for i in range(3)]   # tau 2, each step 10% dearer
    res = _result(plain, {"ngram": ngram, "sam": sam})
    flagged = {f.method for f in check(res)}
    assert "ngram" in flagged and "sam" not in flagged
    assert any(m.startswith("ngram: speedup 1.91x is above its tau 1.25") for m in res["implausible"])
    md = report.markdown(res)
    assert "Implausible measurements" in md
    assert "| ngram | 1.25 |" in md and "1.91x !" in md
    sam_line = next(line for line in md.splitlines() if line.startswith("| sam |"))
    assert "!" not in sam_line


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(8, 200), st.floats(0.0, 0.9), st.floats(1.0, 3.0),
                          st.floats(0.9, 1.04)), min_size=1, max_size=8),
       st.floats(0.02, 0.2), st.floats(0.0, 5.0))
def test_consistent_timings_are_never_flagged(prompts, step, prefill):
    """Timings from a consistent machine (each prompt: the same prefill for
    both; every verify step costs at least plain's step, up to 3x; plain's own
    step 10% faster to 4% slower per prompt) trip neither bound."""
    plain, spec = [], []
    for i, (n, share, verify_cost, plain_jitter) in enumerate(prompts):
        accepted = int(n * share)
        plain.append(_row(i, n, 0, prefill * 0.01 + n * step * plain_jitter))
        spec.append(_row(i, n, accepted, prefill * 0.01 + (n - accepted) * step * verify_cost))
    res = _result(plain, {"sam": spec, "ngram": spec})
    assert check(res) == []


def test_a_slowed_plain_prompt_is_named():
    plain = [_row(i, 64, 0, 64 * 0.1) for i in range(4)]
    plain[2] = _row(2, 64, 0, 64 * 0.1 * 1.8)     # plain ran 1.8x slower on prompt 2
    spec = {m: [_row(i, 64, 16, 48 * 0.1) for i in range(4)] for m in ("ngram", "sam")}
    flags = check(_result(plain, spec))
    plain_flags = [f.message for f in flags if f.method == "plain"]
    assert len(plain_flags) == 1 and "prompt ids 2 " in plain_flags[0]
    per_prompt = [f.message for f in flags if f.method == "sam"]
    assert any("on 1 of 4 prompts" in m and "(prompt ids 2)" in m for m in per_prompt)


def test_speedup_above_tau_bound_and_nan():
    assert not speedup_above_tau(1.25, 1.30, 0.05)
    assert speedup_above_tau(1.25, 1.32, 0.05)
    assert not speedup_above_tau(float("nan"), 2.0, 0.05)
    assert not speedup_above_tau(1.5, float("nan"), 0.05)


def test_docs_page_links_its_raw_figures_in_results(tmp_path):
    plain = [_row(i, 32, 0, 3.2) for i in range(2)]
    res = _result(plain, {"sam": [_row(i, 32, 8, 2.6) for i in range(2)]})
    docs = tmp_path / "docs" / "benchmarks.md"
    docs.parent.mkdir()
    report.write_docs(res, tmp_path / "out", docs, "specplug bench --quick")
    raw = tmp_path / "results" / "benchmarks.json"
    assert json.loads(raw.read_text())["methods"].keys() == {"plain", "sam"}
    assert "[benchmarks.json](../results/benchmarks.json)" in docs.read_text()
    assert not (docs.parent / "benchmarks.json").exists()


def test_a_busy_machine_is_flagged_by_load_average():
    plain = [_row(i, 64, 0, 6.4) for i in range(3)]
    sam = [_row(i, 64, 16, 4.8) for i in range(3)]
    for r in plain:
        r["load_average"] = 3.4          # other work on a 2-core machine
    for r in sam:
        r["load_average"] = 1.1          # the engine alone
    res = _result(plain, {"sam": sam})
    res["environment"]["cores"] = 2
    flags = check(res)
    assert [f.method for f in flags] == ["plain"]
    assert "load average 3.4 on 2 cores" in flags[0].message
    for r in res["methods"]["plain"]["per_prompt"]:
        r["load_average"] = 1.9
    assert check(res) == []
    # the engine alone keeps both cores busy (lone runs measured 1.64-2.01)
    for r in res["methods"]["plain"]["per_prompt"]:
        r["load_average"] = 2.3
    assert check(res) == []
    for r in res["methods"]["plain"]["per_prompt"]:
        r["load_average"] = 2.7
    assert [f.method for f in check(res)] == ["plain"]


def test_a_time_to_first_token_far_above_plains_is_flagged():
    """The cold start of issue 33: sam's first measured request had a TTFT of
    5.5 s against plain's 0.76 s (numba compiling inside the request)."""
    from vllm_specplug.bench.plausibility import TTFT_FACTOR, TTFT_SLACK_S

    plain = [dict(_row(i, 96, 0, 9.6), ttft=t) for i, t in enumerate([0.76, 0.70, 0.72])]
    cold = [dict(_row(i, 96, 48, 5.0), ttft=t) for i, t in enumerate([5.5, 0.71, 0.73])]
    warm = [dict(_row(i, 96, 48, 5.0), ttft=t) for i, t in enumerate([0.80, 0.71, 0.74])]
    res = _result(plain, {"sam": cold, "suffix": warm})
    flags = [f for f in check(res) if "time to first token" in f.message]
    assert [f.method for f in flags] == ["sam"]
    assert "first request 5.50 s against plain's 0.76 s" in flags[0].message
    assert "median" not in flags[0].message.split(":")[1]
    md = report.markdown(res)
    assert "sam: time to first token" in md
    # a median far above too (every request pays), and the bound's edges
    slow = [dict(r, ttft=2.0) for r in warm]
    assert "median 2.00 s" in check(_result(plain, {"sam": slow}))[0].message
    edge = TTFT_FACTOR * 0.76 + TTFT_SLACK_S
    at_edge = [dict(r, ttft=edge if r["id"] == 0 else 0.7) for r in warm]
    assert not [f for f in check(_result(plain, {"sam": at_edge}))
                if "time to first token" in f.message]
    # rows without stats: nothing to compare
    assert not [f for f in check(_result([_row(0, 96, 0, 9.6)], {"sam": [_row(0, 96, 48, 5.0)]}))
                if "time to first token" in f.message]


def test_the_demo_verdict_compares_each_method_with_suffix():
    """One sentence per method: faster or slower than vLLM's suffix, by how
    much, and whether its outputs equal plain decoding's (the demo's answer)."""
    plain = [_row(i, 96, 0, 96 * 0.100) for i in range(3)]
    suffix = [_row(i, 96, 40, 56 * 0.105) for i in range(3)]    # 96 tok in 17.6 s
    sam = [_row(i, 96, 48, 48 * 0.110) for i in range(3)]       # 96 tok in 15.8 s: faster
    slow = [_row(i, 96, 8, 88 * 0.110) for i in range(3)]       # slower than suffix
    slow[1]["token_ids"] = [7] * 96                             # one output differs
    res = _result(plain, {"suffix": suffix, "sam": sam, "slow": slow})
    lines = report.verdicts(res)
    by = {line.split(":")[0]: line for line in lines}
    assert set(by) == {"suffix", "sam", "slow"}
    ratio = (96 / (48 * 0.110)) / (96 / (56 * 0.105))
    assert by["sam"].startswith("sam: faster than vLLM's `suffix` on this run")
    assert f"{(ratio - 1) * 100:+.0f}%" in by["sam"]
    assert "every output token-identical to plain decoding" in by["sam"]
    assert by["slow"].startswith("slow: slower than vLLM's `suffix`")
    assert "1 output(s) differ from plain decoding" in by["slow"]
    assert "x plain decoding's tokens/s" in by["suffix"]
    # within 2%: a tie, not "slower by -0%"
    tie = report.verdicts(_result(plain, {"suffix": suffix, "same": suffix}))
    assert any(line.startswith("same: on par with vLLM's `suffix`") for line in tie)
    # without suffix in the run, methods are compared with plain decoding
    alone = report.verdicts(_result(plain, {"sam": sam}))
    assert alone[0].startswith("sam: faster than plain decoding")


def test_the_demo_gives_a_verdict_per_workload_against_the_readme():
    """Workload c0: the README recommends sam; c1: nothing is expected to
    gain much, and none of ours may be slower than plain decoding."""
    plain = [_row(i, 96, 0, 96 * 0.100) for i in range(4)]      # c0: ids 0, 2; c1: 1, 3
    suffix = [_row(i, 96, 40, 56 * 0.105) for i in range(4)]
    sam = [_row(i, 96, 48, 48 * 0.110) for i in range(4)]       # fastest everywhere
    res = _result(plain, {"suffix": suffix, "sam": sam})
    lines = report.workload_verdicts(res, {"c0": "sam", "c1": None})
    assert len(lines) == 2
    assert lines[0].startswith("c0 (`suffix` ") and "the recommended `sam` is the fastest" in lines[0]
    assert "none of ours is slower than plain decoding" in lines[1]
    # the README's pick loses by more than ON_PAR: said so, with by how much
    lose = report.workload_verdicts(res, {"c0": "suffix"})
    assert "**not as the README says**: `sam` is" in lose[0]
    # within ON_PAR of the fastest: on par
    near = [dict(r, seconds=r["seconds"] * 1.01) for r in sam]
    res2 = _result(plain, {"sam": sam, "sam_tr": near})
    assert "on par with the fastest, `sam`" in report.workload_verdicts(res2, {"c0": "sam_tr"})[0]
    # methods recommended alike: the fastest of them counts
    assert "the recommended `sam` is the fastest" in report.workload_verdicts(
        res2, {"c0": ("sam_tr", "sam")})[0]
    # one of ours slower than plain where nothing is expected to gain
    slow = [_row(i, 96, 0, 96 * 0.110) for i in range(4)]
    res3 = _result(plain, {"sam": slow})
    assert "**not as expected**: `sam` slower" in report.workload_verdicts(res3, {"c1": None})[0]


def test_the_demo_rows_cover_each_workload_in_order():
    from vllm_specplug.bench.workloads import DEMO_WORKLOADS, demo_rows
    from vllm_specplug.cli import QUICK

    rows = demo_rows()
    labels = list(dict.fromkeys(r["category"] for r in rows))
    assert labels == list(DEMO_WORKLOADS) == list(QUICK["recommends"])
    assert len({r["id"] for r in rows}) == len(rows)
    agent = [r for r in rows if r["category"] == "agent loop"]
    assert [r["turn"] for r in agent] == [0, 1, 2, 3] and len({r["session"] for r in agent}) == 1
    assert sum(r["category"] == "extraction" for r in rows) == 4
