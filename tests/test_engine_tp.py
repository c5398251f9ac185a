"""Tensor parallelism (TP=2, vLLM's ``mp`` executor, CPU): our methods give
greedy output identical to plain decoding at TP=1, and every rank holds the
same proposer state (Token Recycling's matrix: same checksum on both ranks).

The embedded SmolLM2-135M has 9 query / 3 KV heads, which vLLM cannot split
over 2 ranks, so the TP engines load the same model with zero heads added
(12 / 4; ``padded_heads_model_path``, tested to give the same logits); the
reference is plain decoding of the original model at TP=1."""
from __future__ import annotations

import os

import pytest

from helpers import chat, pick

pytestmark = pytest.mark.engine

MAX_TOKENS = 40
# vLLM's CPU platform needs one OpenMP core list per rank ("Not enough
# allowed NUMA nodes" otherwise); set only while a TP engine starts.
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def _stats(worker):
    return worker.model_runner.drafter.stats()


@pytest.fixture(scope="module")
def prompts(spec_bench_prompts):
    rows = pick(spec_bench_prompts, ["summarization", "extraction", "coding", "rag"], 1)
    return [r["prompt"] for r in rows]


@pytest.fixture(scope="module")
def reference(get_llm, prompts):
    return chat(get_llm("plain"), prompts, max_tokens=MAX_TOKENS)


def tp_llm(get_llm, name, spec):
    saved = {k: os.environ.get(k) for k in TP_ENV}
    os.environ.update(TP_ENV)
    try:
        from vllm_specplug.models import padded_heads_model_path

        return get_llm(name, spec, model=padded_heads_model_path(2), tensor_parallel_size=2,
                       distributed_executor_backend="mp")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.parametrize("name,spec", [
    ("tp2_sam", {"method": "sam", "num_speculative_tokens": 8}),
    ("tp2_token_recycling", {"method": "token_recycling"}),
])
def test_tp2_greedy_matches_plain_tp1_and_ranks_agree(get_llm, prompts, reference, name, spec):
    llm = tp_llm(get_llm, name, spec)
    outs = chat(llm, prompts, max_tokens=MAX_TOKENS)
    for a, b in zip(reference, outs):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
    # both prompts at once too (a batch of tree/chain requests)
    outs = chat(llm, prompts[:2] * 2, max_tokens=MAX_TOKENS)
    for a, b in zip(reference[:2] * 2, outs):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
    ranks = llm.llm_engine.collective_rpc(_stats)
    assert len(ranks) == 2
    for s in ranks:
        assert s["errors"] == 0, s
    if spec["method"] == "token_recycling":
        crc = [s["proposer"]["matrix_crc32"] for s in ranks]
        assert crc[0] == crc[1], crc
        assert ranks[0]["proposer"]["topk_misaligned"] == 0
        assert ranks[0]["proposer"]["matrix_rows"] > 0
