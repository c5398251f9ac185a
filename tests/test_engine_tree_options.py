"""Request options on the tree path (vllm_adapter/v1/request_options.py): every
option a user can set gives plain decoding's output with a tree method, either
handled on the tree path (min_tokens, stop tokens, stop strings, ignore_eos,
max_tokens) or by falling back to vLLM's chain verification (structured output,
penalties, bad words, allowed tokens, logprob token ids, thinking budget), and
the fallback is seen to happen in the drafter's stats.

Tree method: token_recycling with 24-node trees (the engine of
test_engine_tree_runtime.py, shared), and sam_tr for structured output.
"""
from __future__ import annotations

import json
import re

import pytest

from helpers import pick

pytestmark = pytest.mark.engine

TR_PAPER = {"method": "token_recycling", "num_speculative_tokens": 24,
            "tr_template": "paper", "batch_budget": "off"}
SAM_TR = {"method": "sam_tr", "num_speculative_tokens": 8, "batch_budget": "off"}

# Prompts SmolLM2 answers in a few tokens: min_tokens then decides the length.
SHORT = ["Answer with one word: what colour is grass?",
         "What is the capital of France? One word.",
         "Complete: The sun rises in the"]


def _stats(worker):
    return worker.model_runner.drafter.stats()


def _tree_stats(llm) -> dict:
    return llm.llm_engine.collective_rpc(_stats)[0]["tree"]


def _delta(after: dict, before: dict, key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def _chat(llm, prompts, params):
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    return [list(o.outputs[0].token_ids) for o in llm.chat(msgs, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def mixed_prompts(spec_bench_prompts):
    return [r["prompt"] for r in pick(spec_bench_prompts, ["writing", "coding", "rag"], 1)]


def test_min_tokens_on_trees_is_plain_decoding(get_llm):
    """Greedy: the stop tokens are masked in every tree row before min_tokens
    (vLLM masks them only in the sampler, after our rows are copied); the
    answers end in a few tokens without min_tokens, so EOS is the target's
    first choice inside the window."""
    from vllm import SamplingParams

    plain, tr = get_llm("plain"), get_llm("tr_paper", TR_PAPER)
    free = _chat(plain, SHORT, SamplingParams(temperature=0, max_tokens=40))
    assert all(len(f) < 12 for f in free), free
    sp = SamplingParams(temperature=0, max_tokens=40, min_tokens=30)
    ref = _chat(plain, SHORT, sp)
    before = _tree_stats(tr)
    got = _chat(tr, SHORT, sp)
    after = _tree_stats(tr)
    assert got == ref
    assert all(len(r) >= 30 for r in ref)
    assert _delta(after, before, "tree_steps") > 0, after


def test_min_tokens_sampled_never_stops_early(get_llm):
    from vllm import SamplingParams

    tr = get_llm("tr_paper", TR_PAPER)
    eos = tr.get_tokenizer().eos_token_id
    sp = SamplingParams(temperature=0.8, max_tokens=24, min_tokens=16, n=4)
    msgs = [[{"role": "user", "content": p}] for p in SHORT]
    for out in tr.chat(msgs, sp, use_tqdm=False):
        for c in out.outputs:
            assert len(c.token_ids) >= 16, c
            assert eos not in list(c.token_ids)[:16], c


def test_stopping_options_on_trees_are_plain_decoding(get_llm, mixed_prompts):
    """stop token ids, stop strings, ignore_eos and max_tokens, one request
    each in one batch (greedy)."""
    from vllm import SamplingParams

    plain, tr = get_llm("plain"), get_llm("tr_paper", TR_PAPER)
    first = _chat(plain, mixed_prompts[:1], SamplingParams(temperature=0, max_tokens=32))[0]
    prompts = mixed_prompts + SHORT[:1] + mixed_prompts[:1]
    params = [SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[first[20]]),
              SamplingParams(temperature=0, max_tokens=48, stop=[" the", "\n\n"]),
              SamplingParams(temperature=0, max_tokens=7),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=48, stop=["e"],
                             include_stop_str_in_output=True)]
    ref = _chat(plain, prompts, params)
    before = _tree_stats(tr)
    got = _chat(tr, prompts, params)
    after = _tree_stats(tr)
    assert got == ref
    assert len(ref[0]) <= 21 and len(ref[2]) == 7 and len(ref[3]) == 24, ref
    assert _delta(after, before, "tree_steps") > 0, after


@pytest.mark.parametrize("option, reason", [
    ({"repetition_penalty": 1.2}, "penalties"),
    ({"presence_penalty": 0.5, "frequency_penalty": 0.3}, "penalties"),
    ({"bad_words": [" the"]}, "bad words"),
    ({"logprob_token_ids": [13, 28]}, "logprobs"),
])
def test_options_verified_as_chains_fall_back_and_match_plain(get_llm, mixed_prompts,
                                                              option, reason):
    """Each falls back for its own request only: the other requests of the
    batch are still verified as trees."""
    from vllm import SamplingParams

    plain, tr = get_llm("plain"), get_llm("tr_paper", TR_PAPER)
    params = [SamplingParams(temperature=0, max_tokens=40, **option),
              SamplingParams(temperature=0, max_tokens=40)]
    prompts = mixed_prompts[:2]
    ref = _chat(plain, prompts, params)
    before = _tree_stats(tr)
    got = _chat(tr, prompts, params)
    after = _tree_stats(tr)
    assert got == ref
    assert _delta(after, before, "fallback:" + reason) > 0, after
    assert _delta(after, before, "tree_steps") > 0, after


def test_thinking_token_budget_needs_a_reasoning_parser(get_llm):
    """vLLM refuses thinking_token_budget without a reasoning parser, which the
    embedded model has no tokens for; with one, the request falls back
    (tests/test_request_options.py::test_fallback_reason)."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="reasoning"):
        _chat(get_llm("tr_paper", TR_PAPER), SHORT[:1],
              SamplingParams(temperature=0, max_tokens=8, thinking_token_budget=4))


def test_allowed_token_ids_fall_back_and_match_plain(get_llm):
    from vllm import SamplingParams

    plain, tr = get_llm("plain"), get_llm("tr_paper", TR_PAPER)
    tok = plain.get_tokenizer()
    allowed = sorted({i for w in (" the", " cat", " sat", " on", " mat", ".", " a")
                      for i in tok.encode(w, add_special_tokens=False)} | {tok.eos_token_id})
    sp = SamplingParams(temperature=0, max_tokens=24, allowed_token_ids=allowed)
    prompts = ["Repeat: the cat sat on the mat. the cat sat on the mat."]
    ref = _chat(plain, prompts, sp)
    before = _tree_stats(tr)
    got = _chat(tr, prompts, sp)
    after = _tree_stats(tr)
    assert got == ref and set(ref[0]) <= set(allowed)
    assert _delta(after, before, "fallback:allowed token ids") > 0, after


# ------------------------------------------------------------ structured output

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"(yes|no), [a-z ]{1,40}\."
CHOICES = ["apple", "car"]
STRUCTURED = [
    ("Describe a fictional person as JSON with a name and an age.", {"json": PERSON}),
    ("Is the sky blue? Answer yes or no, then a short reason.", {"regex": REGEX}),
    ("Which one is a fruit: apple or car?", {"choice": CHOICES}),
]


def _valid(kind: str, text: str) -> bool:
    import jsonschema

    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), PERSON)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICES


def _structured_batch(mixed_prompts, temperature: float, copies: int = 1):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    prompts, params, kinds = [], [], []
    for _ in range(copies):
        for prompt, so in STRUCTURED:
            prompts.append(prompt)
            params.append(SamplingParams(temperature=temperature, max_tokens=64,
                                         structured_outputs=StructuredOutputsParams(**so)))
            kinds.append(next(iter(so)))
    for p in mixed_prompts:  # unstructured requests in the same batch
        prompts.append(p)
        params.append(SamplingParams(temperature=temperature, max_tokens=40))
        kinds.append(None)
    return prompts, params, kinds


@pytest.mark.parametrize("name, spec", [
    ("tr_paper", TR_PAPER),
    pytest.param("sam_tr_structured", SAM_TR, marks=pytest.mark.slow),
    pytest.param("eagle2_trained", "eagle2", marks=pytest.mark.slow),
])
def test_structured_output_with_trees(get_llm, mixed_prompts, request, name, spec):
    """A batch mixing JSON-schema, regex and choice requests with unstructured
    ones: greedy output token-identical to plain decoding, every structured
    output valid at temperature 0 and 0.8, and the structured requests'
    drafts verified by vLLM (fallback) while the others' are trees."""
    if spec == "eagle2":  # the trained head of tests/test_engine_eagle.py, same engine
        spec = {"method": "eagle2", "model": request.getfixturevalue("eagle_trained_head"),
                "num_speculative_tokens": 8, "depth": 4, "topk": 4, "batch_budget": "off"}
    llm, plain = get_llm(name, spec), get_llm("plain")
    prompts, params, kinds = _structured_batch(mixed_prompts, 0.0)
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    ref = plain.chat(msgs, params, use_tqdm=False)
    before = _tree_stats(llm)
    got = llm.chat(msgs, params, use_tqdm=False)
    after = _tree_stats(llm)
    assert [list(o.outputs[0].token_ids) for o in got] == \
        [list(o.outputs[0].token_ids) for o in ref]
    for kind, o in zip(kinds, got):
        if kind:
            assert _valid(kind, o.outputs[0].text), (kind, o.outputs[0].text)
    assert _delta(after, before, "fallback:structured output") > 0, after
    assert _delta(after, before, "tree_steps") > 0, after

    prompts, params, kinds = _structured_batch(mixed_prompts, 0.8, copies=4)
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    for kind, o in zip(kinds, llm.chat(msgs, params, use_tqdm=False)):
        if kind:
            assert _valid(kind, o.outputs[0].text), (kind, o.outputs[0].text)
