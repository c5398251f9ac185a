"""One method in one fresh engine: ``python -m vllm_specplug.bench.worker IN OUT``.

Prints ``@@progress`` lines for the orchestrator's progress bar.
"""
from __future__ import annotations

import json
import os
import sys
import time


def run(cfg: dict) -> dict:
    from vllm import SamplingParams

    from .engine import build_llm, counter_delta, read_drafter_stats, read_spec_counters

    t0 = time.perf_counter()
    llm = build_llm(cfg["model"], cfg["speculative_config"], **cfg.get("engine", {}))
    start_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=cfg["temperature"], max_tokens=cfg["max_tokens"],
                        seed=cfg.get("seed", 0))
    msgs = [[{"role": "user", "content": p["prompt"]}] for p in cfg["prompts"]]
    # Warm-up (not measured): one short request.
    llm.chat([[{"role": "user", "content": "Say hello."}]],
             SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    results = []
    for rep in range(cfg.get("repeat", 1)):
        for p, m in zip(cfg["prompts"], msgs):
            before = read_spec_counters(llm)
            t = time.perf_counter()
            out = llm.chat([m], sp, use_tqdm=False)[0]
            dt = time.perf_counter() - t
            delta = counter_delta(read_spec_counters(llm), before)
            ids = list(out.outputs[0].token_ids)
            results.append({"id": p["id"], "category": p["category"], "repeat": rep,
                            "token_ids": ids, "prompt_token_ids": list(out.prompt_token_ids),
                            "generated": len(ids), "seconds": dt,
                            # runnable processes, 1-minute average (bench.plausibility)
                            "load_average": os.getloadavg()[0], **delta})
            print("@@progress", flush=True)
    batch = None
    if cfg.get("batch"):
        before = read_spec_counters(llm)
        t = time.perf_counter()
        outs = llm.chat(msgs, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        delta = counter_delta(read_spec_counters(llm), before)
        batch = {"seconds": dt, "generated": sum(len(o.outputs[0].token_ids) for o in outs),
                 "token_ids": [list(o.outputs[0].token_ids) for o in outs], **delta}
        print("@@progress", flush=True)
    drafter = read_drafter_stats(llm) if cfg["speculative_config"] is not None else None
    return {"engine_start_seconds": start_s, "results": results, "batch": batch,
            "drafter_stats": drafter}


def main() -> None:
    import os

    # lets the report read our drafter's stats from the engine process
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    cfg = json.load(open(sys.argv[1]))
    res = run(cfg)
    with open(sys.argv[2], "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
