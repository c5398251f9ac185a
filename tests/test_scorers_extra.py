"""Block verification, typical acceptance, the scorer registry and the example
third-party plugin (loaded through monkeypatched entry points, never installed)."""
from __future__ import annotations

import importlib.metadata
import itertools
import re
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from helpers import ALPHA, N, V, chi2_pvalue, ranked_draft, sample_three, sampled_chain

from vllm_specplug import registry as proposer_registry
from vllm_specplug.options import SpecPlugConfigError
from vllm_specplug.proposers.base import Draft
from vllm_specplug.scorers import BlockScorer, GreedyScorer, RejectionScorer, TypicalScorer
from vllm_specplug.scorers import registry as scorer_registry
from vllm_specplug.scorers.block import block_weights

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "third_party_plugin"


# ------------------------------------------------------------ block verification

# the draft model's greedy chain after the prefix (correlated with the target)
deterministic_chain = ranked_draft([-1, 0, 1])


@pytest.mark.parametrize("scorer, draft_fn", [
    (BlockScorer(), sampled_chain), (BlockScorer(), deterministic_chain),
    (RejectionScorer(), deterministic_chain),  # sampled chains: test_scorers.py
], ids=["block-sampled", "block-deterministic", "rejection-deterministic"])
def test_chain_scorers_are_lossless(scorer, draft_fn):
    """Chi-square of the first three emitted tokens (one verify step, then plain
    sampling) against the exact target distribution; the same test that plain
    sampling passes and a biased rule fails in test_scorers.py."""
    counts = sample_three(scorer, draft_fn, N, seed=11)
    assert chi2_pvalue(counts) > ALPHA


def _model(kind: str, conc: float, vocab: int):
    def dist(prefix: tuple[int, ...]) -> np.ndarray:
        seed = zlib.crc32((kind + repr(prefix)).encode())
        return np.random.default_rng(seed).dirichlet(np.full(vocab, conc))
    return dist


@pytest.mark.parametrize("kind", ["sampled", "deterministic"])
@pytest.mark.parametrize("seed", range(3))
def test_block_weights_give_the_exact_target_distribution(kind, seed):
    """Exact enumeration (no sampling): over every draft X (drawn from a
    prefix-dependent draft model, or its argmax when deterministic) and every
    accepted length tau, P(tau) = h_tau * prod_{j > tau} (1 - h_j) and the
    emitted tokens continued by the target match the target's joint
    distribution to rounding; the expected accepted length is at least
    token-wise rejection's."""
    vocab, g = 3, 3
    P, Q = _model(f"P{seed}", 0.6, vocab), _model(f"Q{seed}", 1.0, vocab)
    length = g + 1

    def target_prob(seq, start=0):
        return np.prod([P(seq[:i])[seq[i]] for i in range(start, len(seq))])

    out = {s: 0.0 for s in itertools.product(range(vocab), repeat=length)}
    e_block = e_token = 0.0
    for X in itertools.product(range(vocab), repeat=g):
        q_rows = np.stack([Q(X[:i]) for i in range(g)])
        if kind == "sampled":
            px = np.prod([q_rows[i][X[i]] for i in range(g)])
            q_arg = q_rows
        else:  # the draft is the draft model's argmax chain, q one-hot
            px = float(all(X[i] == np.argmax(q_rows[i]) for i in range(g)))
            q_rows = np.eye(vocab)[list(X)]
            q_arg = None
        if px == 0:
            continue
        p_rows = np.stack([P(X[:i]) for i in range(g + 1)])
        _, h, residuals = block_weights(np.array(X), p_rows, q_arg)
        for tau in range(g + 1):
            p_tau = (h[tau] if tau else 1.0) * np.prod(1 - h[tau + 1:])
            e_block += px * p_tau * tau
            nxt = p_rows[g] if tau == g else residuals[tau] / max(residuals[tau].sum(), 1e-300)
            for y in range(vocab):
                head = X[:tau] + (y,)
                for rest in itertools.product(range(vocab), repeat=length - len(head)):
                    seq = head + rest
                    out[seq] += px * p_tau * nxt[y] * target_prob(seq, len(head))
        accept_all_so_far = 1.0
        for i in range(g):
            accept_all_so_far *= min(1.0, p_rows[i][X[i]] / q_rows[i][X[i]])
            e_token += px * accept_all_so_far
    worst = max(abs(prob - target_prob(seq)) for seq, prob in out.items())
    assert worst < 1e-12
    assert e_block >= e_token - 1e-12


def _mean_accepted(scorer, P, Q, g, trials, seed):
    """Mean accepted length on chains of g tokens drawn from Q (a draft
    model), verified against P (both prefix -> distribution)."""
    rng = np.random.default_rng(seed)
    total = 0
    for _ in range(trials):
        toks: list[int] = []
        q_rows = []
        for _ in range(g):
            q = Q(tuple(toks))
            q_rows.append(q)
            toks.append(int(rng.choice(q.size, p=q)))
        p_rows = np.stack([P(tuple(toks[:i])) for i in range(g + 1)])
        total += len(scorer.accept(Draft.chain(toks), p_rows, np.stack(q_rows), rng).path)
    return total / trials


def test_block_accepts_more_on_the_papers_example():
    """Sun et al.'s example: P = (1/3, 2/3), Q = (2/3, 1/3) at every position,
    two drafted tokens: 11/9 accepted tokens with block verification, 10/9
    token by token. 6000 trials each: standard error ~0.011 per mean."""
    P = lambda prefix: np.array([1 / 3, 2 / 3])  # noqa: E731
    Q = lambda prefix: np.array([2 / 3, 1 / 3])  # noqa: E731
    block = _mean_accepted(BlockScorer(), P, Q, 2, 6000, seed=1)
    token = _mean_accepted(RejectionScorer(), P, Q, 2, 6000, seed=2)
    assert abs(block - 11 / 9) < 0.05 and abs(token - 10 / 9) < 0.05
    assert block > token + 0.03


def test_block_accepts_at_least_as_many_on_random_models():
    """Prefix-dependent random models, chains of 4; the margin is ~4 standard
    errors of the difference of the two means."""
    P, Q = _model("P-acc", 0.5, 6), _model("Q-acc", 0.5, 6)
    block = _mean_accepted(BlockScorer(), P, Q, 4, 3000, seed=3)
    token = _mean_accepted(RejectionScorer(), P, Q, 4, 3000, seed=4)
    assert block >= token - 0.08


def test_block_falls_back_to_rejection_on_trees():
    d = Draft(np.array([1, 2, 3, 0]), np.array([-1, -1, 0, 2]))
    rng = np.random.default_rng(0)
    for _ in range(50):
        p = rng.dirichlet(np.ones(V), size=len(d) + 1)
        seed = int(rng.integers(1 << 30))
        a = BlockScorer().accept(d, p, None, np.random.default_rng(seed))
        b = RejectionScorer().accept(d, p, None, np.random.default_rng(seed))
        assert a == b


def test_block_cuts_a_draft_at_a_token_of_draft_probability_zero():
    d = Draft.chain([1, 2, 3])
    p = np.zeros((4, V))
    p[:, 1] = p[:, 2] = p[:, 3] = 1 / 3
    q = np.full((3, V), 1 / V)
    q[1, 2] = 0.0   # node 1 claims its token was impossible: never accept it
    rng = np.random.default_rng(0)
    for _ in range(200):
        acc = BlockScorer().accept(d, p, q, rng)
        assert acc.path in ([], [0])


# ------------------------------------------------------------- temperature 0

@st.composite
def one_hot_trees(draw, chain=False):
    """A random tree (siblings carry distinct tokens, as proposers draft them)
    or chain, and one-hot target rows whose argmax often follows a child."""
    n = draw(st.integers(0, 9))
    parents: list[int] = []
    tokens: list[int] = []
    used: dict[int, set[int]] = {}
    for i in range(n):
        open_parents = [p for p in range(-1, i) if len(used.get(p, ())) < V]
        par = i - 1 if chain else draw(st.sampled_from(open_parents))
        tok = draw(st.sampled_from(sorted(set(range(V)) - used.get(par, set()))))
        used.setdefault(par, set()).add(tok)
        parents.append(par)
        tokens.append(tok)
    draft = Draft(np.array(tokens, dtype=np.int32), np.array(parents, dtype=np.int32))
    rows = np.zeros((n + 1, V))
    for r in range(n + 1):
        child_tokens = [tokens[c] for c in range(n) if parents[c] == r - 1]
        choices = st.integers(0, V - 1)
        if child_tokens:
            choices = st.one_of(st.sampled_from(child_tokens), choices)
        rows[r, draw(choices)] = 1.0
    return draft, rows


@settings(max_examples=300, deadline=None)
@given(one_hot_trees(), st.integers(0, 2**32 - 1))
def test_typical_is_greedy_at_temperature_zero(tree, seed):
    draft, rows = tree
    want = GreedyScorer().accept(draft, rows)
    assert TypicalScorer().accept(draft, rows, None, np.random.default_rng(seed)) == want
    assert TypicalScorer().accept(draft, rows) == want


@settings(max_examples=200, deadline=None)
@given(one_hot_trees(chain=True), st.integers(0, 2**32 - 1))
def test_block_is_greedy_at_temperature_zero_on_chains(tree, seed):
    draft, rows = tree
    want = GreedyScorer().accept(draft, rows)
    assert BlockScorer().accept(draft, rows, None, np.random.default_rng(seed)) == want


def test_typical_with_duplicate_siblings_extends_greedy():
    """Siblings 0 and 1 share a token: greedy stops under the first, typical
    finds the longer path under the second; with one model (rows by prefix)
    greedy's tokens are a prefix of typical's."""
    d = Draft(np.array([2, 2, 4]), np.array([-1, -1, 1]))
    rows = np.zeros((4, V))
    rows[0, 2] = rows[1, 4] = rows[2, 4] = rows[3, 1] = 1.0
    g = GreedyScorer().accept(d, rows)
    t = TypicalScorer().accept(d, rows, None, np.random.default_rng(0))
    assert g.path == [0] and t.path == [1, 2]
    assert t.tokens(d)[: len(g.tokens(d))] == g.tokens(d)


# ------------------------------------------------------------- typical, by hand

def test_typical_threshold_adapts_to_entropy():
    # Flat row: entropy 1.55, alpha * exp(-H) = 0.063 < 0.09, so a token with
    # p = 0.08 passes; a peaked row (entropy 0.28) keeps the 0.09 threshold.
    flat = np.array([0.08, 0.23, 0.23, 0.23, 0.23])
    peaked = np.array([0.08, 0.92, 0.0, 0.0, 0.0])
    d = Draft.chain([0])
    rng = np.random.default_rng(0)
    assert TypicalScorer().accept(d, np.stack([flat, flat]), None, rng).path == [0]
    assert TypicalScorer().accept(d, np.stack([peaked, flat]), None, rng).path == []
    # alpha = 1: the fixed threshold 0.05 binds for both rows.
    loose = TypicalScorer(posterior_threshold=0.05, posterior_alpha=1.0)
    assert loose.accept(d, np.stack([flat, flat]), None, rng).path == [0]
    assert loose.accept(d, np.stack([peaked, flat]), None, rng).path == [0]
    assert loose.accept(d, np.stack([np.array([0.04, 0.96, 0, 0, 0]), flat]),
                        None, rng).path == []


def test_typical_takes_the_longest_path_first_on_ties():
    # Root children 0 (token 1) and 1 (token 2) both pass; node 2 under node 1
    # passes too -> path [1, 2]. Then with node 2 failing: a tie at depth 1,
    # the first node (0) wins.
    d = Draft(np.array([1, 2, 3]), np.array([-1, -1, 1]))
    rows = np.full((4, V), 0.2)
    assert TypicalScorer().accept(d, rows, None, np.random.default_rng(0)).path == [1, 2]
    rows[2] = [0.3, 0.3, 0.3, 0.0, 0.1]
    assert TypicalScorer().accept(d, rows, None, np.random.default_rng(0)).path == [0]


def test_typical_bonus_is_sampled_from_the_last_accepted_row():
    d = Draft.chain([1])
    rows = np.array([[0.0, 1.0, 0, 0, 0], [0.5, 0.0, 0.0, 0.5, 0.0]])
    rng = np.random.default_rng(0)
    seen = {TypicalScorer().accept(d, rows, None, rng).bonus for _ in range(200)}
    assert seen == {0, 3}
    assert not TypicalScorer.lossless


# ------------------------------------------------------------- registries

def _ep(name: str, value: str, group: str) -> importlib.metadata.EntryPoint:
    return importlib.metadata.EntryPoint(name=name, value=value, group=group)


@pytest.fixture
def fake_entry_points(monkeypatch):
    """``install(*entry_points)``: the registries see exactly these (the example
    plugin's folder is importable); both registries are reloaded before and after."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    registries = (proposer_registry.PROPOSERS, scorer_registry.SCORERS)

    def install(*eps):
        monkeypatch.setattr(importlib.metadata, "entry_points",
                            lambda group=None: [e for e in eps if e.group == group])
        for r in registries:
            r.reset()

    yield install
    monkeypatch.undo()
    for r in registries:
        r.reset()
    for mod in [m for m in sys.modules if m.startswith("specplug_example")]:
        del sys.modules[mod]


SG, PG = scorer_registry.SCORER_GROUP, proposer_registry.PROPOSER_GROUP
EXAMPLE_EPS = (_ep("example_capped", "specplug_example.scorers:CappedRejectionScorer", SG),
               _ep("example_repeat_ngram", "specplug_example.proposers:RepeatNgramProposer", PG))


def test_broken_entry_points_are_reported_and_the_others_load(fake_entry_points):
    fake_entry_points(
        _ep("boom", "no_such_module_xyz:Scorer", SG),
        _ep("not_a_scorer", "vllm_specplug.proposers.base:Draft", SG),
        _ep("typical", "specplug_example.scorers:CappedRejectionScorer", SG),
        _ep("boom_method", "no_such_module_xyz:P", PG),
        *EXAMPLE_EPS)
    errors = scorer_registry.load_errors()
    assert set(errors) == {"boom", "not_a_scorer", "typical"}
    assert "ModuleNotFoundError" in errors["boom"] and "no_such_module_xyz" in errors["boom"]
    assert "not a vllm_specplug Scorer subclass" in errors["not_a_scorer"]
    assert "taken by a built-in scorer" in errors["typical"]
    assert scorer_registry.scorer_names() == ["block", "example_capped", "greedy",
                                              "rejection", "typical"]
    assert scorer_registry.get_scorer_class("typical") is TypicalScorer
    assert set(proposer_registry.load_errors()) == {"boom_method"}
    assert "example_repeat_ngram" in proposer_registry.proposer_names()
    with pytest.raises(SpecPlugConfigError, match="failed to load: ModuleNotFoundError"):
        scorer_registry.parse_acceptance("boom")


def test_list_shows_scorers_and_failures_of_both_groups(fake_entry_points, capsys):
    from vllm_specplug.cli import print_plugins

    fake_entry_points(_ep("boom", "no_such_module_xyz:S", SG),
                      _ep("boom_method", "no_such_module_xyz:P", PG), *EXAMPLE_EPS)
    print_plugins()
    out = capsys.readouterr().out
    assert "typical  (vllm_specplug.scorers.typical.TypicalScorer), lossless: no" in out
    assert "block  (vllm_specplug.scorers.block.BlockScorer), lossless: yes" in out
    assert "posterior_threshold (float in [0.0, 1.0], default 0.09)" in out
    assert "example_capped  (specplug_example.scorers.CappedRejectionScorer), lossless: yes" in out
    assert "max_accept (int in [0, 128], default 2)" in out
    assert "scorer boom: FAILED TO LOAD: ModuleNotFoundError" in out
    assert "method boom_method: FAILED TO LOAD: ModuleNotFoundError" in out


@pytest.mark.parametrize("value, message", [
    ({"name": "typical", "posterior_threshold": -1}, re.escape(
        "speculative_config['acceptance']['posterior_threshold'] for scorer 'typical' "
        "must be >= 0.0, got -1.0")),
    ({"name": "typical", "posterior_alpha": "x"}, "must be a number"),
    ({"name": "typical", "threshold": 0.1},
     "unknown key 'threshold' .* valid keys: name, posterior_threshold, posterior_alpha"),
    ({"name": "block", "k": 1}, "valid keys: name \\(it has no options\\)"),
    ({"posterior_threshold": 0.1}, "unknown scorer None"),
    ("nope", "unknown scorer 'nope'; scorers: block, greedy, rejection, typical"),
    (3, "must be a scorer name or an object"),
])
def test_bad_acceptance_configs_say_what_to_fix(value, message):
    with pytest.raises(SpecPlugConfigError, match=message):
        scorer_registry.parse_acceptance(value)


def test_acceptance_configs_build_scorers():
    spec = scorer_registry.parse_acceptance({"name": "typical", "posterior_alpha": 0.2})
    assert spec == {"name": "typical",
                    "options": {"posterior_threshold": 0.09, "posterior_alpha": 0.2}}
    scorer = scorer_registry.build_scorer(spec)
    assert isinstance(scorer, TypicalScorer) and scorer.posterior_alpha == 0.2
    for name in ("greedy", "rejection", "block"):
        assert scorer_registry.build_scorer(name).name == name


# ------------------------------------------------------------- example plugin

def test_example_plugin_loads_through_entry_points(fake_entry_points):
    from vllm_specplug.config import build_proposer, translate

    fake_entry_points(*EXAMPLE_EPS)
    assert not scorer_registry.load_errors() and not proposer_registry.load_errors()
    capped = scorer_registry.build_scorer({"name": "example_capped", "max_accept": 1})
    d = Draft(np.array([1, 2, 3]), np.array([-1, 0, -1]))
    rows = np.zeros((4, V))
    rows[0, 1] = rows[1, 2] = rows[2, 0] = rows[3, 0] = 1.0  # would accept [0, 1]
    acc = capped.accept(d, rows, None, np.random.default_rng(0))
    assert acc.path == [0] and acc.bonus == 2

    _, plugin = translate({"method": "example_repeat_ngram", "repeat_n": 3})
    proposer = build_proposer(plugin)
    proposer.start("r", [5, 6, 7, 8])
    assert list(proposer.propose("r", 8).tokens) == [6, 7, 8, 6]   # 4 tokens by default
    proposer.observe("r", [9])
    assert list(proposer.propose("r", 2).tokens) == [7, 8]
    proposer.finish("r")
    assert proposer.active_requests() == 0


def test_example_scorer_is_lossless(fake_entry_points):
    fake_entry_points(*EXAMPLE_EPS)
    capped = scorer_registry.build_scorer({"name": "example_capped", "max_accept": 1})

    tree = ranked_draft([-1, -1, 0, 2])
    assert chi2_pvalue(sample_three(capped, tree, N, seed=5)) > ALPHA


# ------------------------------------------------------------- edge cases
# (each kills mutants that the statistical tests above cannot see; see
# docs/testing.md)

def test_sampling_an_all_zero_distribution_says_so():
    from vllm_specplug.scorers.rejection import _sample

    with pytest.raises(ValueError, match="^cannot sample from an all-zero distribution$"):
        _sample(np.zeros(V), np.random.default_rng(0))


def test_rejection_never_accepts_a_token_of_draft_probability_zero():
    """A sampled child whose draft distribution gives its token probability 0
    (an inconsistent draft) is rejected, even where the target likes it."""
    d = Draft(np.array([1, 2]), np.array([-1, -1]))
    p = np.zeros((3, V))
    p[0, 1] = p[0, 2] = 0.5
    p[1:] = 1.0 / V
    q = np.full((2, V), 0.25)
    q[0, 1] = 0.0
    q[0, 0] = 0.5
    rng = np.random.default_rng(0)
    for _ in range(200):
        assert RejectionScorer().accept(d, p, q, rng).path in ([], [1])


def test_scorers_normalise_their_rows():
    """Target rows scaled by a constant (unnormalised) give the same decisions;
    block verification also normalises draft rows (the scorer interface has
    draft rows normalised, and rejection sampling relies on it)."""
    rng = np.random.default_rng(3)
    chain = Draft.chain([1, 2, 0])
    tree = Draft(np.array([1, 2, 0]), np.array([-1, -1, 0]))
    p = rng.dirichlet(np.full(V, 0.5), size=4)
    q = rng.dirichlet(np.ones(V), size=3)
    got = block_weights(chain.tokens, 3.0 * p, 2.0 * q)
    want = block_weights(chain.tokens, p, q)
    for a, b in zip(got[:2] + tuple(got[2]), want[:2] + tuple(want[2])):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    for scorer in (BlockScorer(), TypicalScorer(), RejectionScorer()):
        for d in (chain, tree):
            for seed in range(20):
                a = scorer.accept(d, 3.0 * p, q, np.random.default_rng(seed))
                b = scorer.accept(d, p, q, np.random.default_rng(seed))
                assert a == b, (scorer.name, seed)


def test_block_weights_h0_is_zero_and_certain_chains_are_finite():
    """h[0] is unused and 0 (as documented); a chain the target is certain of
    (p_i = 1, every residual empty) has h = 0 inside and 1 at the end, with no
    0/0."""
    rows = np.zeros((4, V))
    rows[0, 1] = rows[1, 2] = rows[2, 3] = rows[3, 4] = 1.0
    with np.errstate(all="raise"):
        p, h, _ = block_weights(np.array([1, 2, 3]), rows, None)
    assert p.tolist() == [1, 1, 1, 1] and h.tolist() == [0, 0, 0, 1]
    _, h, _ = block_weights(np.array([1, 2]), np.full((3, V), 1 / V), None)
    assert h[0] == 0 and 0 < h[1] < 1


def test_block_falls_back_to_rejection_with_draft_probabilities():
    d = Draft(np.array([1, 2, 3, 0]), np.array([-1, -1, 0, 2]))
    rng = np.random.default_rng(1)
    for _ in range(50):
        p = rng.dirichlet(np.ones(V), size=len(d) + 1)
        q = rng.dirichlet(np.ones(V), size=len(d))
        seed = int(rng.integers(1 << 30))
        a = BlockScorer().accept(d, p, q, np.random.default_rng(seed))
        b = RejectionScorer().accept(d, p, q, np.random.default_rng(seed))
        assert a == b


def test_typical_thresholds_by_hand():
    """min(threshold, alpha * exp(-entropy)), entropy in nats with 0 log 0 = 0,
    without numpy warnings on zero probabilities; rows are normalised."""
    import warnings

    from vllm_specplug.scorers.typical import typical_thresholds

    rows = np.array([[0.5, 0.5, 0, 0, 0], [0.1, 0.2, 0.3, 0.4, 0.0], [1, 0, 0, 0, 0]])
    h = [np.log(2), -sum(x * np.log(x) for x in (0.1, 0.2, 0.3, 0.4)), 0.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = typical_thresholds(2.0 * rows, 0.4, 0.5)
    np.testing.assert_allclose(got, np.minimum(0.4, 0.5 * np.exp(-np.array(h))), rtol=1e-12)


def test_typical_needs_a_probability_above_the_threshold():
    # [0.25, 0.75]: alpha * exp(-H) = 0.57 > 0.25, so the threshold 0.25 binds;
    # a token of probability exactly 0.25 is not above it
    rows = np.array([[0.25, 0.75, 0, 0, 0], [0.2] * 5])
    d = Draft.chain([0])
    loose = TypicalScorer(posterior_threshold=0.25, posterior_alpha=1.0)
    assert loose.accept(d, rows).path == []
    assert loose.accept(Draft.chain([1]), rows).path == [0]


def test_typical_defaults_are_its_options_defaults():
    t = TypicalScorer()
    for opt in TypicalScorer.options:
        assert getattr(t, opt.name) == opt.default


@pytest.mark.parametrize("value, message", [
    (3, r"^speculative_config\['acceptance'\] must be a scorer name or an object with "
        r"\"name\" and the scorer's options, got 3; scorers: block, greedy, rejection, typical$"),
    ("nope", r"^speculative_config\['acceptance'\]\['name'\]: unknown scorer 'nope'; "
             r"scorers: block, greedy, rejection, typical$"),
    ({"name": ["x"]}, r"^speculative_config\['acceptance'\]\['name'\]: unknown scorer \['x'\]"),
])
def test_acceptance_messages_in_full(value, message):
    with pytest.raises(SpecPlugConfigError, match=message):
        scorer_registry.parse_acceptance(value)


def test_a_broken_plugin_scorer_is_named_without_a_guess(fake_entry_points):
    """A scorer name a plugin registered but failed to load: the message says
    why and offers no "did you mean" (though "blocks" is close to "block")."""
    fake_entry_points(_ep("blocks", "no_such_module_xyz:S", SG))
    with pytest.raises(SpecPlugConfigError) as e:
        scorer_registry.parse_acceptance("blocks")
    msg = str(e.value)
    assert "a plugin registered 'blocks' but it failed to load: ModuleNotFoundError" in msg
    assert msg.endswith("; scorers: block, greedy, rejection, typical"), msg
    with pytest.raises(SpecPlugConfigError, match="did you mean 'block'"):
        scorer_registry.parse_acceptance("blockk")
