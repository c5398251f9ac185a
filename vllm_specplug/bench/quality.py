"""Quality of sampled outputs: the target model's own mean log-likelihood of
the text a method generated (per generated token, at temperature 1, no
top-k/top-p). A lossless method samples from the same distribution as plain
sampling, so its figure matches plain sampling's up to noise; a lossy rule
(``typical`` acceptance) shows its cost here."""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Iterable, Sequence


@lru_cache(maxsize=1)
def _load(model_path: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    return model.eval()


def output_logprobs(model_path: str, pairs: Iterable[tuple[Sequence[int], Sequence[int]]],
                    max_len: int = 4096) -> list[tuple[float, int]]:
    """``(sum of log p(output token | prefix), number of output tokens)`` for
    each ``(prompt_ids, output_ids)``, from a transformers forward of the
    model on CPU in float32."""
    import torch

    model = _load(model_path)
    out = []
    with torch.inference_mode():
        for prompt, output in pairs:
            ids = (list(prompt) + list(output))[:max_len]
            n_out = len(ids) - len(prompt)
            if n_out <= 0 or not prompt:
                out.append((0.0, 0))
                continue
            logits = model(torch.tensor([ids])).logits[0].float()
            logp = torch.log_softmax(logits[len(prompt) - 1: len(ids) - 1], dim=-1)
            target = torch.tensor(ids[len(prompt):])
            out.append((float(logp.gather(1, target[:, None]).sum()), n_out))
    return out


def mean_logprob(scores: list[tuple[float, int]]) -> float:
    """Token-weighted mean log-likelihood per generated token."""
    total, n = sum(s for s, _ in scores), sum(k for _, k in scores)
    return total / n if n else math.nan
