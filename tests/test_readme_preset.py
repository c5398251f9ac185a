"""`specplug bench --preset readme` (no engine): the README's methods table
comes from one run, with its command beside it; a busy run never rewrites it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_specplug import cli
from vllm_specplug.bench import report

from test_bench_plausibility import _result, _row

ROOT = Path(__file__).resolve().parents[1]


def _run():
    plain = [_row(i, 96, 0, 96 * 0.100) for i in range(3)]
    suffix = [_row(i, 96, 40, 56 * 0.105) for i in range(3)]
    sam = [_row(i, 96, 48, 48 * 0.110) for i in range(3)]
    odd = [_row(i, 96, 30, 66 * 0.110) for i in range(3)]
    odd[2]["token_ids"] = [7] * 96                    # one output differs from plain
    res = _result(plain, {"suffix": suffix, "sam": sam, "token_recycling": odd})
    res["environment"]["commit"] = "abc1234"
    return res


def test_table_has_a_row_per_method_with_speedup_over_plain_and_identity():
    res = _run()
    table = report.readme_table(res, "specplug bench --preset readme", "results/runs/x",
                                {"eagle2": "needs a trained head"})
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in table.splitlines() if line.startswith("| `") or
            line.startswith("| vLLM")}
    assert list(rows) == ["`sam`", "`token_recycling`", "vLLM `suffix`", "`plain`", "`eagle2`"]
    sam = rows["`sam`"]
    want = res["methods"]["sam"]["overall"]["tokens_per_second"] / \
        res["methods"]["plain"]["overall"]["tokens_per_second"]
    assert sam[3] == f"{res['methods']['sam']['overall']['tau']:.2f}"
    assert sam[5] == f"{want:.2f}x" and sam[6] == "all"
    assert rows["`token_recycling`"][6] == "**1 differ**"
    assert rows["`plain`"][5] == "1.00x" and rows["`plain`"][6] == "reference"
    assert "not in this run: needs a trained head" in rows["`eagle2`"][3]
    assert "commit `abc1234`" in table and "3 spec_bench prompts" in table
    assert table.rstrip().endswith("specplug bench --preset readme\n```")


def test_an_implausible_run_or_one_without_plain_is_refused():
    res = _run()
    res["methods"]["sam"]["overall"]["tokens_per_second"] *= 3   # speedup above tau
    res["methods"]["sam"]["overall"]["speedup"] *= 3
    with pytest.raises(ValueError, match="implausible"):
        report.readme_table(res, "c", "r")
    res = _run()
    del res["methods"]["plain"]
    with pytest.raises(ValueError, match="plain decoding"):
        report.readme_table(res, "c", "r")


def test_update_replaces_only_the_block(tmp_path):
    p = tmp_path / "README.md"
    p.write_text(f"# x\nbefore\n{report.README_BEGIN}\nold table\n{report.README_END}\nafter\n")
    report.update_readme(p, "new table")
    assert p.read_text() == (f"# x\nbefore\n{report.README_BEGIN}\nnew table\n"
                             f"{report.README_END}\nafter\n")
    p.write_text("# no block\n")
    with pytest.raises(ValueError, match="expected one"):
        report.update_readme(p, "t")


def test_the_preset_refuses_options_that_would_change_the_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "README.md").write_text(f"{report.README_BEGIN}\n{report.README_END}\n")
    for extra, name in ((["--methods", "sam"], "--methods"), (["--max-tokens", "64"],
                        "--max-tokens"), (["--temperature", "0.7"], "--temperature"),
                        (["--workload", "agentic"], "--workload")):
        with pytest.raises(SystemExit, match=f"drop {name}"):
            cli.main(["bench", "--preset", "readme", *extra])
    (tmp_path / "README.md").write_text("no block\n")
    with pytest.raises(SystemExit, match="no methods-table block"):
        cli.main(["bench", "--preset", "readme"])
    with pytest.raises(SystemExit, match="only with --preset readme"):
        cli.main(["bench", "--readme", "README.md"])


def test_the_preset_fixes_the_run(tmp_path, monkeypatch):
    """What --preset readme sets (without running anything)."""
    import argparse

    monkeypatch.chdir(tmp_path)
    (tmp_path / "README.md").write_text(f"{report.README_BEGIN}\n{report.README_END}\n")
    def fresh(**kw):
        return argparse.Namespace(**{**dict(
            methods=None, prompts=None, per_category=None, categories=None, half=None,
            max_tokens=None, limit=None, batch_size=None, speculative_config=[],
            temperature=0.0, repeat=1, batch=False, quick=False, workload="spec_bench",
            eagle_head=None, out="bench_results", readme=None), **kw})

    args = fresh()
    cli._apply_readme_preset(args)
    assert args.methods.split(",") == ["plain", "ngram", "suffix", "sam", "token_recycling",
                                       "sam_tr", "del"]
    assert (args.half, args.per_category, args.max_tokens) == ("odd", 1, 128)
    assert re.fullmatch(r"results/runs/readme_\d{4}-\d\d-\d\d", args.out)
    args = fresh(eagle_head="/heads/h")
    cli._apply_readme_preset(args)
    assert args.methods.endswith(",eagle2,sam_eagle2")



def test_the_readme_has_the_block_the_preset_rewrites():
    text = (ROOT / "README.md").read_text()
    assert text.count(report.README_BEGIN) == 1 and text.count(report.README_END) == 1
    assert text.index(report.README_BEGIN) < text.index(report.README_END)


def test_the_readme_table_block_and_its_command_are_in_the_readme():
    text = (ROOT / "README.md").read_text()
    assert text.count(report.README_BEGIN) == 1 and text.count(report.README_END) == 1
    block = text.split(report.README_BEGIN)[1].split(report.README_END)[0]
    assert "specplug bench --preset readme" in block
    assert "commit `" in block
