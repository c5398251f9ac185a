"""Seeded verification replays plain decoding's draws (vllm_adapter/v1/seeded.py).

A fake target (logits a function of the prefix) and a torch.Generator: plain
decoding samples one position at a time with the generator; speculative
decoding drafts (random, correct, partly correct; chains and trees) and
verifies with ``accept_sampled``. The emitted tokens must be plain's, token
for token, and the generator must end where plain's is after as many tokens.
Each sampler is the real draw of a plain step: vLLM's own
``TopKTopPSampler`` (what its CPU sampler runs) and the exponential race of
``random_sample`` (its native path: ``argmax(probs / q)``).
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from vllm_specplug.proposers.base import Draft
from vllm_specplug.vllm_adapter.v1.seeded import accept_sampled, row_prefixes, row_sampler

VOCAB = 16
PROMPT = [3, 1, 4]


def target_logits(prefix: list[int]) -> torch.Tensor:
    """A peaked distribution that depends on the whole prefix."""
    h = int.from_bytes(hashlib.sha256(bytes(prefix)).digest()[:8], "little")
    g = torch.Generator().manual_seed(h)
    x = torch.randn(VOCAB, generator=g) * 2.5
    return x


def exponential_race(logits: torch.Tensor, generators: dict, k, p):
    """vLLM's ``random_sample`` for rows that all have a generator."""
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    q = torch.empty_like(probs)
    for i, gen in generators.items():
        q[i].exponential_(generator=gen)
    return probs.div(q).argmax(dim=-1).view(-1), None


def vllm_sampler():
    from vllm.platforms import current_platform
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    current_platform.import_kernels()
    return TopKTopPSampler()


@pytest.fixture(params=["vllm", "exponential"], scope="module")
def sampler(request):
    return vllm_sampler() if request.param == "vllm" else exponential_race


def plain(sampler, n: int, seed: int) -> tuple[list[int], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(n):
        tok, _ = sampler(target_logits(PROMPT + out)[None].clone(), {0: gen}, None, None)
        out.append(int(tok[0]))
    return out, gen.get_state()


def make_draft(kind: str, future: list[int], rng: np.random.Generator) -> Draft:
    """A draft for the next positions; ``future``: plain's next tokens."""
    k = 5
    rand = [int(t) for t in rng.integers(0, VOCAB, k)]
    if kind == "random":
        return Draft(np.array(rand), np.arange(-1, k - 1))
    if kind == "correct":
        return Draft(np.array(future[:k]), np.arange(-1, len(future[:k]) - 1))
    if kind == "partly":
        cut = int(rng.integers(0, k))
        toks = future[:cut] + rand[cut:]
        return Draft(np.array(toks), np.arange(-1, len(toks) - 1))
    # tree: at each depth the right child among random siblings (sometimes
    # missing), the right one at a random place in the flattened order
    toks, parents = [], []
    parent = -1
    for depth in range(min(4, len(future))):
        sibs = [int(t) for t in rng.integers(0, VOCAB, 2) if int(t) != future[depth]]
        right = rng.random() < 0.7
        kids = sibs + ([future[depth]] if right else [])
        rng.shuffle(kids)
        nxt = None
        for t in kids:
            toks.append(t)
            parents.append(parent)
            if t == future[depth] and right:
                nxt = len(toks) - 1
        if nxt is None:
            break
        parent = nxt
    return Draft(np.array(toks), np.array(parents))


def speculative(sampler, n: int, seed: int, kind: str, future: list[int]
                ) -> tuple[list[int], torch.Tensor, int]:
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    out: list[int] = []
    accepted = 0
    while len(out) < n:
        draft = make_draft(kind, future[len(out):], rng)
        rows = torch.stack([target_logits(PROMPT + out + p) for p in row_prefixes(draft)])
        acc = accept_sampled(draft, row_sampler(sampler, rows, gen))
        accepted += len(acc.path)
        out += acc.tokens(draft)
    return out, gen.get_state(), accepted


@pytest.mark.parametrize("kind", ["random", "correct", "partly", "tree"])
@pytest.mark.parametrize("seed", [0, 1234, 99])
def test_replay_emits_plain_decodings_tokens(sampler, kind, seed):
    want, _ = plain(sampler, 60, seed)
    got, state, accepted = speculative(sampler, 40, seed, kind, want)
    assert got == want[: len(got)]
    # the generator made exactly one draw per emitted token, as plain's
    _, plain_state = plain(sampler, len(got), seed)
    assert torch.equal(state, plain_state)
    if kind != "random":
        assert accepted >= 10, accepted  # drafts were accepted: identity is not trivial


def test_a_different_seed_gives_different_text(sampler):
    """The oracle can tell seeds apart (a replay ignoring the seed fails)."""
    assert plain(sampler, 40, 0)[0] != plain(sampler, 40, 1)[0]


def test_row_prefixes_follow_the_tree():
    d = Draft(np.array([7, 8, 9, 10]), np.array([-1, -1, 0, 2]))
    assert row_prefixes(d) == [[], [7], [8], [7, 9], [7, 9, 10]]


# ------------------------------------------- plain_logits against vLLM's Sampler
def _metadata(row_outputs: list[list[int]], gen: torch.Generator, vocab: int, *,
              top_k: int, top_p: float, penalties: bool, bad_words, allowed):
    """vLLM 0.32 ``SamplingMetadata`` of one request (batch row 0) whose
    committed output is ``row_outputs[0]``."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    one = lambda v, dt=torch.float32: torch.tensor([v], dtype=dt)  # noqa: E731
    mask = None
    if allowed is not None:
        mask = torch.ones(1, vocab, dtype=torch.bool)
        mask[0, allowed] = False
    return SamplingMetadata(
        temperature=one(0.7), all_greedy=False, all_random=True,
        top_p=one(top_p) if top_p < 1 else None,
        top_k=one(top_k, torch.int32) if top_k else None,
        generators={0: gen}, max_num_logprobs=None,
        no_penalties=not penalties,
        prompt_token_ids=torch.tensor([[5, 6, 7, 5]]),
        frequency_penalties=one(1.5), presence_penalties=one(2.0),
        repetition_penalties=one(2.0),
        output_token_ids=row_outputs, allowed_token_ids_mask=mask,
        bad_words_token_ids={0: bad_words} if bad_words else {},
        logitsprocs=LogitsProcessors())


@pytest.mark.parametrize("case", ["temperature", "top_k", "top_p", "penalties", "bad_words",
                                  "allowed", "all"])
def test_plain_logits_are_the_plain_samplers(case):
    """Each drafted position's row processed by ``plain_logits`` and drawn by
    ``row_sampler`` gives the token vLLM's own ``Sampler`` gives in the plain
    step at that position (output tokens = committed + the drafts before it),
    with the same generator state; for every option plain_logits reproduces."""
    from vllm import SamplingParams
    from vllm.v1.sample.sampler import Sampler

    from vllm_specplug.vllm_adapter.v1.seeded import plain_logits

    vllm_sampler()  # the CPU kernels
    vocab = 64
    opts = dict(top_k=0, top_p=1.0, penalties=False, bad_words=None, allowed=None)
    if case in ("top_k", "all"):
        opts["top_k"] = 12
    if case in ("top_p", "all"):
        opts["top_p"] = 0.8
    if case in ("penalties", "all"):
        opts["penalties"] = True
    if case in ("bad_words", "all"):
        opts["bad_words"] = [[9], [11, 12], [3, 4, 13]]
    if case in ("allowed", "all"):
        opts["allowed"] = list(range(0, vocab, 3))
    # drafts that the penalties and the bad words [3, 4, 13] and [11, 12]
    # reach only through the drafted prefix (rows 2 and 3)
    committed = [5, 6, 3]
    draft = [4, 11, 20, 13, 12, 21]
    raw = torch.randn(len(draft) + 1, vocab, generator=torch.Generator().manual_seed(7))
    raw[:, draft] += 2.0   # the drafted tokens are likely winners: penalties matter
    raw[1, 13] += 6.0      # banned at row 1 (after 3, 4) and row 2 (after 11) only
    raw[2, 12] += 6.0
    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)
        want = []
        for j in range(len(draft) + 1):
            sm = _metadata([committed + draft[:j]], gen, vocab, **opts)
            want.append(int(Sampler()(raw[j: j + 1].clone(), sm).sampled_token_ids[0, 0]))
        gen2 = torch.Generator().manual_seed(seed)
        sm = _metadata([committed], gen2, vocab, **opts)
        x = plain_logits(sm, 0, SamplingParams(), committed, raw,
                         [draft[:j] for j in range(len(draft) + 1)])
        sample = row_sampler(vllm_sampler(), x, gen2)
        assert [sample(j) for j in range(len(draft) + 1)] == want, (case, seed)
