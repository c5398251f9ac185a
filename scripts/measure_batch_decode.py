"""Offline batch decoding: plain decoding against `sam` at a batch of 32.

Each config in its own process (one engine at a time): 32 Spec-Bench chat
prompts (3 per category, the first 32) at once, greedy, 96 tokens each
(`ignore_eos`), wall time of the whole batch including its prefill, and the
drafter's batch-budget, calibration and own-time counters. It separates the
plugin's cost in a large decode batch from the serving benchmark's
prefill-heavy arrivals.

    python scripts/measure_batch_decode.py plain sam_off sam plain

Configs: plain; sam (batch budgets on, the default); sam_off (`sam` with
`disable_by_batch_size: 1`: the plugin runs, nothing is drafted); sam_fixed
(`batch_budget: "off"`: every draft kept). Prints one `RESULT {...}` line
per config.
"""
import json
import os
import subprocess
import sys
import time

CONFIGS = {
    "plain": None,
    "sam": {"method": "sam", "num_speculative_tokens": 8},
    "sam_off": {"method": "sam", "num_speculative_tokens": 8, "disable_by_batch_size": 1},
    "sam_fixed": {"method": "sam", "num_speculative_tokens": 8, "batch_budget": "off"},
}


def _stats(worker):
    d = getattr(worker.model_runner, "drafter", None)
    return d.stats() if d is not None and hasattr(d, "stats") else None


def run(name: str) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import SamplingParams

    from vllm_specplug.bench.engine import build_llm
    from vllm_specplug.bench.prompts import load_prompts
    from vllm_specplug.models import default_model_path

    llm = build_llm(default_model_path(), CONFIGS[name], max_model_len=2048)
    prompts = [[{"role": "user", "content": r["prompt"]}]
               for r in load_prompts(per_category=3)][:32]
    llm.chat(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    sp = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.chat(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    s = llm.llm_engine.collective_rpc(_stats)[0] or {}
    llm.llm_engine.engine_core.shutdown()
    return {"name": name, "tokens": n, "wall_s": wall, "tok_s": n / wall,
            "batch_budget": s.get("batch_budget"), "calibration": s.get("calibration"),
            "propose_time": s.get("propose_time")}


def main(argv) -> int:
    if len(argv) == 2 and argv[0] == "--one":
        print("RESULT " + json.dumps(run(argv[1])), flush=True)
        return 0
    for name in argv or ["plain", "sam"]:
        if name not in CONFIGS:
            raise SystemExit(f"unknown config {name!r}; choose from {sorted(CONFIGS)}")
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", name],
                             capture_output=True, text=True)
        lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode or not lines:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        print(lines[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
