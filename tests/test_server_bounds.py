"""A short served soak (``specplug bench soak``'s traffic, docs/soak.md):
every structure that grows with traffic stays within its bound
(docs/architecture.md, "Bounds") on a real server.

One ``specplug vllm serve`` with ``sam_tr`` and a global store of the
smallest size (1,024 tokens), so the store fills and evicts within the test;
``REQUESTS`` requests in bursts of 16 (greedy and sampled, stop strings,
some aborted mid-stream). About 3 minutes on the 2-core machine, most of it
the server's start.
"""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.server

REQUESTS = 96
STORE_TOKENS = 1024
K = 8
# the goodput controller on, so its per-request backoff records are exercised too
SPEC = {"method": "sam_tr", "num_speculative_tokens": K, "sam_global_tokens": STORE_TOKENS,
        "goodput": "on"}


def test_structures_stay_within_their_bounds(model_path, tmp_path):
    from vllm_specplug.bench.soak import run_served, soak_requests
    from vllm_specplug.budget import DrainValuation
    from vllm_specplug.proposers.global_store import GlobalStore
    from vllm_specplug.proposers.sam import MAX_BUCKET
    from vllm_specplug.proposers.token_recycling import ROW_GROWTH

    reqs = soak_requests(REQUESTS, seed=1)
    try:
        res = run_served(model_path, "sam_tr", reqs, REQUESTS // 2, tmp_path, spec=SPEC,
                         extra_env={"VLLM_SPECPLUG_MALLOC_TRIM_S": "0.5"})
    except RuntimeError as e:  # the server did not start or exited
        pytest.fail(str(e))
    print("\nbounds soak:", json.dumps({k: res[k] for k in ("server_start_s", "counts")}),
          [(s["requests"], s["seconds"], s["tree_rss_mb"]) for s in res["samples"]])
    assert res["counts"]["errors"] == 0, res["counts"]
    assert res["counts"]["done"] == REQUESTS
    last = res["samples"][-1]["drafter"]
    assert last is not None
    assert (last["active_requests"], last["state_bytes"], last["errors"]) == (0, 0, 0), last
    # glibc's free memory given back in the drafter's process (vllm_specplug.malloc_trim):
    # idle between bursts, at most every 0.5 s here
    assert last["malloc_trim"]["on"] and last["malloc_trim"]["calls"] >= 2, last["malloc_trim"]
    # the backoff saw the requests (and freed each record: sizes below)
    assert last["goodput"]["enabled"] and last["backoff"]["enabled"], last["goodput"]
    sizes = dict(last["sizes"])
    print("sizes:", sizes, "store:", {k: v for k, v in last["proposer"]["sam"].items()
                                      if k.startswith("global_store")})
    # per request: freed once no request runs (finished, aborted or preempted)
    for key in ("drafter_requests", "drafter_trees",
                "drafter_salts", "drafter_preempted", "sam_output_ends",
                "backoff_requests", "request_caps", "calibration_pending", "exploration_pending",
                "sam_requests", "sam_pending", "sam_choices", "sam_live_marks",
                "sam_corpus_matches", "sam_global_matches",
                "sam_tenants", "sam_stop_requests", "tr_requests", "tr_private_matrices",
                "hybrid_branches", "hybrid_chains"):
        assert sizes.pop(key) == 0, (key, last["sizes"])
    assert sizes.pop("pending_topk") <= 16            # the last step's batch
    assert sizes.pop("sam_completed") <= 16           # finished in the last step
    assert sizes.pop("sam_prompt_lens") <= REQUESTS   # (MAX_TRACKED_PROMPTS in general)
    assert sizes.pop("sam_acceptance_cache") <= 3 * 2 * (MAX_BUCKET + 1)
    assert sizes.pop("tr_template_cache") <= K + 1
    assert sizes.pop("tr_matrices") <= 8              # tr_tenants (live matrices)
    assert sizes.pop("drain_open") <= DrainValuation.MAX_OPEN   # finishes of the last WINDOW steps
    assert not sizes, f"a new structure without a bound asserted here: {sizes}"
    # the store: full and evicting, within its tokens and bytes
    sam = last["proposer"]["sam"]
    assert 0 < sam["global_store_tokens"] <= STORE_TOKENS
    assert sam["global_store_bytes"] <= GlobalStore(STORE_TOKENS).max_nbytes()
    tr = last["proposer"]["token_recycling"]
    assert tr["matrix_rows"] <= 49152 + ROW_GROWTH  # SmolLM2's vocabulary
    json.dumps(res)  # what the bench writes
