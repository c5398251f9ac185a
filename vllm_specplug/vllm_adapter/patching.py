"""Every monkeypatch of vLLM, declared in one place, checked and recorded.

Two kinds of patch: :class:`Patch` replaces an attribute (a method of a vLLM
class, or a module-level function); :class:`BackendOverride` points one of
vLLM's attention backends at our class through vLLM's own
``register_backend``. ``apply`` is idempotent (every vLLM process loads the
plugin, some more than once) and keeps the original so tests can inspect or
undo it.

Drift fails loudly: ``apply`` and ``check_targets`` raise
:class:`PatchTargetMissing`, naming the patch and the supported vLLM
release, when a target module, class, attribute or argument does not exist
in the installed vLLM (a renamed method would otherwise never be called, and
nothing would say so).
"""
from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, Union

from .version import SUPPORTED_VLLM_VERSIONS, vllm_version

logger = logging.getLogger("vllm_specplug")

#: Where vLLM's attention backends are registered (``BackendOverride``).
BACKEND_REGISTRY_MODULE = "vllm.v1.attention.backends.registry"


class PatchTargetMissing(RuntimeError):
    """A patch target is missing from the installed vLLM (vLLM drifted)."""


@dataclass(frozen=True)
class Patch:
    name: str            # e.g. "EngineArgs.create_speculative_config"
    module: str          # where the class lives
    cls: str | None      # the vLLM class changed (None: a module-level function)
    attr: str            # the attribute replaced
    make: Callable[[Any], Any]  # original -> replacement
    why: str
    #: Parameters of the original the replacement relies on (reads by name
    #: through ``bind``, or takes in this order); each must exist in the
    #: original's signature, checked at plugin load.
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class BackendOverride:
    """``register_backend(AttentionBackendEnum.<backend>, class_path)``."""
    name: str            # e.g. "AttentionBackendEnum.CPU_ATTN"
    backend: str         # the AttentionBackendEnum member overridden
    class_path: str      # our backend class, "module.Class"
    why: str
    module: str = BACKEND_REGISTRY_MODULE


AnyPatch = Union[Patch, BackendOverride]

#: name -> (patch, original) for every patch applied in this process (for a
#: BackendOverride, the backend's class path before the override).
APPLIED: dict[str, tuple[AnyPatch, Any]] = {}


def _missing(patch: AnyPatch, what: str) -> PatchTargetMissing:
    return PatchTargetMissing(
        f"vllm_specplug patch {patch.name!r}: {what} in the installed vLLM {vllm_version()}; "
        f"this vllm-specplug supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)} (its "
        f"patch is for: {patch.why})")


def _import(patch: AnyPatch, module: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise _missing(patch, f"module {module} cannot be imported ({e})") from e


def _resolve(patch: Patch) -> tuple[Any, Any]:
    """(owner, original) of ``patch``; raises ``PatchTargetMissing``."""
    owner = _import(patch, patch.module)
    if patch.cls is not None:
        if patch.cls not in vars(owner):
            raise _missing(patch, f"class {patch.module}.{patch.cls} does not exist")
        owner = vars(owner)[patch.cls]
    where = f"{patch.module}.{patch.cls + '.' if patch.cls else ''}{patch.attr}"
    if not hasattr(owner, patch.attr):
        raise _missing(patch, f"{where} does not exist")
    original = owner.__dict__.get(patch.attr, getattr(owner, patch.attr))
    if patch.args:
        function = (original.__func__ if isinstance(original, (classmethod, staticmethod))
                    else original)
        params = inspect.signature(function).parameters
        gone = [a for a in patch.args if a not in params]
        if gone:
            raise _missing(patch, f"{where} has no parameter {', '.join(map(repr, gone))} "
                                  f"(its parameters: {', '.join(params)})")
    return owner, original


def _backend_enum(patch: BackendOverride):
    registry = _import(patch, patch.module)
    for name in ("AttentionBackendEnum", "register_backend"):
        if name not in vars(registry):
            raise _missing(patch, f"{patch.module}.{name} does not exist")
    enum = registry.AttentionBackendEnum
    if patch.backend not in enum.__members__:
        raise _missing(patch, f"attention backend AttentionBackendEnum.{patch.backend} "
                              f"does not exist")
    return registry, enum.__members__[patch.backend]


def check_target(patch: AnyPatch) -> None:
    """Raise ``PatchTargetMissing`` unless ``patch``'s target exists (nothing applied)."""
    if isinstance(patch, BackendOverride):
        _backend_enum(patch)
    else:
        _resolve(patch)


def check_targets(patches: Iterable[AnyPatch], check: Callable[[Any], None] = None) -> None:
    """Check every target without applying anything (with ``check``, default
    ``check_target``); one error lists all missing."""
    problems = []
    for patch in patches:
        try:
            (check or check_target)(patch)
        except PatchTargetMissing as e:
            problems.append(str(e))
    if problems:
        raise PatchTargetMissing("\n".join(problems))


def apply(patch: AnyPatch) -> None:
    if patch.name in APPLIED:
        return
    if isinstance(patch, BackendOverride):
        registry, member = _backend_enum(patch)
        original = member.get_path()
        registry.register_backend(member, patch.class_path)
    else:
        owner, original = _resolve(patch)
        replacement = patch.make(original)
        setattr(replacement, "__specplug_patch__", patch.name)
        setattr(owner, patch.attr, replacement)
    APPLIED[patch.name] = (patch, original)
    logger.debug("vllm_specplug: patched %s (%s)", patch.name, patch.why)


def bind(original: Callable, names: Sequence[str]) -> Callable[..., dict[str, Any]]:
    """A function ``(*args, **kwargs) -> {name: value}`` that binds a call of
    ``original`` by its signature and returns the named arguments (a default
    where the caller left one out). ``names`` are checked against the
    signature here, once, when the patch is made (``Patch.args`` checks them
    before, at plugin load)."""
    sig = inspect.signature(original)
    gone = [n for n in names if n not in sig.parameters]
    if gone:
        raise PatchTargetMissing(
            f"vLLM {vllm_version()}'s {original.__qualname__} has no "
            f"parameter {', '.join(map(repr, gone))}; this vllm-specplug supports vLLM "
            f"{', '.join(SUPPORTED_VLLM_VERSIONS)}")
    names = tuple(names)

    def arguments(*args, **kwargs) -> dict[str, Any]:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return {n: bound.arguments[n] for n in names}

    return arguments


def applied_names() -> list[str]:
    return sorted(APPLIED)
