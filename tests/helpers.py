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
