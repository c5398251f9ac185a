"""Typed plugin options with validation that names the key and the fix."""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence


class SpecPlugConfigError(ValueError):
    """A bad ``--speculative-config`` for one of our methods."""


def did_you_mean(name: Any, candidates: Iterable[str], cutoff: float = 0.8) -> str:
    """``" (did you mean 'x'?)"`` for the closest candidate (same name in
    another case or with dashes, a name containing it, or a close spelling),
    or ``""``."""
    if not isinstance(name, str):
        return ""
    names = list(candidates)
    key = name.lower().replace("-", "_")
    folded = {c.lower().replace("-", "_"): c for c in names}
    close = folded.get(key)
    if close is None and len(key) >= 4:
        close = next((c for f, c in folded.items() if f.endswith("_" + key)), None)
    if close is None:
        found = difflib.get_close_matches(name, names, n=1, cutoff=cutoff)
        close = found[0] if found else None
    return f" (did you mean {close!r}?)" if close is not None and close != name else ""


@dataclass(frozen=True)
class Option:
    name: str
    kind: type  # int, float, bool or str
    default: Any
    doc: str
    minimum: float | None = None
    maximum: float | None = None
    choices: Sequence[Any] | None = None
    check: Callable[[Any], str | None] | None = None  # returns an error text

    def describe(self) -> str:
        rng = ""
        if self.choices is not None:
            rng = f" one of {list(self.choices)}"
        elif self.minimum is not None or self.maximum is not None:
            lo = "-inf" if self.minimum is None else self.minimum
            hi = "inf" if self.maximum is None else self.maximum
            rng = f" in [{lo}, {hi}]"
        return f"{self.name} ({self.kind.__name__}{rng}, default {self.default!r}): {self.doc}"

    def coerce(self, method: str, value: Any) -> Any:
        where = f"speculative_config[{self.name!r}] for method {method!r}"
        if self.kind is bool:
            if not isinstance(value, bool):
                raise SpecPlugConfigError(f"{where} must be true or false, got {value!r}")
        elif self.kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise SpecPlugConfigError(f"{where} must be an integer, got {value!r}")
        elif self.kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SpecPlugConfigError(f"{where} must be a number, got {value!r}")
            value = float(value)
            if value != value:  # NaN
                raise SpecPlugConfigError(f"{where} must be a number, got NaN")
        elif self.kind is str:
            if not isinstance(value, str):
                raise SpecPlugConfigError(f"{where} must be a string, got {value!r}")
        if self.choices is not None and value not in self.choices:
            raise SpecPlugConfigError(
                f"{where} must be one of {list(self.choices)}, got {value!r}")
        if self.minimum is not None and value < self.minimum:
            raise SpecPlugConfigError(f"{where} must be >= {self.minimum}, got {value!r}")
        if self.maximum is not None and value > self.maximum:
            raise SpecPlugConfigError(f"{where} must be <= {self.maximum}, got {value!r}")
        if self.check is not None:
            msg = self.check(value)
            if msg:
                raise SpecPlugConfigError(f"{where}: {msg}")
        return value


def validate_options(method: str, options: Sequence[Option],
                     given: Mapping[str, Any]) -> dict[str, Any]:
    """Fill defaults and check every given key; unknown keys are errors."""
    known = {o.name: o for o in options}
    out = {o.name: o.default for o in options}
    for key, value in given.items():
        opt = known.get(key)
        if opt is None:
            hint = did_you_mean(key, [o.name for o in options] + BASE_KEYS)
            raise SpecPlugConfigError(
                f"unknown key {key!r} in speculative_config for method {method!r}{hint}; "
                f"valid keys: {valid_keys_text(options)}")
        out[key] = opt.coerce(method, value)
    return out


#: Keys every method takes (handled by ``config.translate``).
BASE_KEYS = ["method", "num_speculative_tokens", "acceptance"]


def valid_keys_text(options: Sequence[Option]) -> str:
    return ", ".join(BASE_KEYS + [o.name for o in options])
