"""Our ``--speculative-config`` methods, translated onto vLLM's own config.

How a plugin method is wired (the one place this is decided)
------------------------------------------------------------
vLLM's ``SpeculativeConfig`` accepts only its own method names and keys. In
process 0, the adapter wraps ``EngineArgs.create_speculative_config``: a
dict whose ``method`` is one of ours is validated here and rewritten to

    {"method": "custom_class", "model": DRAFTER_CLASS_PATH,
     "num_speculative_tokens": K}

while the method name and its validated plugin keys are stored in
``VllmConfig.additional_config["specplug"]`` (which vLLM ships to every
worker and hashes into its compile cache key). In the workers vLLM builds
``DRAFTER_CLASS_PATH``, which reads that entry and instantiates the proposer.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from .malloc_trim import interval_from_env
from .options import SpecPlugConfigError, did_you_mean, valid_keys_text, validate_options
from . import __version__
from .budget import pop_batch_options
from .registry import get_proposer_class, load_errors, proposer_names
from .scorers.registry import ACCEPTANCE_KEY, parse_acceptance

ADDITIONAL_CONFIG_KEY = "specplug"
DRAFTER_CLASS_PATH = "vllm_specplug.vllm_adapter.v1.drafter.SpecPlugDrafter"
DEFAULT_NUM_SPECULATIVE_TOKENS = 8
# vLLM V1's rejection sampler asserts max_spec_len <= 128.
MAX_NUM_SPECULATIVE_TOKENS = 128
#: Which requests share cross-request memory (docs/security.md): "salt" (those
#: with the same cache_salt and LoRA adapter), "none" (all: one shared
#: memory), "request" (none: no cross-request memory at all).
ISOLATION_KEY = "isolation"
ISOLATION_MODES = ("salt", "none", "request")


def pop_isolation(spec: dict) -> str:
    """Take and validate ``isolation`` from a speculative config."""
    mode = spec.pop(ISOLATION_KEY, "salt")
    if mode not in ISOLATION_MODES:
        raise SpecPlugConfigError(
            f"speculative_config[{ISOLATION_KEY!r}] must be one of "
            f"{', '.join(map(repr, ISOLATION_MODES))}, got {mode!r}: \"salt\" (default) keeps "
            f"requests with different cache_salt or LoRA adapters from drafting from each "
            f"other's text, \"none\" shares one memory among all requests, \"request\" "
            f"keeps no cross-request memory (docs/security.md)")
    return mode


def is_plugin_method(method: Any) -> bool:
    return isinstance(method, str) and method in proposer_names()


def unknown_method_error(method: Any, vllm_methods: Iterable[str] = ()) -> SpecPlugConfigError:
    """``vllm_methods`` empty: the message lists ours only (no vLLM import here)."""
    vllm_methods = sorted(vllm_methods)
    errors = load_errors() if isinstance(method, str) else {}
    broken = ""
    if method in errors:
        broken = f" (a plugin registered {method!r} but it failed to load: {errors[method]})"
    hint = "" if broken else did_you_mean(method, proposer_names() + vllm_methods, cutoff=0.6)
    theirs = f"; vLLM's own methods: {', '.join(vllm_methods)}" if vllm_methods else ""
    return SpecPlugConfigError(
        f"unknown speculative method {method!r}{broken}{hint}. vllm-specplug methods: "
        f"{', '.join(proposer_names())}{theirs}")


def normalize_keys(spec: Mapping[str, Any]) -> dict[str, Any]:
    """``-`` to ``_`` in keys, as vLLM does; two spellings of one key are an error."""
    out: dict[str, Any] = {}
    for k, v in spec.items():
        key = str(k).replace("-", "_")
        if key in out:
            raise SpecPlugConfigError(
                f"speculative_config gives {key!r} twice (as {k!r} and with underscores)")
        out[key] = v
    return out


def translate(spec: Mapping[str, Any], tokenizer: str | None = None
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Validate a plugin speculative config.

    Returns ``(vllm_speculative_config_kwargs, plugin_config)``. Raises
    ``SpecPlugConfigError`` naming the bad key and listing the valid ones.
    ``tokenizer`` (the target model's tokenizer folder or name), when given,
    also checks the options against it (``Proposer.check_model``).
    """
    interval_from_env()   # VLLM_SPECPLUG_MALLOC_TRIM_S: a bad value fails before the engine
    if not isinstance(spec, Mapping):
        raise SpecPlugConfigError(
            f"speculative_config must be a JSON object such as {{\"method\": \"sam\", "
            f"\"num_speculative_tokens\": 8}}, got {spec!r}")
    spec = normalize_keys(spec)
    if "method" not in spec:
        raise SpecPlugConfigError(
            f"speculative_config has no 'method'; give one of {', '.join(proposer_names())}")
    method = spec.pop("method")
    if not is_plugin_method(method):
        raise unknown_method_error(method)
    cls = get_proposer_class(method)
    k = spec.pop("num_speculative_tokens", None)
    if k is None:
        k = cls.default_num_speculative_tokens
    auto = k == "auto"
    if auto:
        if not cls.auto_budget_max:
            raise SpecPlugConfigError(
                f"speculative_config['num_speculative_tokens'] = \"auto\" is not supported by "
                f"method {method!r}; give an integer in [1, {MAX_NUM_SPECULATIVE_TOKENS}]")
        k = cls.auto_budget_max
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
        also = ' or "auto"' if cls.auto_budget_max else ""
        raise SpecPlugConfigError(
            f"speculative_config['num_speculative_tokens'] for method {method!r} must be an "
            f"integer in [1, {MAX_NUM_SPECULATIVE_TOKENS}]{also}, got {k!r}")
    # "model" is vLLM's key for a draft model; a method that drafts with a
    # model of its own (``takes_model_path``, e.g. eagle2's head folder)
    # keeps it as its option ``options["model"]``
    taken_keys = ("custom_class",) if cls.takes_model_path \
        else ("model", "custom_class")
    for taken in taken_keys:
        if taken in spec:
            raise SpecPlugConfigError(
                f"speculative_config[{taken!r}] is not used by method {method!r}; remove it. "
                f"Valid keys: {valid_keys_text(cls.options)}")
    acceptance = spec.pop(ACCEPTANCE_KEY, None)
    batch_options = pop_batch_options(spec)
    isolation = pop_isolation(spec)
    options = validate_options(method, cls.options, spec)
    cls.check_options(k, options)
    if tokenizer is not None:
        cls.check_model(options, tokenizer)
    vllm_kwargs = {"method": "custom_class", "model": DRAFTER_CLASS_PATH,
                   "num_speculative_tokens": k}
    plugin = {"method": method, "num_speculative_tokens": k, "options": options,
              "version": __version__, ISOLATION_KEY: isolation, **batch_options}
    if acceptance is not None:
        plugin["acceptance"] = parse_acceptance(acceptance)
        if plugin["acceptance"]["name"] == "greedy":
            raise SpecPlugConfigError(
                "speculative_config['acceptance'] = 'greedy' is not needed: requests at "
                "temperature 0 are always verified greedily; for temperature > 0 choose "
                "'rejection' (the default, lossless), 'block' (lossless, accepts more on "
                "chains) or 'typical' (not lossless)")
    if cls.auto_budget_max:
        plugin["auto_budget"] = auto
    return vllm_kwargs, plugin


def build_proposer(plugin: Mapping[str, Any]):
    """Instantiate the proposer described by a ``translate`` plugin config."""
    cls = get_proposer_class(plugin["method"])
    extra = {"auto_budget": plugin["auto_budget"]} if "auto_budget" in plugin else {}
    return cls(plugin["num_speculative_tokens"], **plugin["options"], **extra)
