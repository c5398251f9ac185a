"""One vLLM engine under the Ray executor on vLLM's CPU platform, for tests.

vLLM 0.32 refuses Ray on its CPU platform (``CpuPlatform.ray_device_key`` is
empty: "current platform cpu does not support ray"). This script lifts that
refusal in its own process and in the Ray workers it starts, and nowhere
else (the plugin never does this):

* ``CpuPlatform.ray_device_key`` becomes a custom Ray resource
  (``specplug_cpu_rank``, one per rank, declared by our ``ray.init``), so the
  placement group has one bundle per rank;
* ``RayWorkerWrapper.get_node_and_physical_gpu_ids`` (which asks Ray for the
  accelerator ids of that resource, which a custom resource has none of)
  returns the worker's rank instead.

The Ray workers run :func:`lift_cpu_ray_refusal` as their
``worker_process_setup_hook``. The engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the patched platform is the one
that creates the Ray executor.

Run as a script: it starts a local Ray (2 CPUs), one engine, generates the
prompts greedily one by one, and prints one JSON line (``RESULT {...}``) with
the token ids and each rank's drafter stats.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

RESOURCE = "specplug_cpu_rank"


def _worker_rank_ids(self):
    import ray

    rank = getattr(self, "rpc_rank", None)
    if rank is None:  # RayExecutorV2's RayWorkerProc
        rank = self._init_kwargs["rank"]
    return ray.get_runtime_context().get_node_id(), [rank]


def lift_cpu_ray_refusal() -> None:
    """Let vLLM's Ray executor run on the CPU platform (this process only)."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.executor import ray_executor_v2, ray_utils

    CpuPlatform.ray_device_key = RESOURCE
    ray_utils.RayWorkerWrapper.get_node_and_physical_gpu_ids = _worker_rank_ids
    ray_executor_v2.RayWorkerProc.get_node_and_physical_gpu_ids = _worker_rank_ids


def _stats(worker):
    import os as _os

    drafter = getattr(worker.model_runner, "drafter", None)
    out = drafter.stats() if drafter is not None else {}
    out["pid"] = _os.getpid()
    out["rank"] = worker.rank
    import vllm_specplug

    out["plugin_version"] = vllm_specplug.__version__
    from vllm_specplug.vllm_adapter.v1 import applied_names

    out["patches"] = sorted(applied_names())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--spec", default="null", help="speculative config as JSON")
    ap.add_argument("--prompts", required=True, help="JSON file: a list of chat prompts")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args(argv)

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    world = args.tp * args.pp
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    pythonpath = os.pathsep.join([root, here] + [p for p in os.environ.get(
        "PYTHONPATH", "").split(os.pathsep) if p])
    os.environ["PYTHONPATH"] = pythonpath
    sys.path[:0] = [p for p in (root, here) if p not in sys.path]

    import ray

    lift_cpu_ray_refusal()
    t0 = time.perf_counter()
    ray.init(num_cpus=2, resources={RESOURCE: world}, include_dashboard=False,
             object_store_memory=256 * 1024 * 1024, log_to_driver=True,
             runtime_env={"worker_process_setup_hook": "ray_cpu_engine.lift_cpu_ray_refusal",
                          "env_vars": {"PYTHONPATH": pythonpath}})
    from vllm import LLM, SamplingParams

    spec = json.loads(args.spec)
    kw = dict(model=args.model, dtype="float32", enforce_eager=True, max_model_len=args.max_model_len,
              seed=0, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
              distributed_executor_backend="ray")
    if spec is not None:
        kw["speculative_config"] = spec
    llm = LLM(**kw)
    t_start = time.perf_counter() - t0
    with open(args.prompts) as f:
        prompts = json.load(f)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    tokens = []
    for p in prompts:
        out = llm.chat([[{"role": "user", "content": p}]], sp, use_tqdm=False)
        tokens.append(list(out[0].outputs[0].token_ids))
    ranks = llm.llm_engine.collective_rpc(_stats)
    executor = type(llm.llm_engine.engine_core.engine_core.model_executor).__name__
    print("RESULT " + json.dumps({"tokens": tokens, "ranks": ranks, "executor": executor,
                                  "start_s": t_start, "driver_pid": os.getpid()}),
          flush=True)
    llm.llm_engine.engine_core.shutdown()  # the executor first, then Ray
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
