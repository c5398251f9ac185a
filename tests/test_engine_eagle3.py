"""EAGLE-3 heads with the embedded model.

* Format and math against vLLM: a randomly initialised EAGLE-3 head (own
  LM head over a 4,096-token draft vocabulary, ``d2t``), saved by
  ``save_head3``, runs in vLLM's own ``"method": "eagle3"``; vLLM's first
  chain draft equals the chain ``Eagle3Head`` computes from transformers'
  hidden states at the auxiliary layers.
* In our ``eagle2``: greedy output token-identical to plain decoding, and
  each root draft equals the head run by hand on transformers' auxiliary
  hidden states of the same context (the runner patch made the target
  return the right layers, and the runner fused the right rows).
"""
from __future__ import annotations


import numpy as np
import pytest
import torch

from capture_vllm_drafts import eagle3_features, head_chain, save_random_head, vllm_first_drafts
from helpers import assert_same_tokens, chat, pick

pytestmark = pytest.mark.engine

DRAFT_VOCAB = 4096
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def eagle3_head(model_path, tmp_path_factory):
    return save_random_head(model_path, tmp_path_factory.mktemp("eagle3_head"), eagle3=True,
                            draft_vocab=DRAFT_VOCAB)


@pytest.mark.slow
def test_vllm_eagle3_first_draft_equals_eagle3_head(eagle3_head, model_path, tmp_path):
    from vllm_specplug.eagle import load_head
    from vllm_specplug.eagle.train import load_target

    rows = vllm_first_drafts(eagle3_head, tmp_path, "eagle3")
    model = load_target(model_path)
    head, _ = load_head(eagle3_head, num_target_layers=model.config.num_hidden_layers)
    assert head.kind == "eagle3"
    allowed = set(head.target_ids().tolist())
    for row in rows:
        assert set(row["first_draft"]) <= allowed, row
        chain, ties = head_chain(head, model, row["prompt_ids"], row["output_ids"][0],
                                 row["first_draft"])
        assert chain == row["first_draft"], (row, chain, ties)


def _config(head):
    return {"method": "eagle2", "model": head, "num_speculative_tokens": 6, "depth": 3,
            "topk": 3, "batch_budget": "off"}


def _record(self):
    self.model_runner.drafter.target_hook.recent = []


def _recent(self):
    return list(self.model_runner.drafter.target_hook.recent or [])


@pytest.mark.slow
def test_eagle2_with_an_eagle3_head(get_llm, model_path, spec_bench_prompts, eagle3_head):
    from helpers import engine_stats

    from vllm_specplug.eagle import load_head
    from vllm_specplug.eagle.train import load_target

    prompts = [r["prompt"] for r in pick(spec_bench_prompts, ["writing", "coding", "rag"], 1)]
    ref = chat(get_llm("plain"), prompts, max_tokens=MAX_TOKENS)
    llm = get_llm("eagle2_eagle3", _config(eagle3_head))
    llm.llm_engine.collective_rpc(_record)
    outs = chat(llm, prompts, max_tokens=MAX_TOKENS)
    assert_same_tokens(ref, outs)
    s = engine_stats(llm)
    assert s["errors"] == 0, s
    assert s["tree"]["tree_steps"] > 0, s
    recent = llm.llm_engine.collective_rpc(_recent)[0]
    assert len(recent) >= 10, len(recent)

    # root drafts against the head on transformers' auxiliary hidden states
    model = load_target(model_path)
    head, _ = load_head(eagle3_head, num_target_layers=model.config.num_hidden_layers)
    emb = model.get_input_embeddings().weight
    checked = 0
    for rec in recent[:: max(1, len(recent) // 6)]:
        ctx, pos = rec["context"], rec["positions"]
        assert pos == sorted(set(pos)) and pos[-1] == len(ctx) - 2, (pos[-5:], len(ctx))
        with torch.inference_mode():
            feats = eagle3_features(model, head, ctx)
            p = torch.tensor(pos)
            nxt = torch.tensor([ctx[i + 1] for i in pos])
            hidden, _, _ = head(emb[nxt], feats[p], p)
            lp = head.logits(hidden[-1:])[0]
        top = torch.topk(lp, len(rec["ids"]))
        assert rec["ids"][0] == int(top.indices[0]) or \
            float(top.values[0] - lp[rec["ids"][0]]) < 1e-3, rec
        np.testing.assert_allclose(rec["logprobs"], top.values.numpy(), atol=2e-3)
        checked += 1
    assert checked >= 3
