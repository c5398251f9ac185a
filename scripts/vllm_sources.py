"""The Python sources of vLLM releases, downloaded once and cached, and a
static (ast, nothing imported) reader of them.

``python scripts/vllm_sources.py [VERSION ...]`` fills the cache for each
release (default: every release in ``vllm_adapter.version.ADAPTERS``):
``pip download vllm==VERSION --no-deps`` (the CUDA wheel, 240-340 MB), then
only its ``*.py`` files (and its ``dist-info``) are unpacked into
``$SPECPLUG_VLLM_SOURCES/<version>/`` (default
``~/.cache/vllm_specplug/vllm_sources``; 50-65 MB a release) and the wheel is
deleted. ``--install-into SITE_PACKAGES`` copies one release's tree there
(the vLLM 0.34 side environment: ``scripts/setup-vllm034.sh``).

tests/test_adapter_targets.py reads the cache through :class:`StaticSource`
to check every adapter target against every supported release without
installing it; its tests skip, naming this script, when a release is absent.
"""
from __future__ import annotations

import argparse
import ast
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

COMPLETE = ".complete"


def cache_root() -> Path:
    env = os.environ.get("SPECPLUG_VLLM_SOURCES")
    return Path(env) if env else Path.home() / ".cache" / "vllm_specplug" / "vllm_sources"


def source_dir(version: str) -> Path | None:
    """The cached tree of ``version`` (holding ``vllm/``), or None if not fetched."""
    root = cache_root() / version
    return root if (root / COMPLETE).exists() else None


def fetch(version: str, wheel_dir: str | None = None) -> Path:
    """Download vLLM ``version``'s wheel (or take it from ``wheel_dir``) and
    unpack only its Python files and metadata into the cache."""
    done = source_dir(version)
    if done is not None:
        return done
    root = cache_root() / version
    with tempfile.TemporaryDirectory() as tmp:
        wheels = list(Path(wheel_dir).glob(f"vllm-{version}-*.whl")) if wheel_dir else []
        if not wheels:
            subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={version}",
                            "--no-deps", "--only-binary=:all:", "-q", "-d", tmp], check=True)
            wheels = list(Path(tmp).glob(f"vllm-{version}-*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"expected one vllm {version} wheel, found {wheels}")
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        with zipfile.ZipFile(wheels[0]) as zf:
            for name in zf.namelist():
                if name.endswith(".py") or ".dist-info/" in name:
                    zf.extract(name, root)
    (root / COMPLETE).write_text(version + "\n")
    return root


def install_into(version: str, site_packages: str) -> None:
    """Copy a cached release's ``vllm/`` and ``dist-info`` into ``site_packages``
    (Python files only: vLLM's compiled extensions stay out)."""
    src = source_dir(version) or fetch(version)
    dest = Path(site_packages)
    for item in src.iterdir():
        if item.name == COMPLETE:
            continue
        target = dest / item.name
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(item, target)


# ------------------------------------------------------------- static reading
class StaticSource:
    """Modules, classes, attributes and signatures of one vLLM source tree,
    read with ``ast`` (no import). Names re-exported by ``from x import y``
    are followed; class attributes include dataclass fields, class-level
    assignments, methods, properties and ``self.x = ...`` in any method, and
    those of bases defined in vLLM."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def module_path(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.exists():
                return path
        return None

    @functools.lru_cache(maxsize=None)
    def tree(self, module: str) -> ast.Module | None:
        path = self.module_path(module)
        return None if path is None else ast.parse(path.read_text(), str(path))

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        path = self.module_path(module)
        parts = module.split(".")
        package = parts if path is not None and path.name == "__init__.py" else parts[:-1]
        base = package[: len(package) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))

    @functools.lru_cache(maxsize=None)
    def lookup(self, module: str, name: str, _depth: int = 0):
        """``(module, node)`` where ``module``'s top-level ``name`` is defined
        (a ClassDef, FunctionDef, or an Assign/AnnAssign), following
        re-exports; ``(module, "module")`` for a submodule; None if absent."""
        tree = self.tree(module)
        if tree is None or _depth > 20:
            return None
        found = None
        for node in tree.body:
            found = self._defines(module, node, name, _depth) or found
        if found is None and self.module_path(f"{module}.{name}") is not None:
            return f"{module}.{name}", "module"
        return found

    def _defines(self, module: str, node, name: str, depth: int):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            return (module, node) if node.name == name else None
        if isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            return (module, node) if name in names else None
        if isinstance(node, ast.AnnAssign):
            target = node.target
            return (module, node) if isinstance(target, ast.Name) and target.id == name else None
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":  # `from x import *`
                    hit = self.lookup(self._absolute(module, node), name, depth + 1)
                    if hit:
                        return hit
                elif (alias.asname or alias.name) == name:
                    source = self._absolute(module, node)
                    return self.lookup(source, alias.name, depth + 1) or (
                        (f"{source}.{alias.name}", "module")
                        if self.module_path(f"{source}.{alias.name}") else None)
        if isinstance(node, (ast.If, ast.Try)):  # e.g. `if TYPE_CHECKING:` or try/except imports
            for sub in [*node.body, *getattr(node, "orelse", []),
                        *[s for h in getattr(node, "handlers", []) for s in h.body]]:
                hit = self._defines(module, sub, name, depth)
                if hit:
                    return hit
        return None

    def has_name(self, module: str, name: str) -> bool:
        return self.lookup(module, name) is not None

    def class_def(self, module: str, cls: str) -> tuple[str, ast.ClassDef] | None:
        hit = self.lookup(module, cls)
        if hit is None or not isinstance(hit[1], ast.ClassDef):
            return None
        return hit

    def _bases(self, module: str, node: ast.ClassDef):
        for base in node.bases:
            if isinstance(base, ast.Name):
                hit = self.class_def(module, base.id)
            elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                mod = self.lookup(module, base.value.id)
                hit = (self.class_def(mod[0], base.attr)
                       if mod is not None and mod[1] == "module" else None)
            else:
                hit = None
            if hit is not None:
                yield hit

    def member(self, module: str, cls: str, attr: str, _seen=None):
        """The class-body node (def or assignment) defining ``cls.attr`` in
        the class or a vLLM base; ``"self"`` if only assigned as ``self.attr``
        in a method; None if absent."""
        hit = self.class_def(module, cls)
        if hit is None:
            return None
        return self._member(*hit, attr)

    def _member(self, module: str, node: ast.ClassDef, attr: str):
        assigned = False
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if item.name == attr:
                    return item
                for sub in ast.walk(item):
                    targets = (sub.targets if isinstance(sub, ast.Assign) else
                               [sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign))
                               else [])
                    for t in targets:
                        for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                            if (isinstance(e, ast.Attribute) and e.attr == attr
                                    and isinstance(e.value, ast.Name) and e.value.id == "self"):
                                assigned = True
            elif isinstance(item, ast.Assign):
                if any(isinstance(t, ast.Name) and t.id == attr for t in item.targets):
                    return item
            elif isinstance(item, ast.AnnAssign):
                if isinstance(item.target, ast.Name) and item.target.id == attr:
                    return item
        for base_module, base in self._bases(module, node):
            found = self._member(base_module, base, attr)
            if found is not None and found != "self":
                return found
            assigned = assigned or found == "self"
        return "self" if assigned else None

    def has_attribute(self, module: str, cls: str, attr: str) -> bool:
        return self.member(module, cls, attr) is not None

    def parameters(self, module: str, cls: str | None, attr: str) -> list[str] | None:
        """Parameter names of a function or method (None: not a def)."""
        if cls is None:
            hit = self.lookup(module, attr)
            node = hit[1] if hit else None
        else:
            node = self.member(module, cls, attr)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return None
        a = node.args
        names = [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]]
        names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
        return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("versions", nargs="*", help="vLLM releases (default: every supported one)")
    ap.add_argument("--wheel-dir", help="take vllm-VERSION-*.whl from here instead of pip")
    ap.add_argument("--install-into", metavar="SITE_PACKAGES",
                    help="copy the (one) release's Python files into this site-packages")
    args = ap.parse_args(argv)
    versions = args.versions
    if not versions:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from vllm_specplug.vllm_adapter.version import SUPPORTED_VLLM_VERSIONS

        versions = list(SUPPORTED_VLLM_VERSIONS)
    for v in versions:
        print(f"vLLM {v}: {fetch(v, args.wheel_dir)}")
    if args.install_into:
        if len(versions) != 1:
            ap.error("--install-into takes exactly one version")
        install_into(versions[0], args.install_into)
        print(f"vLLM {versions[0]}'s Python files copied into {args.install_into}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
