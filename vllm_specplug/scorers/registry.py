"""Acceptance scorers by name: built-ins plus ``vllm_specplug.scorers`` entry points.

A third-party package registers a ``Scorer`` subclass with::

    [project.entry-points."vllm_specplug.scorers"]
    my_rule = "my_package.module:MyScorer"

(see ``examples/third_party_plugin``). Broken entry points are reported by
``load_errors`` and skipped, as for proposers.

In a speculative config the rule is chosen with ``"acceptance"``: a name
(``"typical"``) or an object with ``"name"`` and the scorer's options
(``{"name": "typical", "posterior_threshold": 0.05}``).
``parse_acceptance`` validates that and ``build_scorer`` instantiates it.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..options import SpecPlugConfigError, did_you_mean
from ..registry import PluginRegistry
from .base import Scorer

SCORER_GROUP = "vllm_specplug.scorers"
ACCEPTANCE_KEY = "acceptance"

BUILTIN_SCORERS: dict[str, str] = {
    "greedy": "vllm_specplug.scorers.greedy:GreedyScorer",
    "rejection": "vllm_specplug.scorers.rejection:RejectionScorer",
    "typical": "vllm_specplug.scorers.typical:TypicalScorer",
    "block": "vllm_specplug.scorers.block:BlockScorer",
}

SCORERS = PluginRegistry(SCORER_GROUP, "scorer", Scorer, BUILTIN_SCORERS)


#: ``scorer_names()``, ``get_scorer_class(name)``, ``load_errors()`` (name -> error).
scorer_names = SCORERS.names
get_scorer_class = SCORERS.get
load_errors = SCORERS.errors


def _where(key: str | None = None) -> str:
    return f"speculative_config[{ACCEPTANCE_KEY!r}]" + ("" if key is None else f"[{key!r}]")


def parse_acceptance(value: Any) -> dict[str, Any]:
    """``{"name": NAME, "options": {...}}`` (defaults filled) from an
    ``"acceptance"`` value; raises ``SpecPlugConfigError`` naming the bad key."""
    if isinstance(value, str):
        given: dict[str, Any] = {"name": value}
    elif isinstance(value, Mapping):
        given = dict(value)
    else:
        raise SpecPlugConfigError(
            f"{_where()} must be a scorer name or an object with \"name\" and the scorer's "
            f"options, got {value!r}; scorers: {', '.join(scorer_names())}")
    name = given.pop("name", None)
    if not isinstance(name, str) or name not in scorer_names():
        broken = load_errors().get(name) if isinstance(name, str) else None
        why = f" (a plugin registered {name!r} but it failed to load: {broken})" if broken else ""
        hint = "" if why else did_you_mean(name, scorer_names())
        raise SpecPlugConfigError(
            f"{_where('name')}: unknown scorer {name!r}{why}; scorers: "
            f"{', '.join(scorer_names())}{hint}")
    cls = get_scorer_class(name)
    known = {o.name: o for o in cls.options}
    options = {o.name: o.default for o in cls.options}
    for key, val in given.items():
        opt = known.get(key)
        if opt is None:
            valid = ", ".join(["name", *known]) if known else "name (it has no options)"
            hint = did_you_mean(key, known)
            raise SpecPlugConfigError(
                f"unknown key {key!r} in {_where()} for scorer {name!r}{hint}; "
                f"valid keys: {valid}")
        try:
            options[key] = opt.coerce(name, val)
        except SpecPlugConfigError as e:
            # Option.coerce words it for a method; say where the key really is.
            raise SpecPlugConfigError(str(e).replace(
                f"speculative_config[{key!r}] for method {name!r}",
                f"{_where(key)} for scorer {name!r}")) from None
    return {"name": name, "options": options}


def build_scorer(spec: Mapping[str, Any] | str) -> Scorer:
    """A scorer from ``parse_acceptance``'s result or anything it accepts
    (validated again either way)."""
    if isinstance(spec, Mapping) and set(spec) == {"name", "options"}:
        spec = {"name": spec["name"], **spec["options"]}
    parsed = parse_acceptance(spec)
    return get_scorer_class(parsed["name"])(**parsed["options"])
