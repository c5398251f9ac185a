"""Every request option of vLLM 0.32 and what the tree path does with it.

A request whose draft is a tree is verified by our own acceptance
(``tree_runtime.accept_trees``) on logits copied before vLLM's sampler runs,
so each option that changes what the sampler would pick must be either
reproduced there exactly, or send the request to vLLM's chain verification
of the flattened draft (lossless: vLLM checks it as the chain it is), or be
refused by vLLM whenever speculation is on. ``SAMPLING_OPTIONS`` says which,
for every field of ``vllm.SamplingParams`` and of ``StructuredOutputsParams``;
``tests/test_request_options.py`` fails when an installed vLLM has a field this
table does not list, and the engine tests named here check each entry.

Kinds:

* ``tree``: handled on the tree path, output as plain decoding's;
* ``fallback``: the request's draft is verified as a chain by vLLM (the
  drafter's stats count it under ``fallback:<reason>``);
* ``refused``: vLLM rejects the request (or the engine) when speculation is on;
* ``outside``: not used by verification at all (engine, scheduler, detokenizer
  or output processing work the same on every path).
"""
from __future__ import annotations

from dataclasses import dataclass

TREE, FALLBACK, REFUSED, OUTSIDE = "tree", "fallback", "refused", "outside"


@dataclass(frozen=True)
class Option:
    kind: str
    how: str
    test: str = ""   # the test that checks it ("" for ``outside`` and internal fields)


_ENGINE_TESTS = "tests/test_engine_tree_options.py"

SAMPLING_OPTIONS: dict[str, Option] = {
    # ---------------------------------------------------------- sampling
    "temperature": Option(TREE, "target distributions at this temperature; greedy when "
                          "< 1e-5", "tests/test_engine_exact_distribution.py"),
    "top_p": Option(TREE, "nucleus cut of the target distribution per node",
                    "tests/test_engine_exact_distribution.py"),
    "top_k": Option(TREE, "top-k cut of the target distribution per node",
                    "tests/test_engine_tree.py::test_tree_sampling_matches_plain_sampling"),
    "seed": Option(TREE, "plain decoding's text with that seed, for every method, alone, "
                   "after other traffic or in a batch: trees and chains (vLLM's chain path "
                   "included) are verified by replaying the request generator's draws "
                   "position by position (vllm_adapter/v1/seeded.py), whatever the "
                   "configured acceptance rule; not replayed (vLLM's own verification: "
                   "lossless, but the text can vary with traffic) when the request also "
                   "sets thinking_token_budget or logprob_token_ids, or asks for logprobs "
                   "under --logprobs-mode processed_*",
                   "tests/test_engine_seed.py"),
    "min_p": Option(REFUSED, "vLLM: 'min_p and logit_bias ... not yet supported with "
                    "speculative decoding'", "tests/test_bad_inputs.py"),
    "logit_bias": Option(REFUSED, "as min_p", "tests/test_bad_inputs.py"),
    "presence_penalty": Option(FALLBACK, "penalties", _ENGINE_TESTS),
    "frequency_penalty": Option(FALLBACK, "penalties", _ENGINE_TESTS),
    "repetition_penalty": Option(FALLBACK, "penalties", _ENGINE_TESTS),
    "bad_words": Option(FALLBACK, "bad words", _ENGINE_TESTS),
    "_bad_words_token_ids": Option(FALLBACK, "bad words (tokenized bad_words)", _ENGINE_TESTS),
    "allowed_token_ids": Option(FALLBACK, "allowed token ids", _ENGINE_TESTS),
    "structured_outputs": Option(FALLBACK, "structured output (vLLM's grammar bitmask "
                                 "follows the flattened draft)", _ENGINE_TESTS),
    "thinking_token_budget": Option(FALLBACK, "thinking token budget (vLLM forces the "
                                    "end-of-thinking tokens along the flattened draft); "
                                    "vLLM refuses it without a reasoning parser",
                                    "tests/test_request_options.py::test_fallback_reason"),
    "min_tokens": Option(TREE, "stop tokens masked in every node row whose position is "
                         "before min_tokens, as plain decoding masks them", _ENGINE_TESTS),
    "_all_stop_token_ids": Option(TREE, "the stop tokens min_tokens masks", _ENGINE_TESTS),
    "_eos_token_id": Option(TREE, "part of the stop tokens min_tokens masks", _ENGINE_TESTS),
    "ignore_eos": Option(TREE, "EOS leaves the stop tokens (scheduler) and the min_tokens "
                         "mask", _ENGINE_TESTS),
    "logprobs": Option(FALLBACK, "logprobs", "tests/test_bad_inputs.py"),
    "logprob_token_ids": Option(FALLBACK, "logprobs", _ENGINE_TESTS),
    "flat_logprobs": Option(OUTSIDE, "output format of logprobs (requests with logprobs "
                            "fall back)"),
    "watermarking": Option(REFUSED, "our methods refuse an engine with a watermark "
                           "configuration (vLLM applies watermarks only in its V2 runner; "
                           "our methods run on V1)", "tests/test_request_options.py"),
    "_watermarking_skipped": Option(OUTSIDE, "bookkeeping of watermarking"),
    "trace_decode_token_ids": Option(REFUSED, "vLLM: 'not supported with speculative "
                                     "decoding'"),
    # ---------------------------------------------------------- length and stopping
    "max_tokens": Option(TREE, "the scheduler truncates the accepted path at max_tokens as "
                         "it truncates chains", _ENGINE_TESTS),
    "stop": Option(OUTSIDE, "stop strings: the detokenizer, after verification",
                   _ENGINE_TESTS),
    "stop_token_ids": Option(TREE, "scheduler stop check per accepted token; masked "
                             "before min_tokens", _ENGINE_TESTS),
    "include_stop_str_in_output": Option(OUTSIDE, "detokenizer"),
    "repetition_detection": Option(OUTSIDE, "scheduler stop check per accepted token"),
    # ---------------------------------------------------------- outside verification
    "n": Option(OUTSIDE, "n independent requests", "tests/test_bad_inputs.py"),
    "prompt_logprobs": Option(OUTSIDE, "computed at prefill (no drafts)",
                              "tests/test_bad_inputs.py"),
    "prompt_logprob_token_ids": Option(REFUSED, "vLLM: needs the V2 model runner; our "
                                       "methods run on V1"),
    "prompt_logprob_start": Option(OUTSIDE, "prefill"),
    "detokenize": Option(OUTSIDE, "detokenizer"),
    "skip_special_tokens": Option(OUTSIDE, "detokenizer"),
    "spaces_between_special_tokens": Option(OUTSIDE, "detokenizer"),
    "output_kind": Option(OUTSIDE, "output processing"),
    "stream_interval": Option(OUTSIDE, "output processing"),
    "skip_clone": Option(OUTSIDE, "engine input processing"),
    "output_text_buffer_length": Option(OUTSIDE, "detokenizer"),
    "extra_args": Option(OUTSIDE, "not used by verification; its keys specplug_share "
                         "(false or 0: the request neither reads nor feeds cross-request "
                         "memory, docs/security.md), specplug_draft (false or 0: no drafts) "
                         "and specplug_max_draft (at most n draft tokens a step) are read by "
                         "the drafter, other values and specplug keys are refused",
                         "tests/test_isolation.py"),
    "skip_reading_prefix_cache": Option(OUTSIDE, "prefill (prefix cache)"),
    "routed_experts_prompt_start": Option(OUTSIDE, "MoE routing capture of the prompt"),
}

#: Fields of ``StructuredOutputsParams``: any of them makes a structured request.
STRUCTURED_OUTPUT_FIELDS = ("json", "regex", "choice", "grammar", "json_object",
                            "disable_any_whitespace", "disable_additional_properties",
                            "whitespace_pattern", "structural_tag", "_backend",
                            "_backend_was_auto")


def sampling_params_fields() -> tuple[str, ...]:
    """The installed vLLM's ``SamplingParams`` fields (a msgspec Struct)."""
    from vllm import SamplingParams

    return tuple(SamplingParams.__struct_fields__)


def structured_output_fields() -> tuple[str, ...]:
    from vllm.sampling_params import StructuredOutputsParams

    return tuple(StructuredOutputsParams.__dataclass_fields__)


def missing_options() -> list[str]:
    """Fields of the installed vLLM this table does not account for."""
    missing = [f for f in sampling_params_fields() if f not in SAMPLING_OPTIONS]
    missing += [f"structured_outputs.{f}" for f in structured_output_fields()
                if f not in STRUCTURED_OUTPUT_FIELDS]
    return missing


def fallback_reason(params, row: int, sampling_metadata) -> str | None:
    """Why a request (its ``SamplingParams`` and batch ``row``) must be verified
    as a chain by vLLM instead of as a tree; None: the tree path serves it."""
    if params.structured_outputs is not None:
        return "structured output"
    if params.thinking_token_budget is not None:
        return "thinking token budget"
    if (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0):
        return "penalties"
    if params.logprobs is not None or params.logprob_token_ids:
        return "logprobs"
    if params.bad_words or row in sampling_metadata.bad_words_token_ids:
        return "bad words"
    if params.allowed_token_ids is not None:
        return "allowed token ids"
    return None


def stop_tokens_to_mask(params, num_output_tokens: int) -> tuple[int, list[int]]:
    """min_tokens on the tree path: (how many leading depth levels, stop ids).

    The row of the node at depth d (the root is depth 0) predicts output token
    number ``num_output_tokens + d + 1``; plain decoding masks the stop tokens
    there while ``num_output_tokens + d < min_tokens`` (vLLM's
    ``MinTokensLogitsProcessor``), so rows of depth < the first value are
    masked."""
    levels = max(int(params.min_tokens or 0) - num_output_tokens, 0)
    if not levels:
        return 0, []
    return levels, sorted(params.all_stop_token_ids)


def check_watermark(watermark_config) -> None:
    """Refuse, before the engine starts, an engine watermark with our methods
    (``EngineArgs.watermark_config``)."""
    if watermark_config is not None:
        raise ValueError(
            "vllm_specplug methods run on vLLM's V1 model runner, which does not apply "
            "watermarks; remove --watermark-config or the speculative config")


def markdown_table() -> str:
    """``SAMPLING_OPTIONS`` as the Markdown table of docs/request_options.md."""
    rows = ["| option | tree path | how | checked by |", "|---|---|---|---|"]
    for name, opt in SAMPLING_OPTIONS.items():
        test = f"`{opt.test}`" if opt.test else ""
        rows.append(f"| `{name}` | {opt.kind} | {opt.how} | {test} |")
    return "\n".join(rows) + "\n"


def counts() -> dict[str, int]:
    out: dict[str, int] = {}
    for opt in SAMPLING_OPTIONS.values():
        out[opt.kind] = out.get(opt.kind, 0) + 1
    return out
