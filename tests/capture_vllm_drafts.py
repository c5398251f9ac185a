"""Not a test module: the helper that captures vLLM's own EAGLE drafts, run as
a script (``python tests/capture_vllm_drafts.py HEAD OUT.json PROMPTS.json
[eagle|eagle3 [TARGET]]``; ``vllm_first_drafts`` runs it) by
tests/test_train_eagle.py, tests/test_engine_eagle3.py and
tests/test_engine_published_heads.py: an engine with the uni-process executor
whose ``EagleProposer.propose`` is wrapped, inside the engine-core process
(``collective_rpc``), to record its first return value. (Not an in-process
engine, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM 0.32's Triton-override scan
at worker start fails in a process that imported numba, as the plugin's
proposers do.) Also
what those tests compare the drafts with: random heads for a target
(``save_random_head``) and the greedy chain our head computes from
transformers' features (``head_chain``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

NUM_DRAFT = 3
COMPARE_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                   "List three uses of a paper clip."]


def capture_vllm_drafts(head_dir: str, out_json: str, prompts_json: str,
                        method: str = "eagle", model: str | None = None) -> None:
    """For each prompt (one request at a time): the prompt ids, the first
    sampled token and vLLM's first chain draft (``method``: vLLM's ``eagle``
    or ``eagle3``; ``model``: the target folder, default the embedded model)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(function)
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_specplug.models import default_model_path

    model = model or default_model_path()
    tok = AutoTokenizer.from_pretrained(model)
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
              distributed_executor_backend="uni",
              speculative_config={"method": method, "model": head_dir,
                                  "num_speculative_tokens": NUM_DRAFT})
    llm.collective_rpc(_record_proposals)
    rows = []
    for p in json.loads(Path(prompts_json).read_text()):
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        llm.collective_rpc(_take_proposals)
        o = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=3),
                         use_tqdm=False)
        calls = llm.collective_rpc(_take_proposals)[0]
        rows.append({"prompt_ids": ids, "output_ids": list(o[0].outputs[0].token_ids),
                     "first_draft": calls[0][0] if calls else None, "num_calls": len(calls)})
    Path(out_json).write_text(json.dumps(rows))


def _record_proposals(worker) -> None:
    """In the engine-core process: wrap ``EagleProposer.propose`` to keep
    each return value (as lists) in ``EagleProposer.specplug_calls``."""
    from vllm.v1.spec_decode.eagle import EagleProposer

    calls: list = []
    original = EagleProposer.propose

    def propose(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls.append(out.detach().cpu().tolist())
        return out

    EagleProposer.propose = propose
    EagleProposer.specplug_calls = calls


def _take_proposals(worker) -> list:
    """The proposals recorded since the last call (and forget them)."""
    from vllm.v1.spec_decode.eagle import EagleProposer

    calls = list(EagleProposer.specplug_calls)
    EagleProposer.specplug_calls.clear()
    return calls


def vllm_first_drafts(head_dir: str, tmp_path: Path, method: str = "eagle",
                      model: str | None = None) -> list[dict]:
    """``capture_vllm_drafts`` for ``COMPARE_PROMPTS`` in a subprocess; the
    rows it wrote."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(COMPARE_PROMPTS))
    res = tmp_path / "drafts.json"
    proc = subprocess.run([sys.executable, __file__, str(head_dir), str(res), str(prompts), method,
                           *([model] if model else [])],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(res.read_text())
    for row in rows:
        assert row["first_draft"] is not None, "vLLM's EagleProposer.propose was not called"
        assert len(row["first_draft"]) == NUM_DRAFT, row
    return rows


def save_random_head(target_dir: str, out: Path, *, eagle3: bool = False,
                     draft_vocab: int = 4096, attn_std: float = 0.05, **config) -> str:
    """A randomly initialised EAGLE-1 (or EAGLE-3) head for the target at
    ``target_dir`` (``config`` overrides its config.json keys), saved in
    ``out``: weights N(0, 0.05) (norm weights around 1; the attention's
    N(0, ``attn_std``): larger values make attention, hence RoPE and the
    biases, matter to the drafts); EAGLE-3: a ``draft_vocab``-token draft
    vocabulary, draft id i -> a spread of target ids (not the identity)."""
    from vllm_specplug.eagle import (Eagle3Head, Eagle3HeadConfig, EagleHead, EagleHeadConfig,
                                     save_head, save_head3)

    target = json.loads((Path(target_dir) / "config.json").read_text())
    d = {**target, "num_hidden_layers": 1, **config}
    torch.manual_seed(0)
    if eagle3:
        cfg = Eagle3HeadConfig.from_dict({**d, "draft_vocab_size": draft_vocab},
                                         num_target_layers=target["num_hidden_layers"])
        head = Eagle3Head(cfg)
    else:
        cfg = EagleHeadConfig.from_dict(d)
        head = EagleHead(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0,
                      attn_std if "self_attn" in name else 0.05)
        if eagle3:
            ids = np.sort(np.random.default_rng(0).choice(cfg.vocab_size, draft_vocab,
                                                          replace=False))
            head.d2t.copy_(torch.as_tensor(ids - np.arange(draft_vocab)))
    (save_head3 if eagle3 else save_head)(head, cfg, out)
    return str(out)


def eagle3_features(model, head, ids):
    """An EAGLE-3 head's fused target features for a context, from
    transformers: the residual stream after the auxiliary layers
    (hidden_states[n])."""
    out = model(torch.tensor([ids]), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[n][0] for n in head.needs_aux_layers], dim=-1)
    return head.fuse(aux)


@torch.inference_mode()
def head_chain(head, model, prompt_ids, first_token, vllm_draft, k=NUM_DRAFT):
    """Greedy chain of an EAGLE-1 or EAGLE-3 head (``head.kind``) from
    transformers' features of the target ``model``: first pass over
    (embed(t[i+1]), f[i]) at positions 0..n-1 (t[n] = the first sampled
    token), then one token per step fed back with the head's own output as
    feature (EAGLE-3: the pre-norm output, as vLLM). EAGLE-1 features are the
    target's last hidden states and its LM head gives the logits; EAGLE-3's
    are ``eagle3_features`` and the head's own LM head over its draft
    vocabulary. At a near-tie (top-2 margin < 1e-3) vLLM's choice is
    accepted and fed on. Returns (chain, number of near-ties)."""
    ids = torch.tensor(prompt_ids)
    embed = model.get_input_embeddings().weight
    if head.kind == "eagle3":
        feats = eagle3_features(model, head, prompt_ids)
        logits = lambda h: head.logits(h)[0]  # noqa: E731
    else:
        feats = model.model(ids[None]).last_hidden_state[0]
        lm = model.get_output_embeddings().weight
        logits = lambda h: (h @ lm.T)[0]  # noqa: E731
    n = len(prompt_ids)
    toks = torch.cat((ids[1:], torch.tensor([first_token])))
    out, pk, pv = head(embed[toks], feats, torch.arange(n))
    h = out[-1:]
    chain, ties = [], 0
    for step in range(k):
        top2 = logits(h).topk(2)
        tok = int(top2.indices[0])
        if float(top2.values[0] - top2.values[1]) < 1e-3:
            ties += 1
            tok = vllm_draft[step] if vllm_draft[step] in top2.indices.tolist() else tok
        chain.append(tok)
        if step + 1 == k:
            break
        out, k_new, v_new = head(embed[torch.tensor([tok])], h, torch.tensor([n + step]), pk, pv)
        pk, pv = torch.cat((pk, k_new), 1), torch.cat((pv, v_new), 1)
        h = out
    return chain, ties


if __name__ == "__main__":
    capture_vllm_drafts(*sys.argv[1:6])
    sys.exit(0)
