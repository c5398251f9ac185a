"""Our ``SpeculatorConfig`` for vLLM 0.34: one class for every method name
the adapter registers (``mrv2.method_names``).

vLLM builds ``SpeculativeConfig`` with ``method="sam"`` moved to
``custom_method`` and calls ``configure`` then ``apply_options`` in its
``__post_init__``, in process 0, before the engine starts: a refused method,
a bad ``speculator_options`` key or value, or a key vLLM 0.34 cannot honour
raises there with a message naming what to change.
"""
from __future__ import annotations

from typing import Any, ClassVar

from vllm.v1.worker.gpu.spec_decode.speculator_config import SpeculatorConfig

from ...budget import BATCH_BUDGET_KEY, BATCH_DRAIN_KEY, DISABLE_BY_BATCH_SIZE_KEY, GOODPUT_KEY
from ...config import ISOLATION_KEY, translate
from ...options import SpecPlugConfigError
from ...registry import get_proposer_class
from ...scorers.registry import ACCEPTANCE_KEY
from . import CHAIN_METHODS, REFUSED, REFUSED_USE, SPECULATOR_CLASS_PATH

OPTIONS_KEY = "speculator_options"
#: Plugin keys of vLLM 0.32/0.33 that vLLM 0.34's runner cannot honour, and why.
UNSUPPORTED_KEYS = {
    ACCEPTANCE_KEY: "vLLM 0.34 verifies every draft with its own rejection sampler "
                    "(its rejection_sample_method setting chooses the rule)",
    BATCH_BUDGET_KEY: "every one of the step's num_speculative_tokens slots is verified on "
                      "vLLM 0.34 (shorter drafts are padded), so there is no per-request budget "
                      "to share out; vLLM's own num_speculative_tokens_per_batch_size sets K "
                      "by batch size",
    DISABLE_BY_BATCH_SIZE_KEY: "use vLLM's own num_speculative_tokens_per_batch_size",
    BATCH_DRAIN_KEY: "it steers the per-request batch budget, which vLLM 0.34 does not have "
                     "(every num_speculative_tokens slot is verified)",
    GOODPUT_KEY: "vLLM 0.34 verifies all num_speculative_tokens slots of a request (shorter "
                 "drafts are padded), so cutting drafts saves no verification; its "
                 "num_speculative_tokens_per_batch_size sets K by batch size",
    "tr_template": "vLLM 0.34 verifies one chain a request (no trees): Token Recycling "
                   "drafts its best path, so no tree template applies",
    "tr_topk": "as chains, Token Recycling keeps the target's best next token per token "
               "(its top-1) on vLLM 0.34",
    "tr_save_matrix": "Token Recycling's table lives on the device on vLLM 0.34 and is not "
                      "saved; tr_matrix still warm-starts it",
    "tr_tenants": "vLLM 0.34's speculators cannot tell tenants apart (isolation 'none' or "
                  "'request' only)",
    "sam_tr_merge": "vLLM 0.34 verifies one chain a request: sam_tr drafts sam's chain or "
                    "Token Recycling's, never their union (a tree)",
    "num_speculative_tokens": "give it at the top level of speculative_config",
    "method": "give it at the top level of speculative_config",
}


def plugin_config(spec: Any) -> dict[str, Any]:
    """The validated plugin configuration (as ``config.translate`` makes it)
    of a vLLM 0.34 ``SpeculativeConfig`` for one of our methods; raises
    ``SpecPlugConfigError`` naming the bad key or the refused method."""
    method = spec.custom_method
    if method in REFUSED:
        raise SpecPlugConfigError(
            f"speculative method {method!r} is not supported on vLLM 0.34: {REFUSED[method]}. "
            f"Use {REFUSED_USE} for {method!r}, or a method vLLM 0.34 runs here: "
            f"{', '.join(CHAIN_METHODS)}")
    if method not in CHAIN_METHODS:
        raise SpecPlugConfigError(
            f"vllm_specplug's speculator config was selected for method {method!r}, which "
            f"it does not serve; its methods on vLLM 0.34: {', '.join(CHAIN_METHODS)}")
    options = spec.speculator_options
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise SpecPlugConfigError(
            f"speculative_config[{OPTIONS_KEY!r}] must be a JSON object of "
            f"{method!r}'s keys, e.g. {{\"sam_min_match_len\": 2}}, got {options!r}")
    for key in options:
        name = str(key).replace("-", "_")
        if name in UNSUPPORTED_KEYS:
            raise SpecPlugConfigError(
                f"speculative_config[{OPTIONS_KEY!r}][{key!r}] is not supported on vLLM 0.34: "
                f"{UNSUPPORTED_KEYS[name]}; remove it")
    options = dict(options)
    isolation = options.get(ISOLATION_KEY)
    if isolation is None:
        # vLLM 0.34's speculators see neither cache_salt nor LoRA adapters nor
        # extra_args: no tenant can be told apart, so no memory is shared
        # unless the operator says every request may share it
        options[ISOLATION_KEY] = "request"
    elif isolation == "salt":
        raise SpecPlugConfigError(
            f"speculative_config[{OPTIONS_KEY!r}][{ISOLATION_KEY!r}] = 'salt' is not supported on "
            f"vLLM 0.34: its speculators see neither a request's cache_salt nor its LoRA "
            f"adapter (nor extra_args' specplug_share). Use 'none' (one global store shared by "
            f"every request) or 'request' (the default here: no cross-request memory); "
            f"docs/security.md")
    if spec.model is not None:
        raise SpecPlugConfigError(
            f"speculative_config['model'] is not used by method {method!r} (it drafts from "
            f"token history, no draft model); remove it")
    # the target's tokenizer checks what was built with one (sam_corpus files:
    # a corpus from another tokenizer drafts ids the target does not have)
    target = spec.target_model_config
    tokenizer = None if target is None else target.tokenizer
    try:
        _, plugin = translate({"method": method,
                               "num_speculative_tokens": spec.num_speculative_tokens,
                               **options}, tokenizer=tokenizer)
    except SpecPlugConfigError as e:
        raise SpecPlugConfigError(
            f"speculative_config[{OPTIONS_KEY!r}] (vLLM 0.34 takes method {method!r}'s keys "
            f"there): {e}") from e
    return plugin


#: The default K on vLLM 0.34, as vLLM's own ``suffix``: every one of a step's
#: K slots is verified (padding included), so a deep default costs throughput
#: at high concurrency (on 0.32 the plugin's budget cuts each request's draft).
DEFAULT_K = 8


def default_num_speculative_tokens(spec: Any) -> int:
    """K when the user gives none: the largest K of vLLM's
    ``num_speculative_tokens_per_batch_size`` schedule when one is given (vLLM
    caps each entry at K, so a smaller default would override the user's
    schedule), else ``min(DEFAULT_K, the method's own default)``."""
    schedule = spec.num_speculative_tokens_per_batch_size
    if schedule:
        return max(int(entry[2]) for entry in schedule)
    own = get_proposer_class(spec.custom_method).default_num_speculative_tokens
    # "auto" (tree methods on 0.32: sized each step) has no meaning for one K
    return DEFAULT_K if own == "auto" else min(DEFAULT_K, int(own))


class SpecPlugSpeculatorConfig(SpeculatorConfig):
    """vllm-specplug's methods on vLLM 0.34's Model Runner V2."""

    base_method: ClassVar[str | None] = None
    speculator_class: ClassVar[str | None] = SPECULATOR_CLASS_PATH
    supported_options: ClassVar[frozenset[str]] = frozenset({OPTIONS_KEY})
    # propose reads a few newest tokens of each row a step (and a request's
    # whole history once): vLLM's UVA-backed history serves that; a dense
    # [max_num_seqs, max_model_len] device copy would cost memory for nothing
    prefer_dense_token_history: ClassVar[bool] = False
    # confidences (adaptive verification) come from sam's learned acceptance
    adaptive_verification_uses_draft_logits: ClassVar[bool] = False

    @classmethod
    def configure(cls, spec: Any) -> None:
        method = spec.custom_method
        if method in REFUSED:
            plugin_config(spec)   # raises, with the reason
        super().configure(spec)   # no draft model: the target's configs
        if spec.num_speculative_tokens is None:
            spec.num_speculative_tokens = default_num_speculative_tokens(spec)

    @classmethod
    def apply_options(cls, spec: Any) -> None:
        plugin_config(spec)

    def hash_factors(self) -> list[Any]:
        options = self.spec_config.speculator_options or {}
        return [self.spec_config.custom_method, sorted(options.items(), key=str)]
