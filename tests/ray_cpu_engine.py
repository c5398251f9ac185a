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

``--nodes 2`` starts a two-node Ray cluster on this machine instead, with
Ray's multi-node test utility (``ray.cluster_utils.Cluster``: a head node and
a second node, each its own raylet with its own node id, one CPU and one
``specplug_cpu_rank``), so the placement group must put rank 0 and rank 1 on
different nodes; each rank reports the node id it ran on.
``--node-b-plugin-version V`` makes the second node's workers report
vllm-specplug version ``V`` (its raylet's environment carries
``SPECPLUG_TEST_NODE_PLUGIN_VERSION``, which the worker setup hook applies to
``vllm_specplug.__version__``), simulating a node with another plugin
install; if the engine fails to start, the script prints
``ENGINE_START_ERROR {...}`` (the exception's type and text) and exits 3.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

RESOURCE = "specplug_cpu_rank"
# set in the second node's raylet environment only (``--node-b-plugin-version``)
NODE_VERSION_ENV = "SPECPLUG_TEST_NODE_PLUGIN_VERSION"


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
    version = os.environ.get(NODE_VERSION_ENV)
    if version:  # a node simulating another vllm-specplug install
        import vllm_specplug

        vllm_specplug.__version__ = version


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
    import ray

    out["node_id"] = ray.get_runtime_context().get_node_id()
    return out


def _start_cluster(pythonpath: str, node_b_env: dict):
    """Two Ray nodes on this machine (``ray.cluster_utils.Cluster``), one
    ``specplug_cpu_rank`` each; returns the cluster (the driver is connected
    to its head node)."""
    import ray
    from ray.cluster_utils import Cluster

    # Ray starts its workers 15 steps nicer than the raylet (RAY_worker_niceness,
    # default 15): on a shared 2-core machine the ranks then starve (0.1
    # token/s seen); keep them at this script's own niceness instead
    os.environ.setdefault("RAY_worker_niceness", "0")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {RESOURCE: 1, "node_a": 1}, "include_dashboard": False,
        "object_store_memory": 128 * 1024 * 1024})
    cluster.add_node(num_cpus=1, resources={RESOURCE: 1, "node_b": 1},
                     object_store_memory=128 * 1024 * 1024, env_vars=node_b_env or None)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=True,
             runtime_env={"worker_process_setup_hook": "ray_cpu_engine.lift_cpu_ray_refusal",
                          "env_vars": {"PYTHONPATH": pythonpath}})
    return cluster


def _node_names() -> dict:
    """node id -> "node_a" (head) / "node_b" / "other"."""
    import ray

    out = {}
    for n in ray.nodes():
        res = n.get("Resources", {})
        out[n["NodeID"]] = ("node_a" if "node_a" in res else "node_b" if "node_b" in res
                            else "other")
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
    ap.add_argument("--nodes", type=int, default=1, choices=(1, 2),
                    help="2: a two-node Ray cluster (ray.cluster_utils.Cluster), one rank per node")
    ap.add_argument("--node-b-plugin-version", default=None,
                    help="with --nodes 2: the second node's workers report this plugin version")
    args = ap.parse_args(argv)
    if args.nodes == 2 and args.tp * args.pp != 2:
        ap.error("--nodes 2 places one rank per node: world size must be 2")
    if args.node_b_plugin_version and args.nodes != 2:
        ap.error("--node-b-plugin-version needs --nodes 2")

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
    cluster = None
    if args.nodes == 2:
        node_b_env = ({NODE_VERSION_ENV: args.node_b_plugin_version}
                      if args.node_b_plugin_version else {})
        cluster = _start_cluster(pythonpath, node_b_env)
    else:
        ray.init(num_cpus=2, resources={RESOURCE: world}, include_dashboard=False,
                 object_store_memory=256 * 1024 * 1024, log_to_driver=True,
                 runtime_env={"worker_process_setup_hook": "ray_cpu_engine.lift_cpu_ray_refusal",
                              "env_vars": {"PYTHONPATH": pythonpath}})
    nodes = _node_names()
    t_ray = time.perf_counter() - t0
    from vllm import LLM, SamplingParams

    from vllm_specplug.bench.engine import counter_delta, read_spec_counters

    spec = json.loads(args.spec)
    kw = dict(model=args.model, dtype="float32", enforce_eager=True, max_model_len=args.max_model_len,
              seed=0, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
              distributed_executor_backend="ray", disable_log_stats=False)
    if spec is not None:
        kw["speculative_config"] = spec
    try:
        llm = LLM(**kw)
    except Exception as e:  # noqa: BLE001 - reported to the caller
        print("ENGINE_START_ERROR " + json.dumps({"type": type(e).__name__, "message": str(e),
                                                  "nodes": nodes}), flush=True)
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        return 3
    t_start = time.perf_counter() - t0
    with open(args.prompts) as f:
        prompts = json.load(f)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    tokens = []
    before = read_spec_counters(llm)
    t1 = time.perf_counter()
    for p in prompts:
        out = llm.chat([[{"role": "user", "content": p}]], sp, use_tqdm=False)
        tokens.append(list(out[0].outputs[0].token_ids))
    t_gen = time.perf_counter() - t1
    spec_delta = counter_delta(read_spec_counters(llm), before)
    ranks = llm.llm_engine.collective_rpc(_stats)
    executor = type(llm.llm_engine.engine_core.engine_core.model_executor).__name__
    print("RESULT " + json.dumps({"tokens": tokens, "ranks": ranks, "executor": executor,
                                  "spec": spec_delta, "nodes": nodes,
                                  "driver_node_id": ray.get_runtime_context().get_node_id(),
                                  "ray_s": t_ray, "start_s": t_start, "generate_s": t_gen,
                                  "driver_pid": os.getpid()}),
          flush=True)
    llm.llm_engine.engine_core.shutdown()  # the executor first, then Ray
    ray.shutdown()
    if cluster is not None:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
