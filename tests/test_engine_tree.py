"""Tree verification inside the real vLLM engine with the embedded model."""
from __future__ import annotations

import json

import pytest

from helpers import chat, pick

pytestmark = pytest.mark.engine

MAX_TOKENS = 40


def _stats(worker):
    return worker.model_runner.drafter.stats()


@pytest.fixture(scope="module")
def prompts(spec_bench_prompts):
    rows = pick(spec_bench_prompts, ["summarization", "coding", "writing", "qa", "rag"], 1)
    return [r["prompt"] for r in rows]


@pytest.fixture(scope="module")
def reference(get_llm, prompts, tmp_path_factory):
    outs = chat(get_llm("plain"), prompts, max_tokens=MAX_TOKENS)
    seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    path = tmp_path_factory.mktemp("oracle") / "oracle.json"
    path.write_text(json.dumps({"sequences": seqs}))
    return outs, str(path)


def test_oracle_tree_accepts_exactly_the_hidden_path(get_llm, prompts, reference):
    ref, oracle_file = reference
    llm = get_llm("oracle_tree", {"method": "debug_oracle_tree", "num_speculative_tokens": 9,
                                  "oracle_file": oracle_file, "oracle_width": 2})
    outs = chat(llm, prompts, max_tokens=MAX_TOKENS)
    for a, b in zip(ref, outs):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
    s = llm.llm_engine.collective_rpc(_stats)[0]
    p = s["proposer"]
    assert p["steps"] > 20
    # tau = hidden depth + 1 on every step: the accepted count equals the depth.
    assert p["mismatched_steps"] == 0, s
    assert p["accepted_total"] == p["hidden_depth_total"] > 0
    assert s["tree"]["tree_steps"] > 0 and s["tree"]["compacted"] > 0, s


def test_random_trees_keep_output_identical(get_llm, prompts, reference):
    ref, _ = reference
    llm = get_llm("random_tree", {"method": "debug_random_tree", "num_speculative_tokens": 8})
    outs = chat(llm, prompts, max_tokens=MAX_TOKENS)
    for a, b in zip(ref, outs):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
    s = llm.llm_engine.collective_rpc(_stats)[0]
    assert s["tree"]["tree_steps"] > 0 and s["errors"] == 0, s
