"""Every request option of the installed vLLM is accounted for on the tree
path (vllm_adapter/v1/request_options.py), and the per-request decisions
(fallback reason, min_tokens masking) are right. No engine."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_specplug.vllm_adapter.v1 import request_options as ro

ROOT = Path(__file__).resolve().parents[1]


def test_every_sampling_params_field_is_in_the_table():
    """A vLLM that adds a request option fails here until the option is
    classified (handled on the tree path, fallback, refused or outside)."""
    assert ro.missing_options() == []


def test_the_table_lists_no_field_vllm_does_not_have():
    stale = set(ro.SAMPLING_OPTIONS) - set(ro.sampling_params_fields())
    stale |= set(ro.STRUCTURED_OUTPUT_FIELDS) - set(ro.structured_output_fields())
    assert not stale


def test_every_handled_or_fallback_option_names_an_existing_test():
    for name, opt in ro.SAMPLING_OPTIONS.items():
        assert opt.kind in (ro.TREE, ro.FALLBACK, ro.REFUSED, ro.OUTSIDE), name
        if opt.kind not in (ro.TREE, ro.FALLBACK):
            continue
        assert opt.test, name
        path, _, func = opt.test.partition("::")
        text = (ROOT / path).read_text()
        if func:
            assert re.search(rf"def {func}\(", text), opt.test


def _params(**kw):
    from vllm import SamplingParams

    return SamplingParams(**kw)


class _Meta:
    def __init__(self, bad_rows=()):
        self.bad_words_token_ids = {r: [[1]] for r in bad_rows}


@pytest.mark.parametrize("kw, why", [
    ({}, None),
    ({"temperature": 0.8, "top_p": 0.9, "top_k": 5, "seed": 3, "min_tokens": 4,
      "stop": ["x"], "stop_token_ids": [3], "ignore_eos": True, "max_tokens": 9}, None),
    ({"presence_penalty": 0.5}, "penalties"),
    ({"frequency_penalty": -0.1}, "penalties"),
    ({"repetition_penalty": 1.1}, "penalties"),
    ({"logprobs": 0}, "logprobs"),
    ({"logprob_token_ids": [5]}, "logprobs"),
    ({"allowed_token_ids": [1, 2]}, "allowed token ids"),
    ({"thinking_token_budget": 10}, "thinking token budget"),
])
def test_fallback_reason(kw, why):
    assert ro.fallback_reason(_params(**kw), 0, _Meta()) == why


def test_structured_output_falls_back():
    from vllm.sampling_params import StructuredOutputsParams

    for so in ({"json": {"type": "object"}}, {"regex": "a+"}, {"choice": ["a", "b"]},
               {"grammar": 'root ::= "a"'}, {"json_object": True}):
        p = _params(structured_outputs=StructuredOutputsParams(**so))
        assert ro.fallback_reason(p, 0, _Meta()) == "structured output", so


def test_bad_words_fall_back_for_their_row_only():
    assert ro.fallback_reason(_params(), 2, _Meta(bad_rows=[2])) == "bad words"
    assert ro.fallback_reason(_params(), 1, _Meta(bad_rows=[2])) is None


def test_watermark_engine_is_refused():
    ro.check_watermark(None)
    with pytest.raises(ValueError, match="watermark"):
        ro.check_watermark({"type": "gumbel"})


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_min_tokens_masks_exactly_the_rows_plain_decoding_masks(data):
    """Brute force: the row of a node predicts output token number
    ``done + (its path length) + 1``; plain decoding masks the stop tokens
    there iff the tokens already generated on that path are < min_tokens."""
    from vllm_specplug.vllm_adapter.v1.tree_runtime import TreeRequest, mask_stop_tokens

    n = data.draw(st.integers(1, 12))
    parents = np.array([data.draw(st.integers(-1, i - 1)) for i in range(n)], dtype=np.int64)
    done = data.draw(st.integers(0, 10))
    min_tokens = data.draw(st.integers(0, 16))
    stop = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=3, unique=True))
    params = _params(min_tokens=min_tokens, stop_token_ids=stop, max_tokens=32)
    levels, ids = ro.stop_tokens_to_mask(params, done)
    tr = TreeRequest("r", 0, 0, 0, parents, np.zeros(n, dtype=np.int64),
                     torch.zeros(1), torch.zeros(1), stop_levels=levels, stop_ids=ids)
    rows = torch.zeros(n + 1, 10)
    if levels:
        mask_stop_tokens(rows, tr)
    for r in range(n + 1):
        length, node = 0, r - 1
        while node >= 0:
            length, node = length + 1, parents[node]
        want = done + length < min_tokens
        for t in range(10):
            assert (rows[r, t] == float("-inf")) == (want and t in stop), (r, t)


def test_docs_page_shows_the_table():
    text = (ROOT / "docs" / "request_options.md").read_text()
    assert ro.markdown_table() in text


def _reference_probs(logits, temperature: float, top_k: int, top_p: float):
    """Plain sampling's distribution by its definition, in float64 (independent
    of vLLM's code): scale by 1/temperature; top-k keeps every token at least
    as likely as the k-th (ties at the cut kept); top-p then drops the least
    likely tokens (ascending by logit, ties by index) while their cumulative
    mass is at most 1 - top_p, never the most likely; renormalise. Also the
    distance of the top-p cut from a tie of cumulative mass and 1 - top_p."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    keep = np.ones(x.size, dtype=bool)
    if 0 < top_k < x.size:
        keep = x >= np.sort(x)[-top_k]
    margin = np.inf
    if top_p < 1.0:
        w = np.where(keep, np.exp(x - x.max()), 0.0)
        order = [int(i) for i in np.lexsort((np.arange(x.size), x)) if keep[i]]
        cum = np.cumsum(w[order]) / w.sum()
        margin = float(np.min(np.abs(cum - (1.0 - top_p))))
        for i, c in zip(order[:-1], cum[:-1]):
            if c > 1.0 - top_p:
                break
            keep[i] = False
    q = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    return q / q.sum(), margin


@settings(max_examples=500, deadline=None)
@given(data=st.data())
def test_tree_target_distribution_is_plain_samplings(data):
    """The tree path's processed target distribution (temperature, top-k,
    top-p; logits with exact ties drawn often) equals the float64 reference
    above; cases whose top-p cut is within float32 rounding of a tie are
    skipped (there vLLM's float32 arithmetic decides, and the code calls
    vLLM's own filter)."""
    from hypothesis import assume

    from vllm_specplug.vllm_adapter.v1.tree_runtime import _processed_probs

    v = data.draw(st.integers(2, 12))
    vals = data.draw(st.lists(st.sampled_from([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0]),
                              min_size=v, max_size=v))
    temp = data.draw(st.sampled_from([0.5, 0.8, 1.0, 1.7]))
    top_k = data.draw(st.integers(0, v))
    top_p = data.draw(st.sampled_from([1.0, 0.9, 0.75, 0.5, 0.3, 0.1]))
    want, margin = _reference_probs(vals, temp, top_k, top_p)
    assume(margin > 1e-5)
    got = _processed_probs(torch.tensor([vals], dtype=torch.float32), temp, top_k, top_p)[0]
    assert np.array_equal(got > 0, want > 0), (vals, temp, top_k, top_p, got, want)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_reference_probs_by_hand():
    """The reference on hand-checked rows (a tie at the top-k cut is kept;
    top-p drops the least likely of two tied tokens by index)."""
    ln = np.log
    probs, _ = _reference_probs(ln([0.1, 0.2, 0.3, 0.4]), 1.0, 0, 0.65)
    np.testing.assert_allclose(probs, [0, 0, 3 / 7, 4 / 7])
    probs, _ = _reference_probs([1.0, 2.0, 2.0, 0.0], 1.0, 2, 1.0)
    np.testing.assert_allclose(probs, [0, 0.5, 0.5, 0])
    probs, _ = _reference_probs([1.0, 2.0, 2.0, 1.0], 1.0, 3, 1.0)   # tie at the cut
    assert (probs > 0).tolist() == [True, True, True, True]
    probs, _ = _reference_probs(ln([0.25, 0.25, 0.5]), 1.0, 0, 0.6)
    np.testing.assert_allclose(probs, [0, 1 / 3, 2 / 3])
    probs, _ = _reference_probs([0.0, 1.0], 2.0, 0, 1.0)          # temperature
    np.testing.assert_allclose(probs, np.exp([0, 0.5]) / np.exp([0, 0.5]).sum())
