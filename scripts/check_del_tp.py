"""Manual check: DEL at TP=2 (mp executor, CPU) gives greedy output identical to
plain decoding at TP=1, with no drafter errors on either rank.

The embedded model's 9 heads cannot be split over 2 ranks, so the TP engine
loads the zero-padded copy (``padded_heads_model_path(2)``, same function).
Starts two engines (~3 minutes here); run under the engine lock:

    VLLM_CPU_KVCACHE_SPACE=1 flock /tmp/specplug-engine.lock python scripts/check_del_tp.py
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

from helpers import chat, pick  # noqa: E402

from vllm_specplug.bench.engine import build_llm  # noqa: E402
from vllm_specplug.bench.prompts import load_prompts  # noqa: E402
from vllm_specplug.models import default_model_path, padded_heads_model_path  # noqa: E402


def _stats(worker):
    return worker.model_runner.drafter.stats()


def main() -> int:
    # del is refused at tensor_parallel_size > 1 until this check has passed;
    # lift the refusal in this process only
    from vllm_specplug.proposers.early_exit import DelProposer

    DelProposer.supports_tensor_parallel = True
    prompts = [r["prompt"] for r in pick(load_prompts(), ["summarization", "coding", "rag"], 1)]
    plain = build_llm(default_model_path(), None, max_model_len=2048)
    ref = chat(plain, prompts, max_tokens=32)
    plain.llm_engine.engine_core.shutdown()
    del plain
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    llm = build_llm(padded_heads_model_path(2),
                    {"method": "del", "num_speculative_tokens": 3, "del_probe_every": 2},
                    max_model_len=2048, tensor_parallel_size=2,
                    distributed_executor_backend="mp")
    outs = chat(llm, prompts, max_tokens=32)
    same = [list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
            for a, b in zip(ref, outs)]
    ranks = llm.llm_engine.collective_rpc(_stats)
    print("identical to plain TP=1:", same)
    for i, s in enumerate(ranks):
        print(f"rank {i}: errors {s['errors']}", json.dumps(s["proposer"]))
    llm.llm_engine.engine_core.shutdown()
    ok = all(same) and all(s["errors"] == 0 for s in ranks)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
