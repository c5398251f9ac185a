"""Ray across nodes: a two-node Ray cluster on this machine (Ray's own
multi-node test utility, ``ray.cluster_utils.Cluster``: two raylets, two node
ids), a TP=2 engine under vLLM's Ray executor whose two ranks the placement
group must put on different nodes (each node has one ``specplug_cpu_rank``).
The plugin is the one installed in this environment; each rank's Ray worker
loads it through the entry point. ``tests/ray_cpu_engine.py --nodes 2`` runs
the engine (vLLM 0.32's CPU refusal of Ray lifted in that script's processes
only; see its docstring and docs/distributed.md, "Ray").

Checks: the ranks ran on the two different nodes; ``sam_tr`` greedy output is
token-identical to plain decoding (TP=1, the original model); an
accepted-draft floor; and a node whose plugin version differs makes the
engine fail to start with an error naming both versions.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import chat, pick

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MAX_TOKENS = 32
MAX_MODEL_LEN = 1024
SPEC = {"method": "sam_tr"}
# accepted draft tokens over the 3 prompts, 32 tokens each (one by one):
# 45 on two Ray nodes on 2026-12-07 (27 drafts, 203 draft tokens); floor at
# a third of it
MIN_ACCEPTED = 15
OTHER_VERSION = "0.0.9-node-b"
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def prompts(spec_bench_prompts):
    rows = pick(spec_bench_prompts, ["summarization", "extraction", "coding"], 1)
    return [r["prompt"] for r in rows]


def _run_two_nodes(prompts, tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess, str]:
    pytest.importorskip("ray")
    pytest.importorskip("ray.cluster_utils")
    from vllm_specplug.models import padded_heads_model_path

    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    env = dict(os.environ)
    # one OpenMP core list per rank (as tests/test_engine_tp.py's TP_ENV)
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(HERE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "ray_cpu_engine.py"), "--model",
         padded_heads_model_path(2), "--tp", "2", "--nodes", "2", "--spec", json.dumps(SPEC),
         "--prompts", str(tmp_path / "prompts.json"), "--max-tokens", str(MAX_TOKENS),
         "--max-model-len", str(MAX_MODEL_LEN), *extra],
        capture_output=True, text=True, timeout=900, env=env)
    return proc, (proc.stdout + proc.stderr)[-6000:]


def _line(proc, tag: str) -> dict | None:
    lines = [x for x in proc.stdout.splitlines() if x.startswith(tag + " ")]
    return json.loads(lines[-1][len(tag) + 1:]) if lines else None


def test_tp2_ranks_on_two_ray_nodes_match_plain(get_llm, prompts, tmp_path):
    import vllm_specplug

    plain = get_llm("plain")
    reference = [list(chat(plain, [p], max_tokens=MAX_TOKENS)[0].outputs[0].token_ids)
                 for p in prompts]
    proc, tail = _run_two_nodes(prompts, tmp_path)
    res = _line(proc, "RESULT")
    assert proc.returncode == 0 and res is not None, tail
    assert res["executor"] == "RayExecutorV2"
    # two nodes in the cluster, and each rank ran on its own one
    assert sorted(res["nodes"].values()) == ["node_a", "node_b"], res["nodes"]
    ranks = sorted(res["ranks"], key=lambda s: s["rank"])
    assert [s["rank"] for s in ranks] == [0, 1]
    node_ids = [s["node_id"] for s in ranks]
    assert node_ids[0] != node_ids[1], node_ids
    assert sorted(res["nodes"][n] for n in node_ids) == ["node_a", "node_b"], (node_ids,
                                                                              res["nodes"])
    for s in ranks:
        assert s["plugin_version"] == vllm_specplug.__version__
        assert "GPUModelRunner._sample" in s["patches"], s["patches"]
        assert s["errors"] == 0, s
    # greedy output identical to plain decoding, with drafts accepted
    assert res["tokens"] == reference
    assert res["spec"]["accepted"] >= MIN_ACCEPTED, res["spec"]
    # the ranks verified the same drafts: Token Recycling's matrix is the
    # same on both nodes
    crc = [s["proposer"]["token_recycling"]["matrix_crc32"] for s in ranks]
    assert crc[0] == crc[1], crc


def test_node_with_another_plugin_version_fails_engine_start(prompts, tmp_path):
    """The second node's workers report vllm-specplug OTHER_VERSION (as if
    another version were installed there): the drafter on that node refuses
    to start (``SpecPlugDrafter.__init__`` checks its version against the
    one that configured the engine, carried in ``additional_config``), and
    the engine fails to start, naming both versions and the host."""
    import vllm_specplug

    proc, tail = _run_two_nodes(prompts[:1], tmp_path, "--node-b-plugin-version",
                                OTHER_VERSION)
    assert proc.returncode == 3, tail
    assert _line(proc, "RESULT") is None
    err = _line(proc, "ENGINE_START_ERROR")
    assert err is not None, tail
    # the exception LLM(...) raises carries the worker's error (Ray's
    # RayTaskError, from RayWorkerProc.initialize_worker on the second node)
    # naming both versions
    lines = [x for x in err["message"].splitlines() if "vllm-specplug version mismatch" in x]
    assert lines, err
    assert vllm_specplug.__version__ in lines[-1] and OTHER_VERSION in lines[-1], lines[-1]
    assert "initialize_worker" in err["message"], err["message"][:2000]
