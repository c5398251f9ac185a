"""Property tests of the online suffix automaton against brute force.

Pure Python, no vLLM. The brute-force references below read the definitions
directly off the token list:

* after appending seq[i], the *match* is the longest suffix of seq[:i+1] that
  also occurs ending at an earlier position j < i;
* ``match_end()`` is an end position of such an earlier occurrence (the first);
* ``continuation`` returns what follows the first earlier occurrence of a
  suffix of the text of the returned length.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_specplug.proposers.suffix_automaton import SuffixAutomaton

FAST = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------- strategies
@st.composite
def small_alphabet_seqs(draw, max_len: int = 80):
    k = draw(st.integers(1, 5))
    return draw(st.lists(st.integers(0, k - 1), max_size=max_len))


@st.composite
def large_alphabet_seqs(draw, max_len: int = 80):
    # token ids as a tokenizer produces them: a large vocabulary, sometimes
    # with a few ids reused often (so matches still happen).
    if draw(st.booleans()):
        vocab = draw(st.lists(st.integers(0, 200_000), min_size=1, max_size=12, unique=True))
        return draw(st.lists(st.sampled_from(vocab), max_size=max_len))
    return draw(st.lists(st.integers(0, 2**31 - 1), max_size=max_len))


any_seqs = st.one_of(small_alphabet_seqs(), large_alphabet_seqs())


# --------------------------------------------------------------- brute force
def common_suffix_len(seq, a: int, b: int) -> int:
    """Length of the longest common suffix of seq[:a+1] and seq[:b+1] (a < b)."""
    n = 0
    while n <= a and seq[a - n] == seq[b - n]:
        n += 1
    return n


def bf_match_len(seq, i: int) -> int:
    """Longest suffix of seq[:i+1] that also ends at some earlier j < i."""
    return max((common_suffix_len(seq, j, i) for j in range(i)), default=0)


def occurs_ending_at(seq, e: int, i: int, length: int) -> bool:
    """seq[e-length+1 : e+1] == seq[i-length+1 : i+1] (both in range)."""
    return (length <= e + 1 and length <= i + 1
            and seq[e - length + 1:e + 1] == seq[i - length + 1:i + 1])


def first_earlier_end(seq, length: int) -> int:
    """First end position e < len(seq)-1 of the suffix of this length (-1: none)."""
    i = len(seq) - 1
    for e in range(length - 1, i):
        if occurs_ending_at(seq, e, i, length):
            return e
    return -1


# ------------------------------------------------------------------- match
def check_matches(seq) -> SuffixAutomaton:
    sa = SuffixAutomaton()
    for i, t in enumerate(seq):
        sa.append(t)
        assert len(sa) == i + 1
        expected = bf_match_len(seq, i)
        assert sa.match_len == expected, (seq[:i + 1], sa.match_len, expected)
        if expected > 0:
            e = sa.match_end()
            assert 0 <= e < i
            assert occurs_ending_at(seq, e, i, expected), (seq[:i + 1], e, expected)
            # the documented end is the *first* earlier occurrence
            assert e == first_earlier_end(seq[:i + 1], expected)
        else:
            assert sa.match_end() == -1
    return sa


@FAST
@given(small_alphabet_seqs())
def test_match_len_small_alphabet(seq):
    check_matches(seq)


@FAST
@given(large_alphabet_seqs())
def test_match_len_large_alphabet(seq):
    check_matches(seq)


@pytest.mark.parametrize("seq, expected", [
    ([], []),
    ([5], [0]),
    ([1, 1, 1, 1], [0, 1, 2, 3]),
    ([1, 2, 3, 1, 2, 3, 4], [0, 0, 0, 1, 2, 3, 0]),
    ([1, 2, 1, 3, 1, 2, 1], [0, 0, 1, 0, 1, 2, 3]),
])
def test_match_len_examples(seq, expected):
    sa = SuffixAutomaton()
    got = []
    for t in seq:
        sa.append(t)
        got.append(sa.match_len)
    assert got == expected


def test_empty_automaton():
    sa = SuffixAutomaton()
    assert len(sa) == 0
    assert sa.match_len == 0
    assert sa.match_end() == -1
    assert sa.num_states == 1
    assert sa.continuation(5) == (0, [])
    assert sa.continuation(5, min_match=1) == (0, [])


# ------------------------------------------------------------- continuation
def check_continuation(seq, max_tokens: int, min_match: int) -> None:
    sa = SuffixAutomaton(seq)
    n = len(seq)
    length, tokens = sa.continuation(max_tokens, min_match)
    assert isinstance(tokens, list)
    assert all(isinstance(t, int) for t in tokens)
    if sa.match_len < min_match or max_tokens <= 0:
        assert tokens == []
        return
    # a match of at least min_match exists: there is always >= 1 token after it
    assert 1 <= len(tokens) <= max_tokens
    assert min_match <= length <= sa.match_len
    # tokens follow the first earlier occurrence of the length-`length` suffix
    e = first_earlier_end(seq, length)
    assert 0 <= e < n - 1
    assert tokens == seq[e + 1:e + 1 + max_tokens]
    # a shorter match is used only when the longest one has too few tokens after it
    if length < sa.match_len:
        e_long = first_earlier_end(seq, sa.match_len)
        assert n - 1 - e_long < max_tokens


@FAST
@given(any_seqs, st.integers(-1, 12), st.integers(1, 6))
def test_continuation_follows_an_earlier_occurrence(seq, max_tokens, min_match):
    check_continuation(seq, max_tokens, min_match)


@FAST
@given(small_alphabet_seqs(), st.data())
def test_continuation_at_every_prefix(seq, data):
    # the online automaton answers continuation queries between appends
    sa = SuffixAutomaton()
    for i, t in enumerate(seq):
        sa.append(t)
        max_tokens = data.draw(st.integers(1, 10), label="max_tokens")
        min_match = data.draw(st.integers(1, 4), label="min_match")
        length, tokens = sa.continuation(max_tokens, min_match)
        assert (length, tokens) == SuffixAutomaton(seq[:i + 1]).continuation(
            max_tokens, min_match)
        if sa.match_len < min_match:
            assert tokens == []
        else:
            assert 1 <= len(tokens) <= max_tokens
            e = first_earlier_end(seq[:i + 1], length)
            assert tokens == seq[e + 1:e + 1 + len(tokens)]


def test_continuation_example():
    seq = [1, 2, 3, 4, 5, 1, 2, 3]
    sa = SuffixAutomaton(seq)
    assert sa.match_len == 3
    assert sa.match_end() == 2
    assert sa.continuation(3, 2) == (3, [4, 5, 1])
    assert sa.continuation(10, 2) == (3, [4, 5, 1, 2, 3])
    assert sa.continuation(10, 4) == (3, [])
    assert sa.continuation(0, 1) == (3, [])


def test_continuation_walks_to_a_shorter_match():
    # The longest match [5, 7, 9] first ends at 8, with only 3 tokens after it;
    # the shorter match [7, 9] first ends at 1, with plenty after it.
    seq = [7, 9, 0, 0, 0, 0, 5, 7, 9, 5, 7, 9]
    sa = SuffixAutomaton(seq)
    assert sa.match_len == 3
    assert sa.match_end() == 8
    assert sa.continuation(1, 2) == (3, [5])
    assert sa.continuation(3, 2) == (3, [5, 7, 9])
    assert sa.continuation(4, 2) == (2, [0, 0, 0, 0])
    # with min_match 3 it may not shorten: the few tokens there are
    assert sa.continuation(4, 3) == (3, [5, 7, 9])


# ------------------------------------------------------- constructor == append
@FAST
@given(any_seqs)
def test_constructor_equals_appending(seq):
    built = SuffixAutomaton(seq)
    appended = SuffixAutomaton()
    for t in seq:
        appended.append(t)
    extended = SuffixAutomaton()
    half = len(seq) // 2
    extended.extend(seq[:half])
    extended.extend(iter(seq[half:]))
    for other in (appended, extended):
        assert list(other.tokens) == list(built.tokens) == list(seq)
        assert other.match_len == built.match_len
        assert other.match_state == built.match_state
        assert other.match_end() == built.match_end()
        assert other.num_states == built.num_states
        assert other.link_steps == built.link_steps
        assert other.nbytes() == built.nbytes()
        for max_tokens in (1, 3, 8):
            for min_match in (1, 2, 3):
                assert (other.continuation(max_tokens, min_match)
                        == built.continuation(max_tokens, min_match))


def test_numpy_tokens_are_accepted():
    np = pytest.importorskip("numpy")
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 1, 4, 1, 5]
    a = SuffixAutomaton(np.asarray(seq, dtype=np.int32))
    b = SuffixAutomaton(seq)
    assert list(a.tokens) == seq
    assert (a.match_len, a.continuation(4, 1)) == (b.match_len, b.continuation(4, 1))


# ------------------------------------------------------------- size and time
LINK_STEPS_PER_TOKEN = 4


def _check_linear(seq) -> SuffixAutomaton:
    sa = SuffixAutomaton(seq)
    n = len(seq)
    assert len(sa) == n
    assert sa.link_steps <= LINK_STEPS_PER_TOKEN * n, sa.link_steps / n
    assert sa.num_states <= 2 * n
    return sa


@pytest.mark.parametrize("alphabet", [2, 32_000])
def test_linear_on_100k_random_tokens(alphabet):
    rng = random.Random(1234 + alphabet)
    seq = [rng.randrange(alphabet) for _ in range(100_000)]
    _check_linear(seq)


@pytest.mark.parametrize("pattern", [[7], [1, 2, 3], [4, 8, 15, 16, 23, 42, 4, 8]])
def test_linear_on_100k_repetitive_tokens(pattern):
    seq = (pattern * (100_000 // len(pattern) + 1))[:100_000]
    sa = _check_linear(seq)
    # a periodic text matches itself: the match is everything after the first period
    assert sa.match_len == len(seq) - len(pattern)
    # and the draft continues the period
    n, p = len(seq), len(pattern)
    _, tokens = sa.continuation(5, 1)
    assert tokens == [pattern[(n + k) % p] for k in range(5)]


@FAST
@given(any_seqs)
def test_size_bounds_small(seq):
    sa = SuffixAutomaton(seq)
    n = len(seq)
    assert sa.num_states <= max(1, 2 * n)
    assert sa.link_steps <= LINK_STEPS_PER_TOKEN * n
    assert sa.nbytes() > 0
