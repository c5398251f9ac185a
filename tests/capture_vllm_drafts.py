"""Not a test module: the helper that captures vLLM's own EAGLE drafts, run as
a script (``python tests/capture_vllm_drafts.py HEAD OUT.json PROMPTS.json
[eagle|eagle3]``) by tests/test_train_eagle.py and tests/test_engine_eagle3.py:
an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uni-process
executor) whose ``EagleProposer.propose`` is wrapped to record its first
return value.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

NUM_DRAFT = 3
COMPARE_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                   "List three uses of a paper clip."]


def capture_vllm_drafts(head_dir: str, out_json: str, prompts_json: str,
                        method: str = "eagle") -> None:
    """For each prompt (one request at a time): the prompt ids, the first
    sampled token and vLLM's first chain draft (``method``: vLLM's ``eagle``
    or ``eagle3``)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.v1.spec_decode.eagle import EagleProposer

    from vllm_specplug.models import default_model_path

    calls: list = []
    original = EagleProposer.propose

    def propose(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls.append(out.detach().cpu().tolist())
        return out

    EagleProposer.propose = propose
    model = default_model_path()
    tok = AutoTokenizer.from_pretrained(model)
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
              distributed_executor_backend="uni",
              speculative_config={"method": method, "model": head_dir,
                                  "num_speculative_tokens": NUM_DRAFT})
    rows = []
    for p in json.loads(Path(prompts_json).read_text()):
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        calls.clear()
        o = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=3),
                         use_tqdm=False)
        rows.append({"prompt_ids": ids, "output_ids": list(o[0].outputs[0].token_ids),
                     "first_draft": calls[0][0] if calls else None, "num_calls": len(calls)})
    Path(out_json).write_text(json.dumps(rows))


if __name__ == "__main__":
    capture_vllm_drafts(*sys.argv[1:5])
    sys.exit(0)
