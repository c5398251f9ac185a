"""Helpers for the engine tests."""
from __future__ import annotations

import os

# the second test tier (tests marked ``slow``; see conftest.py)
RUN_SLOW = os.environ.get("SPECPLUG_SLOW_TESTS") == "1"


def chat(llm, prompts: list[str], max_tokens: int, temperature: float = 0.0, **kw):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, **kw)
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    return llm.chat(msgs, sp, use_tqdm=False)


def assert_same_tokens(ref, outs) -> None:
    """Each output's token ids equal the reference's (plain decoding's)."""
    assert len(ref) == len(outs)
    for i, (a, b) in enumerate(zip(ref, outs)):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids), i


def tau_of(llm, run) -> tuple[float, dict, list]:
    """Run ``run()`` (returning vLLM outputs) and measure tau from the spec counters."""
    from vllm_specplug.bench.engine import counter_delta, read_spec_counters

    before = read_spec_counters(llm)
    outs = run()
    delta = counter_delta(read_spec_counters(llm), before)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = generated - delta["accepted"]
    return generated / steps, delta, outs


def pick(prompts: list[dict], categories: list[str], per_category: int) -> list[dict]:
    out, seen = [], {}
    for p in prompts:
        c = p["category"]
        if c in categories and seen.get(c, 0) < per_category:
            seen[c] = seen.get(c, 0) + 1
            out.append(p)
    return out


def serve(model_path: str, tmp_path_factory, speculative_config: dict, *extra_args: str):
    """Generator for a module-scoped fixture: a real ``specplug vllm serve`` of
    the embedded model (served as ``smollm2``) with ``speculative_config``;
    yields its base URL."""
    import json

    import pytest

    from vllm_specplug.bench.server import running_server

    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
            "--served-model-name", "smollm2", "--speculative-config",
            json.dumps(speculative_config), *extra_args]
    try:
        with running_server(model_path, args, log, env={"VLLM_CPU_KVCACHE_SPACE": "1"}) as base:
            yield base
    except RuntimeError as e:
        pytest.fail(str(e))


# ------------------------------------------------- the drafter without vLLM
def fake_vllm_config(additional_config, num_speculative_tokens: int,
                     tensor_parallel_size: int = 1, model: str = "m"):
    """The parts of vLLM's ``VllmConfig`` our drafter reads, and nothing else
    (tests/test_adapter_targets.py checks each name against vLLM's own)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        additional_config=additional_config,
        speculative_config=SimpleNamespace(num_speculative_tokens=num_speculative_tokens),
        model_config=SimpleNamespace(model=model, dtype="float32"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tensor_parallel_size,
                                        pipeline_parallel_size=1))


def make_vllm_config(spec=None, **kw):
    """``fake_vllm_config`` for a speculative config (default: sam, 4 tokens)."""
    from vllm_specplug.config import translate

    _, plugin = translate(spec or {"method": "sam", "num_speculative_tokens": 4})
    return fake_vllm_config({"specplug": plugin}, plugin["num_speculative_tokens"], **kw)


def arrays(histories, max_len=None):
    """(num_tokens_no_spec, token_ids_cpu) as the runner holds them."""
    import numpy as np

    max_len = max_len or max([len(h) for h in histories] + [1]) + 8
    token_ids = np.zeros((len(histories), max_len), dtype=np.int32)
    for row, h in enumerate(histories):
        token_ids[row, :len(h)] = h
        # garbage after the committed tokens (e.g. draft slots) must be ignored
        token_ids[row, len(h):] = 999_999
    return np.asarray([len(h) for h in histories], dtype=np.int32), token_ids


def step(drafter, req_ids, histories, sampled):
    """One runner step: ``begin_step`` then ``propose`` (as the runner patch does)."""
    drafter.begin_step(list(req_ids), None)
    num_tokens, token_ids = arrays(histories)
    return drafter.propose(sampled, num_tokens, token_ids)
