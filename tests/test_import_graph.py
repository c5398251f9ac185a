"""No import cycles between the package's modules (imports inside functions
included; imports of a package's ``__init__``, e.g. ``__version__``, aside),
imports run one way (lower layers import no higher one:
``LAYERS_NOT_IMPORTED``), and ``proposers/`` imports neither vLLM nor torch.
Static (ast): no imports run."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_specplug"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports, absolute, anywhere in its source."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m in _imports(name, path)
                   if m in modules and m != name and modules[m].name != "__init__.py"}
            for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_a_cycle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_tree_runtime_does_not_import_the_drafter():
    """The tree runtime reaches our drafter through ``runner.our_drafter``,
    which knows only the drafter's declared state (``drafter_state``)."""
    graph = import_graph()
    a = "vllm_specplug.vllm_adapter.v1."
    for module in ("tree_runtime", "runner", "sample"):
        assert a + "drafter" not in graph[a + module], module
    assert a + "runner" in graph[a + "tree_runtime"]
    assert a + "drafter_state" in graph[a + "runner"]


def test_proposers_import_neither_vllm_nor_torch():
    for name, path in _modules().items():
        if name.startswith("vllm_specplug.proposers"):
            bad = {m for m in _imports(name, path) if m.split(".")[0] in ("vllm", "torch")}
            assert not bad, f"{name} imports {sorted(bad)}"


# Imports run one way: a module under a layer (a package or a module,
# relative to vllm_specplug) must not import the layers listed for it.
P = "vllm_specplug."
LAYERS_NOT_IMPORTED = {
    **{low: ("bench", "eagle", "vllm_adapter", "cli")
       for low in ("proposers", "tree", "budget", "draft")},
    "bench": ("vllm_adapter",),
    "eagle": ("bench",),
}
PROPOSERS_NOT_IMPORTED_BY = ("budget", "tree", "draft")


def _under(module: str, layer: str) -> bool:
    return module == P + layer or module.startswith(P + layer + ".")


def layering_violations(imports: dict[str, set[str]]) -> list[str]:
    """``"importer -> imported"`` for each import against the layers above."""
    rules = {low: set(high) for low, high in LAYERS_NOT_IMPORTED.items()}
    for low in PROPOSERS_NOT_IMPORTED_BY:
        rules.setdefault(low, set()).add("proposers")
    out = set()
    for name, found in imports.items():
        for low, high in rules.items():
            if _under(name, low):
                out.update(f"{name} -> {m}" for m in found
                           if any(_under(m, h) for h in high))
    return sorted(out)


def test_imports_run_one_way():
    """Lower layers (proposers, tree, budget, draft; bench below the adapter;
    eagle below bench) import no higher one, inside functions included."""
    imports = {name: _imports(name, path) for name, path in _modules().items()}
    assert layering_violations(imports) == []


def test_a_layering_violation_is_found():
    imports = {P + "tree.structure": {P + "proposers.base", P + "proposers.base.Draft",
                                      P + "draft"},
               P + "bench.soak": {P + "vllm_adapter.v1.stats_export", P + "stats_files"},
               P + "eagle.train": {P + "bench.engine", P + "offline_engine"},
               P + "budget": {P + "cli"},
               P + "budgeting": {P + "cli"},  # not the budget layer
               P + "proposers.sam": {P + "draft", P + "tree"},
               P + "vllm_adapter.v1.drafter": {P + "bench", P + "proposers.base"}}
    assert layering_violations(imports) == [
        P + "bench.soak -> " + P + "vllm_adapter.v1.stats_export",
        P + "budget -> " + P + "cli",
        P + "eagle.train -> " + P + "bench.engine",
        P + "tree.structure -> " + P + "proposers.base",
        P + "tree.structure -> " + P + "proposers.base.Draft",
    ]
