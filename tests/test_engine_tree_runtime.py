"""Tree verification under vLLM's runtime features: n > 1, stop strings,
max_model_len, aborts mid-stream and preemption by recomputation.

The tree method is token_recycling with 24-node trees (paper template), so
trees are accepted and compacted, not only rejected. Every greedy output must
be token-identical to plain decoding's.
"""
from __future__ import annotations

import pytest

from helpers import chat, pick, step_with_abort

pytestmark = pytest.mark.engine

# Large trees in every step, batch or not (batch-aware budgets off): these
# tests are about the tree machinery, not about when trees pay.
TR_PAPER = {"method": "token_recycling", "num_speculative_tokens": 24,
            "tr_template": "paper", "batch_budget": "off"}


def _stats(worker):
    return worker.model_runner.drafter.stats()


def _ids(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def prompts(spec_bench_prompts):
    return [r["prompt"] for r in pick(spec_bench_prompts, ["writing", "coding", "rag"], 1)]


def test_stop_strings_and_n2(get_llm, prompts):
    kw = dict(max_tokens=40, stop=[".\n", "```"])
    plain = chat(get_llm("plain"), prompts, **kw)
    llm = get_llm("tr_paper", TR_PAPER)
    tree = chat(llm, prompts, **kw)
    assert _ids(plain) == _ids(tree)
    assert [o.outputs[0].text for o in plain] == [o.outputs[0].text for o in tree]
    # n > 1 needs sampling in vLLM; two completions per prompt, both complete
    outs = chat(llm, prompts, max_tokens=24, temperature=0.8, n=2, seed=7)
    assert all(len(o.outputs) == 2 for o in outs)
    assert all(c.finish_reason in ("length", "stop") for o in outs for c in o.outputs)
    assert llm.llm_engine.collective_rpc(_stats)[0]["errors"] == 0


def test_requests_reaching_max_model_len(get_llm, model_path):
    """Drafts near the end of the context window must not overrun it."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(model_path)
    text = " ".join(["the lighthouse keeper counted the ships one by one"] * 400)
    ids = tok(text)["input_ids"][: 2048 - 30]  # engines use max_model_len=2048
    sp = SamplingParams(temperature=0, max_tokens=100)
    plain = get_llm("plain").generate([TokensPrompt(prompt_token_ids=ids)], sp,
                                      use_tqdm=False)
    llm = get_llm("tr_paper", TR_PAPER)
    tree = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
    assert _ids(plain) == _ids(tree)
    assert len(ids) + len(tree[0].outputs[0].token_ids) <= 2048
    assert tree[0].outputs[0].finish_reason == "length"
    assert llm.llm_engine.collective_rpc(_stats)[0]["errors"] == 0


def test_abort_mid_stream_leaves_the_others_intact(get_llm, prompts):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = get_llm("tr_paper", TR_PAPER)
    tok = llm.get_tokenizer()
    token_prompts = [tok(tok.apply_chat_template([{"role": "user", "content": p}],
                                                 add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)["input_ids"] for p in prompts]
    sp = SamplingParams(temperature=0, max_tokens=40)
    ref = get_llm("plain").generate([TokensPrompt(prompt_token_ids=t) for t in token_prompts],
                                    sp, use_tqdm=False)
    ids = [f"abort-test-{i}" for i in range(len(token_prompts))]
    done = step_with_abort(llm.llm_engine, {rid: TokensPrompt(prompt_token_ids=t)
                                            for rid, t in zip(ids, token_prompts)},
                           sp, 6, [ids[1]])
    assert ids[1] not in done
    assert done[ids[0]] == list(ref[0].outputs[0].token_ids)
    assert done[ids[2]] == list(ref[2].outputs[0].token_ids)
    chat(llm, ["Say hi."], max_tokens=2)  # lets the runner free finished requests
    s = llm.llm_engine.collective_rpc(_stats)[0]
    assert s["errors"] == 0 and s["active_requests"] <= 1 and s["trees_held"] <= 1, s


def test_preemption_by_recomputation(get_llm, spec_bench_prompts):
    """A KV cache of 5 blocks (vLLM keeps one back: 512 tokens) for 4 requests
    of ~200 tokens each: the scheduler must preempt; outputs stay identical
    to plain decoding (max_model_len 512 so that one request fits)."""
    prompts = [r["prompt"] for r in pick(spec_bench_prompts, ["writing", "roleplay",
                                                                "humanities", "stem"], 1)]
    kw = dict(max_tokens=140, ignore_eos=True)
    plain = chat(get_llm("plain"), prompts, **kw)
    llm = get_llm("tr_paper_small_kv", TR_PAPER, num_gpu_blocks_override=5,
                  max_model_len=512, enable_prefix_caching=False)
    before = _preemptions(llm)
    tree = chat(llm, prompts, **kw)
    assert _preemptions(llm) > before, "the test did not provoke a preemption"
    assert _ids(plain) == _ids(tree)
    s = llm.llm_engine.collective_rpc(_stats)[0]
    assert s["errors"] == 0 and s["tree"]["tree_steps"] > 0, s


def _preemptions(llm) -> int:
    for m in llm.get_metrics():
        if m.name == "vllm:num_preemptions":
            return int(m.value)
    raise AssertionError("vLLM exposes no vllm:num_preemptions counter")
