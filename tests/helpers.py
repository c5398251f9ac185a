"""Helpers for the engine tests."""
from __future__ import annotations

import os
import zlib
from functools import lru_cache

import numpy as np

from vllm_specplug.proposers.base import Draft

# the second test tier (tests marked ``slow``; see conftest.py)
RUN_SLOW = os.environ.get("SPECPLUG_SLOW_TESTS") == "1"


def chat(llm, prompts: list[str], max_tokens: int, temperature: float = 0.0, **kw):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, **kw)
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    return llm.chat(msgs, sp, use_tqdm=False)


def assert_same_tokens(ref, outs) -> None:
    """Each output's token ids equal the reference's (plain decoding's)."""
    assert len(ref) == len(outs)
    for i, (a, b) in enumerate(zip(ref, outs)):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids), i


def tau_of(llm, run) -> tuple[float, dict, list]:
    """Run ``run()`` (returning vLLM outputs) and measure tau from the spec counters."""
    from vllm_specplug.bench.engine import counter_delta, read_spec_counters

    before = read_spec_counters(llm)
    outs = run()
    delta = counter_delta(read_spec_counters(llm), before)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = generated - delta["accepted"]
    return generated / steps, delta, outs


def step_with_abort(engine, prompts: dict, params, abort_after: int,
                    abort: list[str]) -> dict[str, list[int]]:
    """Add ``prompts`` (request id -> prompt) to a vLLM ``LLMEngine``, step it
    until nothing is left, aborting the requests ``abort`` after step
    ``abort_after``; returns the token ids of each request that finished."""
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, prompt, params)
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == abort_after:
            engine.abort_request(abort)
    return done


def pick(prompts: list[dict], categories: list[str], per_category: int) -> list[dict]:
    out, seen = [], {}
    for p in prompts:
        c = p["category"]
        if c in categories and seen.get(c, 0) < per_category:
            seen[c] = seen.get(c, 0) + 1
            out.append(p)
    return out


def serve(model_path: str, tmp_path_factory, speculative_config: dict, *extra_args: str):
    """Generator for a module-scoped fixture: a real ``specplug vllm serve`` of
    the embedded model (served as ``smollm2``) with ``speculative_config``;
    yields its base URL."""
    import json

    import pytest

    from vllm_specplug.bench.server import running_server

    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
            "--served-model-name", "smollm2", "--speculative-config",
            json.dumps(speculative_config), *extra_args]
    try:
        with running_server(model_path, args, log, env={"VLLM_CPU_KVCACHE_SPACE": "1"}) as base:
            yield base
    except RuntimeError as e:
        pytest.fail(str(e))


def chi2_goodness_of_fit(samples, probs: dict, min_expected: float = 5.0):
    """Chi-square goodness of fit of ``samples`` (hashable outcomes) to exact
    probabilities ``probs`` (outcome -> p). Cells with expected count below
    ``min_expected`` are pooled into one cell, with the mass ``probs`` leaves
    out and every sampled outcome ``probs`` lacks; a pool still below
    ``min_expected`` absorbs the smallest kept cells. Returns
    ``(statistic, dof, p, impossible)``, ``impossible`` the samples outside
    ``probs`` (p = 0 when they fall in a pool of zero expected count)."""
    from collections import Counter, namedtuple

    import numpy as np
    from scipy.stats import chisquare

    Fit = namedtuple("Fit", "statistic dof p impossible")
    n = len(samples)
    counts = Counter(samples)
    impossible = sum(c for k, c in counts.items() if k not in probs)
    cells = sorted(((n * p, counts.get(k, 0)) for k, p in probs.items()), reverse=True)
    kept = [c for c in cells if c[0] >= min_expected]
    pool_exp = n - sum(e for e, _ in kept)
    pool_obs = n - sum(o for _, o in kept)
    while kept and 0 < pool_exp < min_expected:
        e, o = kept.pop()
        pool_exp, pool_obs = pool_exp + e, pool_obs + o
    if pool_exp <= 1e-9 * n:  # nothing expected outside the kept cells
        if pool_obs > 0:
            return Fit(float("inf"), len(kept) - 1, 0.0, impossible)
        pool_exp = pool_obs = None
    exp = np.array([e for e, _ in kept] + ([pool_exp] if pool_exp is not None else []))
    obs = np.array([o for _, o in kept] + ([pool_obs] if pool_obs is not None else []))
    stat, p = chisquare(obs, exp * obs.sum() / exp.sum())
    return Fit(float(stat), len(obs) - 1, float(p), impossible)


# ------------------------------------------------- the drafter without vLLM
def fake_vllm_config(additional_config, num_speculative_tokens: int,
                     tensor_parallel_size: int = 1, model: str = "m"):
    """The parts of vLLM's ``VllmConfig`` our drafter reads, and nothing else
    (tests/test_adapter_targets.py checks each name against vLLM's own)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        additional_config=additional_config,
        speculative_config=SimpleNamespace(num_speculative_tokens=num_speculative_tokens),
        model_config=SimpleNamespace(model=model, dtype="float32"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tensor_parallel_size,
                                        pipeline_parallel_size=1))


def make_vllm_config(spec=None, **kw):
    """``fake_vllm_config`` for a speculative config (default: sam, 4 tokens)."""
    from vllm_specplug.config import translate

    _, plugin = translate(spec or {"method": "sam", "num_speculative_tokens": 4})
    return fake_vllm_config({"specplug": plugin}, plugin["num_speculative_tokens"], **kw)


def arrays(histories, max_len=None):
    """(num_tokens_no_spec, token_ids_cpu) as the runner holds them."""
    import numpy as np

    max_len = max_len or max([len(h) for h in histories] + [1]) + 8
    token_ids = np.zeros((len(histories), max_len), dtype=np.int32)
    for row, h in enumerate(histories):
        token_ids[row, :len(h)] = h
        # garbage after the committed tokens (e.g. draft slots) must be ignored
        token_ids[row, len(h):] = 999_999
    return np.asarray([len(h) for h in histories], dtype=np.int32), token_ids


def step(drafter, req_ids, histories, sampled):
    """One runner step: ``begin_step`` then ``propose`` (as the runner patch does)."""
    drafter.begin_step(list(req_ids), None)
    num_tokens, token_ids = arrays(histories)
    return drafter.propose(sampled, num_tokens, token_ids)


# ---------------------------------------------------- engines and servers
def drafter_stats(worker):
    """Our drafter's stats in a worker (``llm.llm_engine.collective_rpc(drafter_stats)``)."""
    return worker.model_runner.drafter.stats()


def engine_stats(llm) -> dict:
    """Rank 0's drafter stats of an engine."""
    return llm.llm_engine.collective_rpc(drafter_stats)[0]


#: Samples per sampling-distribution test (engine tests).
N_SAMPLES = 2000 if RUN_SLOW else 1000
# A raw 5-token prompt, not a chat: vLLM's CPU KV blocks hold 128 tokens, so
# 200 copies of a short prompt share no cached block and each is prefilled;
# the chat template's 34 tokens made a batch of 200 take ~26 s, this ~5 s.
SAMPLING_PROMPT = "Name a colour:"


def first_three(llm, n: int = N_SAMPLES, max_tokens: int = 6):
    """``n`` samples of the first three tokens after ``SAMPLING_PROMPT``
    (temperature 0.8, top_k 6), from generations of ``max_tokens`` tokens.
    Drafts stop at max_tokens, so with max_tokens 3 a draft could reach
    only the second token (one deep, in the one step that drafts); with 6
    the steps after the first token verify up to four deep, and what they
    accept decides the compared second and third tokens. Plain sampling's
    first three tokens do not depend on max_tokens."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.8, top_k=6, max_tokens=max_tokens)
    # top_k matters: vLLM 0.32's rejection sampler dies on steps where no
    # request has a draft and some request uses top_k (apply_top_k_only on an
    # empty tensor); our _sample patch samples those steps with the plain
    # sampler. Batches of 200 keep the run short and the batch mixed.
    out = []
    for _ in range(n // 200):
        outs = llm.generate([SAMPLING_PROMPT] * 200, params, use_tqdm=False)
        out += [tuple(o.outputs[0].token_ids)[:3] for o in outs]
    return out


def chi2_same_distribution(a, b) -> float:
    """p-value of a chi-square test that samples ``a`` and ``b`` come from one
    distribution (cells expected below 5 pooled)."""
    from collections import Counter

    import numpy as np
    from scipy.stats import chi2_contingency

    ca, cb = Counter(a), Counter(b)
    keys = sorted(set(ca) | set(cb), key=lambda k: -(ca[k] + cb[k]))
    table = np.array([[ca[k] for k in keys], [cb[k] for k in keys]], dtype=float)
    expected = table.sum(0) * table.sum(1, keepdims=True) / table.sum()
    keep = expected.min(0) >= 5
    pooled = np.concatenate([table[:, keep], table[:, ~keep].sum(1, keepdims=True)], axis=1)
    pooled = pooled[:, pooled.sum(0) > 0]
    return float(chi2_contingency(pooled)[1])


def ask_served(base: str, prompt: str, stream: bool, max_tokens: int) -> list[int]:
    """Greedy chat completion's token ids from a served ``smollm2`` (streamed or not)."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    kw = dict(model="smollm2", messages=[{"role": "user", "content": prompt}],
              temperature=0, max_tokens=max_tokens, extra_body={"return_token_ids": True})
    if not stream:
        return client.chat.completions.create(**kw).choices[0].model_extra["token_ids"]
    got: list[int] = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            got.extend(chunk.choices[0].model_extra.get("token_ids") or [])
    return got


# ------------------------------------ a toy target model for scorer tests
# (tests/test_scorers.py, tests/test_scorers_extra.py)
V = 5


@lru_cache(maxsize=None)
def target(prefix: tuple[int, ...]) -> np.ndarray:
    """A fixed 'model': a distribution over V tokens for each prefix."""
    seed = zlib.crc32(repr(prefix).encode())
    p = np.random.default_rng(seed).dirichlet(np.full(V, 0.7))
    p.setflags(write=False)
    return p


def rows_for(draft: Draft) -> np.ndarray:
    parents = draft.parent_array()
    prefixes: list[tuple[int, ...]] = []
    for i, p in enumerate(parents):
        prefixes.append((prefixes[p] if p >= 0 else ()) + (int(draft.tokens[i]),))
    return np.stack([target(())] + [target(pre) for pre in prefixes])


def sample_three(scorer, draft_fn, n: int, seed: int) -> np.ndarray:
    """First three tokens of n generations: one verify step, then plain sampling."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(V ** 3, dtype=np.int64)
    for _ in range(n):
        draft, q = draft_fn(rng)
        acc = scorer.accept(draft, rows_for(draft), q, rng)
        toks = acc.tokens(draft)
        while len(toks) < 3:
            toks.append(int(rng.choice(V, p=target(tuple(toks)))))
        counts[toks[0] * V * V + toks[1] * V + toks[2]] += 1
    return counts


def expected_three() -> np.ndarray:
    e = np.zeros(V ** 3)
    for a in range(V):
        for b in range(V):
            for c in range(V):
                e[a * V * V + b * V + c] = (target(())[a] * target((a,))[b]
                                            * target((a, b))[c])
    return e


def chi2_pvalue(counts: np.ndarray) -> float:
    """Chi-square p-value of first-three-token counts against the exact distribution."""
    from scipy import stats

    e = expected_three() * counts.sum()
    keep = e >= 5  # pool rare cells
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(e[keep], e[~keep].sum())
    return float(stats.chisquare(obs, exp).pvalue)


def sampled_chain(rng):
    q = rng.dirichlet(np.ones(V), size=3)
    toks = np.array([rng.choice(V, p=q[i]) for i in range(3)])
    return Draft.chain(toks), q


@lru_cache(maxsize=None)
def draft_model(prefix: tuple[int, ...]) -> np.ndarray:
    """A toy draft model correlated with ``target``: its square plus noise,
    normalised, so a model's likely tokens are the target's likely ones."""
    seed = zlib.crc32(("draft" + repr(prefix)).encode())
    q = target(prefix) ** 2 + 0.05 * np.random.default_rng(seed).dirichlet(np.ones(V))
    q = q / q.sum()
    q.setflags(write=False)
    return q


def ranked_draft(parents):
    """A draft function (``rng -> (draft, None)``) of a deterministic proposer:
    the tree ``parents`` filled from ``draft_model`` by prefix, the i-th child
    of a node carrying the draft model's i-th most likely token. Unlike a
    uniformly random draft (over which leaving a rejected token in the
    residual averages out exactly), it drafts the target's likely tokens, as
    real proposers do, so a residual bug biases the emitted tokens."""
    parents = np.asarray(parents)
    toks: list[int] = []
    prefixes: list[tuple[int, ...]] = []
    seen: dict[int, int] = {}
    for p in parents:
        pre = prefixes[p] if p >= 0 else ()
        rank = seen.get(int(p), 0)
        seen[int(p)] = rank + 1
        toks.append(int(np.argsort(-draft_model(pre), kind="stable")[rank]))
        prefixes.append(pre + (toks[-1],))
    draft = Draft(np.array(toks), parents)
    return lambda rng: (draft, None)


# Tolerance: the chi-square p-value of 12,000 samples of the first three tokens
# against the exact distribution must exceed 1e-3; plain sampling passes the
# same test (test_plain_sampling_passes_the_same_test) and a biased rule fails.
N = 12000
ALPHA = 1e-3


# ------------------------------------------------------------ EAGLE heads
#: Tolerances of structural head tests, run in float64: exact up to rounding.
F64 = dict(atol=1e-10, rtol=1e-10)


def small_config(**kw):
    """A small Llama-shaped EAGLE-1 head config (h 64, 4/2 heads, vocab 50)."""
    from vllm_specplug.eagle import EagleHeadConfig

    base = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                vocab_size=50, attention_bias=False, max_position_embeddings=512)
    base.update(kw)
    return EagleHeadConfig(**base)


def random_head(cfg, seed: int = 0, dtype=None):
    """An ``EagleHead`` with N(0, 0.2) weights (float32 unless ``dtype``), in eval mode."""
    import torch

    from vllm_specplug.eagle import EagleHead

    torch.manual_seed(seed)
    head = EagleHead(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    return head.to(dtype or torch.float32).eval()


def rewrite_weights(path, change) -> None:
    """``change(tensors)`` applied to a head folder's model.safetensors."""
    from safetensors.torch import load_file, save_file

    t = load_file(str(path / "model.safetensors"))
    change(t)
    save_file(t, str(path / "model.safetensors"))


def both_fail(path, match, **kw):
    """``load_head`` and ``check_head_folder`` both refuse a head folder with a
    message matching ``match``; returns both messages."""
    import pytest

    from vllm_specplug.eagle import check_head_folder, load_head
    from vllm_specplug.options import SpecPlugConfigError

    with pytest.raises(SpecPlugConfigError, match=match) as e1:
        load_head(path, **kw)
    target = {"hidden_size": kw["hidden_size"]} if "hidden_size" in kw else None
    if "vocab_size" in kw:
        target = {**(target or {}), "vocab_size": kw["vocab_size"]}
    with pytest.raises(SpecPlugConfigError, match=match) as e2:
        check_head_folder(path, target)
    return str(e1.value), str(e2.value)


def bin_folder(saved, tmp_path, obj):
    """A head folder holding ``obj`` as a torch-pickled pytorch_model.bin
    (with ``saved``'s config.json)."""
    import torch

    _, _, path = saved
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text((path / "config.json").read_text())
    torch.save(obj, folder / "pytorch_model.bin")
    return folder


def head_inputs(cfg, T, seed=1, dtype=None):
    """Random (embeddings, features) rows for a head: two [T, hidden] tensors."""
    import torch

    g = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.float32
    return (torch.randn(T, cfg.hidden_size, generator=g, dtype=dtype),
            torch.randn(T, cfg.hidden_size, generator=g, dtype=dtype))


def compare_with_hf_layer(head, layer, rope, start: int, change=None) -> float:
    """The head's forward over 9 random rows at positions ``start, start+1, ...``
    against a transformers decoder layer (input norm replaced by Identity, as
    vLLM's EAGLE-1 layer 0) fed by the head's ``fc`` and loaded with its
    weights (``change(name, tensor)`` alters them first). Returns the max error."""
    import torch

    missing = layer.load_state_dict(
        {k[len("layers.0."):]: (v if change is None else change(k, v))
         for k, v in head.state_dict().items() if k.startswith("layers.")},
        strict=False)
    assert missing.missing_keys == ["input_layernorm.weight"] and not missing.unexpected_keys
    layer.input_layernorm = torch.nn.Identity()
    T = 9
    e, f = head_inputs(head.config, T, seed=start)
    pos = torch.arange(start, start + T)  # an offset start: RoPE must use the given positions
    with torch.no_grad():
        x = head.fc(torch.cat((e, f), -1))[None]
        cos, sin = rope(x, pos[None])
        causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
        ref = layer(x, attention_mask=causal, position_ids=pos[None],
                    position_embeddings=(cos, sin))
        ref = ref[0] if isinstance(ref, tuple) else ref
        ours, _, _ = head(e, f, pos)
    torch.testing.assert_close(ours, ref[0], atol=2e-5, rtol=1e-5)
    return (ours - ref[0]).abs().max().item()


def brute_support(text, draft):
    """Per draft token: the longest suffix of text + draft through it that
    occurs somewhere in text (brute force of ``SuffixAutomaton.support``)."""
    out = []
    for i in range(len(draft)):
        seq, best = list(text) + list(draft[:i + 1]), 0
        for n in range(1, len(seq) + 1):
            if any(list(text[j:j + n]) == seq[-n:] for j in range(len(text) - n + 1)):
                best = n
            else:
                break
        out.append(best)
    return out
