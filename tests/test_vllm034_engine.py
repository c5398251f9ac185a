"""vLLM 0.34's own engine loop on this CPU, with the plugin's MRV2 speculators.

Needs the side environment (``bash scripts/setup-vllm034.sh``); skipped
elsewhere. What runs is vLLM 0.34.0's real Python: ``LLM``/``LLMEngine``, the
scheduler (draft tokens, lookahead slots, preemption), Model Runner V2 (its
Triton kernels under Triton's interpreter), its rejection sampler and our
speculator through ``register_speculative_method``. What stands in: the six
``vllm._C`` ops of ``tests/vllm034_cpu_ops.py`` (attention, rotary embedding,
memory binding), tested against dense references in
``tests/test_vllm034_cpu_ops.py``; plain and speculative runs use the same
stand-ins. Timings here are the interpreter's, never speed
(docs/compatibility.md, "The vLLM 0.34 engine tier").

Run (CI does, after the main suite)::

    /work/.venv-vllm034/bin/python -m pytest -q -p no:cacheprovider -m vllm034 \\
        tests/test_vllm034_engine.py
"""
from __future__ import annotations

import gc
import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

import vllm034_env
from helpers import step_with_abort

pytestmark = [pytest.mark.vllm034, pytest.mark.engine]

vllm034_env.require(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")

import vllm034_cpu_ops  # noqa: E402

vllm034_cpu_ops.register()
import vllm.v1.worker.cpu.shm  # noqa: E402,F401  vLLM's CPU stand-ins for pinned/UVA memory

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 40
K = 4


def recorded(name: str, n: int, start: int = 0) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the embedded model's greedy output under transformers)."""
    rows = [json.loads(line) for line in (ROOT / "results" / "curves" /
                                           f"{name}_greedy_hf.jsonl").open()]
    return [(r["prompt_ids"], r["output_ids"]) for r in rows[start:start + n]]


# Four records of one extraction template (sam drafts from the prompt and
# from one another's outputs) and two agent turns.
PROMPTS = [p for p, _ in recorded("pipeline", 4)] + [p for p, _ in recorded("agentic", 2, 6)]

_LIVE: dict[str, object] = {}


def _shutdown(name: str) -> None:
    llm = _LIVE.pop(name)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def engine(name: str, spec: dict | None, **overrides):
    """One vLLM 0.34 ``LLM`` at a time (in this process: no engine
    subprocess), started on first use and kept for later tests."""
    if name in _LIVE:
        return _LIVE[name]
    for other in list(_LIVE):
        _shutdown(other)
    from vllm import LLM

    from vllm_specplug.models import default_model_path

    args = dict(model=default_model_path(), dtype="float32", enforce_eager=True,
                max_model_len=1024, max_num_seqs=8, seed=0, disable_log_stats=False,
                kernel_config={"enable_jit_warmup": False})
    args.update(overrides)
    _LIVE[name] = LLM(speculative_config=spec, **args)
    return _LIVE[name]


@pytest.fixture(scope="module", autouse=True)
def _engines_closed():
    yield
    for name in list(_LIVE):
        _shutdown(name)


def sam_spec(k: int = K, **options) -> dict:
    return {"method": "sam", "num_speculative_tokens": k,
            "speculator_options": {"isolation": "none", "sam_min_match_len": 2, **options}}


def spec_counts(llm) -> dict[str, int]:
    """vLLM's own speculative-decoding counters (cumulative for the engine)."""
    out = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                      "vllm:spec_decode_num_accepted_tokens", "vllm:num_preemptions"):
            out[m.name.split(":")[1]] = int(m.value)
    return out


def speculator_stats(llm) -> dict:
    """Our speculator's counters, and the ids of the requests it holds."""
    def read(worker):
        spec = worker.model_runner.speculator
        return {**spec.stats, "live": sorted(spec._reqs)}
    return llm.collective_rpc(read)[0]


def freed_after_next_step(llm) -> None:
    """vLLM tells the runner which requests finished in the next step's
    scheduler output, so the requests of a batch's last step are freed at the
    next step: after one more short request, only that request may be held."""
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2),
                       use_tqdm=False)
    # the engine's internal id is the request id with a suffix
    assert {r.split("-")[0] for r in speculator_stats(llm)["live"]} <= {out[0].request_id}


def greedy(llm, prompts, max_tokens: int = MAX_TOKENS, **params) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, **params),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def greedy_counted(llm, prompts) -> tuple[list[list[int]], int, int]:
    """Greedy outputs, and the draft tokens vLLM counted accepted and
    drafted while producing them."""
    before = spec_counts(llm)
    outs = greedy(llm, prompts)
    counts = spec_counts(llm)
    accepted, drafted = (counts[k] - before.get(k, 0) for k in (
        "spec_decode_num_accepted_tokens", "spec_decode_num_draft_tokens"))
    return outs, accepted, drafted


_PLAIN: dict[str, list] = {}


def plain_greedy(key: str, prompts, **params) -> list[list[int]]:
    """Plain decoding's outputs, computed once per key (the plain engine is
    started only for what no cached result covers)."""
    if key not in _PLAIN:
        _PLAIN[key] = greedy(engine("plain", None), prompts, **params)
    return _PLAIN[key]


# ------------------------------------------------------------------ greedy
def test_plain_engine_on_the_stand_ins_matches_transformers():
    """The engine on the stand-in ops decodes as transformers does (a check of
    the stand-ins inside the engine: wrong attention or rotary math diverges
    within a few tokens)."""
    records = recorded("pipeline", 4) + recorded("agentic", 2, 6)
    outs = plain_greedy("main", PROMPTS)
    same = [out == ref[:MAX_TOKENS] for out, (_, ref) in zip(outs, records)]
    # float32 on two stacks may split a near-tie late in a sequence; the
    # first 16 tokens of every record, and whole outputs of most, agree
    assert all(out[:16] == ref[:16] for out, (_, ref) in zip(outs, records))
    assert sum(same) >= len(same) - 1, same


def test_sam_greedy_is_plain_decoding_with_accepted_drafts():
    plain = plain_greedy("main", PROMPTS)
    llm = engine("sam", sam_spec())
    outs, accepted, drafted = greedy_counted(llm, PROMPTS)
    assert outs == plain
    # 2026-12-06 (this file's first run): 118 of 504 slots accepted; a
    # proposer whose drafts are shifted, reversed or never used accepts few
    print(f"sam K={K}: accepted {accepted} of {drafted} draft slots", file=sys.stderr)
    assert accepted >= 60, (accepted, drafted)
    freed_after_next_step(llm)


@pytest.mark.parametrize("method,isolation,floor", [
    ("token_recycling", "none", 40),
    ("token_recycling", "request", 30),
    ("sam_tr", "none", 60),
])
def test_token_recycling_chains_are_plain_decoding_with_accepted_drafts(method, isolation,
                                                                        floor):
    """Token Recycling on MRV2 (the target's argmax per token on the device,
    from its own lm_head through the load_model patch) and sam_tr: greedy
    output token-identical to plain decoding, with a floor on accepted drafts
    (a table never learned, a chain walked from the wrong token or shifted
    by one accepts far fewer)."""
    plain = plain_greedy("main", PROMPTS)
    llm = engine(f"{method}-{isolation}",
                 {"method": method, "num_speculative_tokens": K,
                  "speculator_options": {"isolation": isolation}})
    outs, accepted, drafted = greedy_counted(llm, PROMPTS)
    assert outs == plain
    stats = llm.collective_rpc(lambda w: w.model_runner.speculator.recycling.stats())[0]
    print(f"{method} ({isolation}) K={K}: accepted {accepted} of {drafted} draft slots; "
          f"{stats}", file=sys.stderr)
    assert stats["tr_learned_positions"] > 0 and stats["tr_rows"] > 0, stats
    assert accepted >= floor, (accepted, drafted)


def test_n_greater_than_one_and_stop_strings():
    """n=2 and a stop string that ends a request early, in one batch with an
    ordinary request. vLLM 0.34 refuses n > 1 with greedy sampling and raises
    any temperature to at least 0.01, so the n=2 request samples at 0.01:
    each copy is plain decoding's greedy output up to a position where the
    two likeliest tokens lie within 0.2 in log-probability (elsewhere another
    token has a chance below e^-20 at that temperature), if any."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_specplug.models import default_model_path

    prompts = PROMPTS[:3]
    plain = plain_greedy("main", PROMPTS)[:3]
    top2 = engine("plain", None).generate(
        [{"prompt_token_ids": prompts[0]}],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2), use_tqdm=False)
    gaps = []
    for step in top2[0].outputs[0].logprobs:
        best = sorted((x.logprob for x in step.values()), reverse=True)
        gaps.append(best[0] - best[1])
    llm = engine("sam", sam_spec())
    tok = AutoTokenizer.from_pretrained(default_model_path())
    stop_text = tok.decode(plain[1][10:12])    # occurs in the second output
    params = [SamplingParams(temperature=0.01, max_tokens=MAX_TOKENS, n=2, seed=7),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop_text]),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)]
    before = spec_counts(llm)["spec_decode_num_accepted_tokens"]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(outs[0].outputs) == 2
    for copy in outs[0].outputs:
        ids = list(copy.token_ids)
        split = next((i for i in range(len(plain[0]))
                      if i >= len(ids) or ids[i] != plain[0][i]), None)
        assert split is None or gaps[split] < 0.2, (split, gaps[split], ids, plain[0])
    full = tok.decode(plain[1])
    assert outs[1].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].text == full[:full.index(stop_text)]
    assert list(outs[2].outputs[0].token_ids) == plain[2]
    assert spec_counts(llm)["spec_decode_num_accepted_tokens"] - before >= 10


def test_abort_mid_decode_leaves_the_others_exact():
    """Requests aborted between steps (one with drafts in flight) leave the
    others' outputs exact and nothing held for them in the speculator."""
    from vllm import SamplingParams

    plain = plain_greedy("main", PROMPTS)
    llm = engine("sam", sam_spec())
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    ids = [f"abort-{i}" for i in range(len(PROMPTS))]
    done = step_with_abort(llm.llm_engine, {rid: {"prompt_token_ids": prompt}
                                            for rid, prompt in zip(ids, PROMPTS)},
                           params, 4, [ids[0], ids[3]])
    for i, rid in enumerate(ids):
        if i in (0, 3):
            assert rid not in done or len(done[rid]) < MAX_TOKENS
        else:
            assert done[rid] == plain[i], rid
    freed_after_next_step(llm)


def test_preemption_under_a_small_kv_cache():
    """24 blocks of 32 tokens (no prefix caching) for six requests of
    157-186 prompt tokens growing by 40: the scheduler preempts running
    requests and recomputes them; outputs stay plain decoding's."""
    prompts = [p for p, _ in recorded("pipeline", 6)]
    plain = plain_greedy("preempt", prompts)
    llm = engine("sam-small-kv", sam_spec(), num_gpu_blocks_override=24, block_size=32,
                 enable_prefix_caching=False, max_model_len=512)
    outs = greedy(llm, prompts)
    counts = spec_counts(llm)
    print(f"small KV cache: {counts}", file=sys.stderr)
    assert counts["num_preemptions"] > 0, counts
    assert outs == plain
    assert counts["spec_decode_num_accepted_tokens"] >= 20
    freed_after_next_step(llm)


# ---------------------------------------------------------------- sampling
SAMPLED = 120


def _sampled_pairs(llm, prompt: list[int]) -> Counter:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": prompt}] * SAMPLED,
                        SamplingParams(temperature=1.0, max_tokens=3), use_tqdm=False)
    return Counter(tuple(o.outputs[0].token_ids[1:3]) for o in outs)


@pytest.mark.slow   # 431 s on 2026-12-06 (2 cores): the interpreter samples each row in numpy
def test_sampled_output_follows_the_target_distribution():
    """Temperature 1: the second and third tokens (the positions sam drafts
    for, from a prompt that repeats one phrase) have the same distribution
    with and without speculation. Two-sample chi-square over the most common
    pairs, at significance 0.001 (a verifier that accepted drafts too often
    moves most of the mass to sam's continuation and fails)."""
    from scipy.stats import chi2_contingency
    from transformers import AutoTokenizer

    from vllm_specplug.models import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    prompt = tok.encode("one two three four five, one two three four five, one two three "
                        "four five, one two")
    plain = _sampled_pairs(engine("plain-sampled", None, max_num_seqs=64), prompt)
    llm = engine("sam-sampled", sam_spec(), max_num_seqs=64)
    before = spec_counts(llm).get("spec_decode_num_accepted_tokens", 0)
    spec = _sampled_pairs(llm, prompt)
    assert spec_counts(llm)["spec_decode_num_accepted_tokens"] - before >= SAMPLED // 8
    common = [pair for pair, _ in (plain + spec).most_common(6)]
    rows = [[plain[c] for c in common] + [SAMPLED - sum(plain[c] for c in common)],
            [spec[c] for c in common] + [SAMPLED - sum(spec[c] for c in common)]]
    keep = [j for j in range(len(rows[0])) if rows[0][j] + rows[1][j] > 0]
    table = [[r[j] for j in keep] for r in rows]
    p = chi2_contingency(table).pvalue
    assert p > 1e-3, (p, table, common)


# ------------------------------------------------------------------ served
@pytest.mark.server
def test_vllm_serve_with_the_openai_client(tmp_path):
    """``specplug vllm serve`` on vLLM 0.34 (API server and engine-core
    processes, the stand-ins registered in each by
    ``tests/vllm034_site/sitecustomize.py``), through the OpenAI client:
    greedy completions are plain decoding's text, and vLLM's spec-decode
    counters show accepted drafts."""
    import re

    import requests
    from openai import OpenAI
    from transformers import AutoTokenizer

    from vllm_specplug.bench.server import running_server
    from vllm_specplug.models import default_model_path

    model = default_model_path()
    tok = AutoTokenizer.from_pretrained(model)
    plain = plain_greedy("main", PROMPTS)
    for name in list(_LIVE):       # the server's engine needs the memory more
        _shutdown(name)
    site = str(Path(__file__).resolve().parent / "vllm034_site")
    env = {"SPECPLUG_VLLM034_STANDINS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)}
    args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
            "--max-num-seqs", "8", "--served-model-name", "smollm2",
            "--speculative-config", json.dumps(sam_spec()),
            "--kernel-config", json.dumps({"enable_jit_warmup": False})]
    with running_server(model, args, tmp_path / "server.log", env=env, timeout=600) as base:
        client = OpenAI(base_url=base + "/v1", api_key="none")
        for prompt, ref in zip(PROMPTS[:3], plain[:3]):
            reply = client.completions.create(model="smollm2", prompt=prompt,
                                              max_tokens=MAX_TOKENS, temperature=0)
            assert reply.choices[0].text == tok.decode(ref, skip_special_tokens=True)
        metrics = requests.get(base + "/metrics", timeout=30).text
    accepted = re.search(r"^vllm:spec_decode_num_accepted_tokens_total\{[^}]*\} ([0-9.e+]+)$",
                         metrics, re.M)
    assert accepted is not None and float(accepted.group(1)) >= 10, metrics[-2000:]
