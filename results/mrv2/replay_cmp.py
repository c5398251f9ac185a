"""Async sam (this tree) against the synchronous one of bd71482 and vLLM 0.34's suffix,
over recorded outputs (tests/test_mrv2_speculator.py's Runner), tokens per step.

How it was run (2026-12-06, side environment of scripts/setup-vllm034.sh):
    git show bd71482:vllm_specplug/vllm_adapter/mrv2/speculator.py \
        > vllm_specplug/vllm_adapter/mrv2/_sync_ref.py      # not committed
    cd tests && /work/.venv-vllm034/bin/python ../results/mrv2/replay_cmp.py 8
"""
import json, sys, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import test_mrv2_speculator as t
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm_specplug.models import default_model_path
from vllm_specplug.vllm_adapter.mrv2._sync_ref import SamSpeculator as SyncSam
path = default_model_path()
K = int(sys.argv[1]) if len(sys.argv) > 1 else 8
def run(name, n, start, variant):
    if variant == "suffix":
        spec = {"method": "suffix", "num_speculative_tokens": K}
    else:
        spec = {"method": "sam", "num_speculative_tokens": K, "speculator_options": {"isolation": "none"}}
    cfg = t.engine_config(path, spec)
    runner = t.Runner(cfg, k=K)
    if variant == "sync":
        runner.spec = SyncSam(cfg, t.CPU, runner.rs)
    tokens = steps = 0
    rows = [json.loads(l) for l in open(ROOT / "results" / "curves" / f"{name}_greedy_hf.jsonl")]
    # the file is one half already (odd: *_greedy_hf.jsonl, even: *_even_greedy_hf.jsonl)
    for i, (prompt, truth) in enumerate((r["prompt_ids"], r["output_ids"]) for r in rows):
        tau = t.run_stream(runner, f"{variant}{i}", prompt, truth)
        tokens += len(truth); steps += len(truth) / tau
    return round(tokens / steps, 3)
out = {}
for name, n in (("pipeline", 40), ("agentic", 41)):
    # odd half: records 1, 3, 5, ... are not used for tuning
    out[name] = {v: run(name, n, 0, v) for v in ("sync", "async", "suffix")}
    print(name, json.dumps(out[name]), flush=True)
