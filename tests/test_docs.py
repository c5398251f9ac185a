"""The docs against the code (no engine, a second or two): the README's layout
against the package tree, the PATCHES table against docs/architecture.md,
every key of every built-in method against docs/configuration.md, and every
relative link and repository path in the docs against the files."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vllm_specplug"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS, ROOT / "results" / "README.md",
         *sorted((ROOT / "examples").glob("**/README.md"))]


def _layout_entries() -> list[str]:
    """Paths named in the README's "Layout" code block, relative to the repo:
    an unindented ``name/`` is a top-level folder; an indented ``name/`` or
    ``name.py`` lies in the last unindented folder."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
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
