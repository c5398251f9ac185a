"""Engine settings shared by the benchmark, the demo and the tests.

The engine itself (``build_llm``, ``engine_kwargs``, ``cpu_defaults``) is
built by ``vllm_specplug.offline_engine`` (re-exported here), which the
EAGLE trainer uses too without importing the benchmark."""
from __future__ import annotations

from typing import Any

from ..offline_engine import build_llm, cpu_defaults, engine_kwargs  # noqa: F401 - re-exported

# Baselines and our methods, bs = 1 settings. vLLM's suffix at its own
# default (24, its suffix_decoding_max_tree_depth: it sizes its drafts
# itself); sam and ngram at 8. (sam at 32 reached tau 8.5 against 5.8 on
# agentic but fewer tokens/s than suffix in the engine on this CPU:
# docs/benchmarks.md, Workloads, session 12.)
METHOD_CONFIGS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 8,
              "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": {"method": "suffix", "num_speculative_tokens": 24},
    # sam sizes its drafts from the verify cost; 32 is its ceiling, not its length
    "sam": {"method": "sam", "num_speculative_tokens": 32},
    # node budget chosen per step from the measured verify cost
    "token_recycling": {"method": "token_recycling", "num_speculative_tokens": "auto"},
    "sam_tr": {"method": "sam_tr", "num_speculative_tokens": "auto"},
    # EAGLE heads: "model" comes from ``specplug bench --eagle-head DIR``
    # vLLM's own EAGLE (chains; the EAGLE-1 head format this plugin trains)
    "eagle": {"method": "eagle", "num_speculative_tokens": 3},
    "eagle2": {"method": "eagle2", "num_speculative_tokens": "auto"},
    "sam_eagle2": {"method": "sam_eagle2", "num_speculative_tokens": "auto"},
}

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}


def read_spec_counters(llm) -> dict:
    """Current spec-decode counters of an ``LLM`` (zeros without speculation)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        key = SPEC_COUNTERS.get(m.name)
        if key is not None:
            out[key] = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = [int(v) for v in m.values]
    return out


def counter_delta(after: dict, before: dict) -> dict:
    d = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    a, b = after["accepted_per_pos"], before["accepted_per_pos"]
    d["accepted_per_pos"] = [a[i] - (b[i] if i < len(b) else 0) for i in range(len(a))]
    return d


def _drafter_stats(worker):
    drafter = getattr(worker.model_runner, "drafter", None)
    stats = getattr(drafter, "stats", None)
    return stats() if stats is not None else None


def read_drafter_stats(llm) -> dict | None:
    """Our drafter's ``stats()`` on the first worker (proposer debug stats
    included: e.g. sam_tr's branch counts), or None for vLLM's own methods.
    Needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in the engine's environment
    (the benchmark worker sets it)."""
    try:
        return llm.llm_engine.collective_rpc(_drafter_stats)[0]
    except Exception:  # noqa: BLE001 - stats are a report extra, never fatal
        return None
