"""The docs against the code (no engine, a second or two): the README's layout
against the package tree and scripts/, the PATCHES table against
docs/architecture.md, every key of every built-in method against
docs/configuration.md, every relative link and repository path in the docs
against the files, and the docs' line limits."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vllm_specplug"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS, *sorted((ROOT / "results").glob("**/README.md")),
         *sorted((ROOT / "examples").glob("**/README.md"))]

#: Most lines a page may have (issue 46: docs a user reads in one sitting;
#: write-ups of experiments go in the results folder that produced them).
LINE_LIMITS = {"README.md": 200, "docs/benchmarks.md": 400, "docs/architecture.md": 400}


def _layout_block() -> str:
    """The README's "Layout" code block."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1]


def _layout_entries() -> list[str]:
    """Paths named in the README's "Layout" code block, relative to the repo:
    an unindented ``name/`` is a top-level folder; an indented ``name/`` or
    ``name.py`` lies in the last unindented folder."""
    block = _layout_block()
    entries, parent = [], ""
    for line in block.splitlines():
        m = re.match(r"^( *)(\S+?(?:/|\.py))(?=\s|$)", line)
        if not m:
            continue
        indent, name = m.groups()
        if not indent:
            parent = name if name.endswith("/") else ""
            entries.append(name)
        else:
            entries.append(parent + name)
    return entries


def _layout_scripts() -> set[str]:
    """File names on the indented lines under ``scripts/`` in the Layout block
    (several may share a line: ``a.py, b.py   what they are for``)."""
    lines = _layout_block().split("\nscripts/", 1)[1].splitlines()[1:]
    names = set()
    for line in lines:
        if not line.startswith(" "):
            break
        names |= set(re.findall(r"[\w.-]+\.(?:py|sh)\b", line.split("   ", 1)[0]))
    return names


def _subpackages() -> set[str]:
    """Folders of vllm_specplug holding Python modules or package data."""
    return {f"vllm_specplug/{p.name}/" for p in PACKAGE.iterdir()
            if p.is_dir() and p.name != "__pycache__"
            and any(q.suffix in (".py", ".jsonl") for q in p.iterdir())}


def _top_modules() -> set[str]:
    return {f"vllm_specplug/{p.name}" for p in PACKAGE.glob("*.py")
            if p.name not in ("__init__.py", "__main__.py")}


def test_layout_names_only_what_exists():
    entries = _layout_entries()
    assert "vllm_specplug/" in entries and len(entries) > 10, entries
    missing = [e for e in entries if not (ROOT / e).exists()]
    assert not missing, f"README layout names paths that do not exist: {missing}"


def test_layout_lists_every_subpackage_and_module():
    entries = set(_layout_entries())
    unlisted = sorted((_subpackages() | _top_modules()) - entries)
    assert not unlisted, (f"README layout lacks {unlisted}: add a line for each under "
                          f"'vllm_specplug/' in the Layout block")


def test_layout_names_every_script_and_only_those():
    """scripts/ holds tools, each named in the README's layout with what it is
    for; a one-off experiment leaves the tree once its results are written up
    (results/README.md, "Scripts that left the tree")."""
    on_disk = {p.name for p in (ROOT / "scripts").iterdir() if p.is_file()}
    named = _layout_scripts()
    assert named, "README layout names no scripts under 'scripts/'"
    assert not named - on_disk, f"README layout names missing scripts: {sorted(named - on_disk)}"
    assert not on_disk - named, (f"scripts/ holds {sorted(on_disk - named)}, not in the README "
                                 f"layout: say what each is for, or remove the experiment")


@pytest.mark.parametrize("page, limit", sorted(LINE_LIMITS.items()))
def test_pages_stay_within_their_line_limits(page, limit):
    lines = len((ROOT / page).read_text().splitlines())
    assert lines <= limit, (f"{page} has {lines} lines, more than {limit}: move experiments and "
                            f"their write-ups to results/<topic>/README.md and link them in one line")


def test_every_patch_is_named_in_architecture():
    from vllm_specplug.vllm_adapter.v1 import PATCHES

    text = (ROOT / "docs" / "architecture.md").read_text()
    assert PATCHES
    missing = [p.name for p in PATCHES if f"`{p.name}`" not in text]
    assert not missing, (f"docs/architecture.md's patch table lacks {missing} "
                         f"(vllm_adapter/__init__.py: PATCHES)")


def test_every_key_of_every_builtin_method_and_rule_is_documented():
    from vllm_specplug.budget import BATCH_BUDGET_KEY, DISABLE_BY_BATCH_SIZE_KEY
    from vllm_specplug.registry import BUILTIN_PROPOSERS, get_proposer_class
    from vllm_specplug.scorers.registry import (ACCEPTANCE_KEY, get_scorer_class,
                                                scorer_names)

    text = (ROOT / "docs" / "configuration.md").read_text()
    keys = {"num_speculative_tokens", ACCEPTANCE_KEY, BATCH_BUDGET_KEY,
            DISABLE_BY_BATCH_SIZE_KEY}
    for method in BUILTIN_PROPOSERS:
        assert f"`{method}`" in text, method
        keys |= {o.name for o in get_proposer_class(method).options}
    for rule in scorer_names():
        assert f"`{rule}`" in text or f'"{rule}"' in text, rule
        keys |= {o.name for o in get_scorer_class(rule).options}
    missing = sorted(k for k in keys if f"`{k}`" not in text)
    assert not missing, f"docs/configuration.md does not document {missing}"


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_REPO_PATH = re.compile(r"`((?:docs|results|scripts|tests|vllm_specplug|examples)/[^`\s]+?)`")


def _targets(page: Path):
    text = page.read_text()
    # links inside code blocks are code, not links
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for m in _LINK.finditer(prose):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        yield "link", target.split("#", 1)[0], page.parent
    for m in _REPO_PATH.finditer(prose):
        path = m.group(1).split("::", 1)[0].rstrip(".,:;")
        if not any(c in path for c in "*{<"):
            yield "path", path, ROOT


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_repository_paths_exist(page):
    broken = [f"{kind} {target}" for kind, target, base in _targets(page)
              if not (base / target).exists()]
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_results_index_lists_every_result():
    """results/README.md names every file of results/ and every folder of
    results/runs and results/serve (what it is, which doc cites it)."""
    results = ROOT / "results"
    index = (results / "README.md").read_text()
    entries = [p for p in results.iterdir() if p.name != "README.md"]
    entries += [p for sub in ("runs", "serve") if (results / sub).is_dir()
                for p in (results / sub).iterdir()]
    names = [p.relative_to(results).as_posix() + ("/" if p.is_dir() else "") for p in entries]
    missing = sorted(n for n in names if f"`{n}`" not in index
                     and not (n in ("runs/", "serve/")))
    assert not missing, f"results/README.md does not index {missing}"
