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

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import assert_same_tokens, chat, pick

pytestmark = pytest.mark.engine

DRAFT_VOCAB = 4096
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def eagle3_head(model_path, tmp_path_factory):
    from vllm_specplug.eagle.head3 import Eagle3Head, Eagle3HeadConfig, save_head3

    target = json.loads((Path(model_path) / "config.json").read_text())
    cfg = Eagle3HeadConfig.from_dict({**target, "num_hidden_layers": 1,
                                      "draft_vocab_size": DRAFT_VOCAB},
                                     num_target_layers=target["num_hidden_layers"])
    torch.manual_seed(0)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.05)
        # draft id i -> a spread of target ids (not the identity)
        ids = np.sort(np.random.default_rng(0).choice(cfg.vocab_size, DRAFT_VOCAB,
                                                      replace=False))
        head.d2t.copy_(torch.as_tensor(ids - np.arange(DRAFT_VOCAB)))
    out = tmp_path_factory.mktemp("eagle3_head")
    save_head3(head, cfg, out)
    return str(out)


def _aux_features(model, head, ids):
    """The head's fused target features for a context, from transformers:
    the residual stream after the auxiliary layers (hidden_states[n])."""
    out = model(torch.tensor([ids]), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[n][0] for n in head.needs_aux_layers], dim=-1)
    return head.fuse(aux)


@torch.inference_mode()
def _chain(head, model, prompt_ids, first_token, vllm_draft, k):
    """Greedy EAGLE-3 chain (vLLM's semantics: the pre-norm output is fed
    back as the next feature); vLLM's choice is taken at a near-tie."""
    embed = model.get_input_embeddings().weight
    n = len(prompt_ids)
    toks = torch.tensor(prompt_ids[1:] + [first_token])
    out, pk, pv = head(embed[toks], _aux_features(model, head, prompt_ids), torch.arange(n))
    h = out[-1:]
    chain, ties = [], 0
    for step in range(k):
        lp = head.logits(h)[0]
        top2 = lp.topk(2)
        tok = int(top2.indices[0])
        if float(top2.values[0] - top2.values[1]) < 1e-3:
            ties += 1
            tok = vllm_draft[step] if vllm_draft[step] in top2.indices.tolist() else tok
        chain.append(tok)
        out, k_new, v_new = head(embed[torch.tensor([tok])], h, torch.tensor([n + step]), pk, pv)
        pk, pv = torch.cat((pk, k_new), 1), torch.cat((pv, v_new), 1)
        h = out
    return chain, ties


@pytest.mark.slow
def test_vllm_eagle3_first_draft_equals_eagle3_head(eagle3_head, model_path, tmp_path):
    import capture_vllm_drafts as tte

    from vllm_specplug.eagle import load_head
    from vllm_specplug.eagle.train import load_target

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(tte.COMPARE_PROMPTS))
    res = tmp_path / "drafts.json"
    proc = subprocess.run([sys.executable, tte.__file__, eagle3_head, str(res), str(prompts),
                           "eagle3"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = load_target(model_path)
    head, _ = load_head(eagle3_head, num_target_layers=model.config.num_hidden_layers)
    assert head.kind == "eagle3"
    allowed = set(head.target_ids().tolist())
    for row in json.loads(res.read_text()):
        assert row["first_draft"] is not None, "vLLM's EagleProposer.propose was not called"
        assert set(row["first_draft"]) <= allowed, row
        chain, ties = _chain(head, model, row["prompt_ids"], row["output_ids"][0],
                             row["first_draft"], tte.NUM_DRAFT)
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
            feats = _aux_features(model, head, ctx)
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
