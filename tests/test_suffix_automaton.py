"""Property tests of the online suffix automaton against brute force.

Pure Python, no vLLM. The brute-force references below read the definitions
directly off the token list:

* after appending seq[i], the *match* is the longest suffix of seq[:i+1] that
  also occurs ending at an earlier position j < i;
* ``match_end()`` is an end position of such an earlier occurrence (the first);
* ``continuation`` returns what follows the first earlier occurrence of a
  suffix of the text of the returned length;
* ``frequent_continuation`` takes, step by step, a most frequent token after
  the occurrences of its context (the match and the tokens drafted so far, or,
  where nothing follows that, a shorter suffix of it: see ``walk_contexts``).
"""
from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import brute_support

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


# ------------------------------------------------------ frequent continuation
EXACT = 10 ** 6  # a count depth past any test text: occurrence counts are exact


def occurrence_starts(text, x) -> list[int]:
    m = len(x)
    return [s for s in range(len(text) - m + 1) if text[s:s + m] == x]


def end_positions(text, c) -> frozenset:
    """endpos(c): where the occurrences of c in text end (-1 too for the empty string)."""
    if not c:
        return frozenset(range(-1, len(text)))
    return frozenset(s + len(c) - 1 for s in occurrence_starts(text, c))


def next_counts(text, c) -> Counter:
    """How often each token follows an occurrence of c in text."""
    return Counter(text[e + 1] for e in end_positions(text, c) if e + 1 < len(text))


def shorter_context(text, c):
    """The longest proper suffix of c with other end positions than c (the
    longest string of the suffix-link state), or [] (the root) if none."""
    ep = end_positions(text, c)
    for length in range(len(c) - 1, 0, -1):
        if end_positions(text, c[len(c) - length:]) != ep:
            return c[len(c) - length:]
    return []


def walk_contexts(text, x, tokens, min_match: int):
    """The contexts of the walk from x that drafted ``tokens``: before step i the
    context is what was walked so far (x, then each drafted token appended); when
    nothing follows it in the text, it falls back to shorter_context while that is
    not the root and at least min_match long. Yields (context, counts) for each
    step, then (None or the context, counts) where the walk stopped; the context
    is None when it ran out of continuations."""
    c = list(x)
    for i in range(len(tokens) + 1):
        counts = next_counts(text, c)
        while not counts:
            c = shorter_context(text, c)
            if not c or len(c) < min_match:
                yield None, Counter()
                return
            counts = next_counts(text, c)
        yield c, counts
        if i < len(tokens):
            c = c + [tokens[i]]


def check_frequent_walk(text, x, tokens, probs, max_tokens: int, min_prob: float,
                        min_match: int) -> None:
    """The walk from x in text against brute force: each token is a most
    frequent token following the walk's context (x and the tokens so far, or,
    where nothing follows that, its shorter_context), its share is that count
    over all continuations, and the walk stops at max_tokens, where no context of
    at least min_match tokens (and not empty) is continued, or where the best
    share < min_prob. Needs exact counts."""
    assert isinstance(tokens, list) and isinstance(probs, list)
    assert all(isinstance(t, int) for t in tokens)
    assert len(tokens) == len(probs) <= max(max_tokens, 0)
    assert occurrence_starts(text, list(x)), "the matched string must occur in the text"
    p = 1.0
    steps = list(walk_contexts(text, x, tokens, min_match))
    assert len(steps) == len(tokens) + 1, (x, tokens, steps)  # no step from a dead end
    for i, t in enumerate(tokens):
        c, counts = steps[i]
        best, total = max(counts.values()), sum(counts.values())
        assert counts[t] == best, (c, t, counts)  # a most frequent next token
        share = best / total
        assert share >= min_prob
        p *= share
        assert probs[i] == pytest.approx(p, rel=1e-12)
    if len(tokens) < max_tokens:  # stopped early: why
        c, counts = steps[-1]
        assert c is None or max(counts.values()) / sum(counts.values()) < min_prob, (c, counts)


PROBS = st.sampled_from([0.0, 0.2, 0.25, 1 / 3, 0.5, 0.51, 2 / 3, 1.0])


@FAST
@given(small_alphabet_seqs(max_len=50), st.data())
def test_frequent_continuation_against_brute_force(seq, data):
    sa = SuffixAutomaton(count_depth=EXACT)
    for i, t in enumerate(seq):
        sa.append(t)
        assert sa.match_len == bf_match_len(seq, i)
        max_tokens = data.draw(st.integers(-1, 10), label="max_tokens")
        min_prob = data.draw(PROBS, label="min_prob")
        min_match = data.draw(st.integers(1, 3), label="min_match")
        tokens, probs = sa.frequent_continuation(max_tokens, min_prob, min_match)
        if sa.match_len < min_match or max_tokens <= 0:
            assert (tokens, probs) == ([], [])
            continue
        text = seq[:i + 1]
        x = text[len(text) - sa.match_len:]
        check_frequent_walk(text, x, tokens, probs, max_tokens, min_prob, min_match)
        # the match occurred earlier, so at least one token follows it
        if min_prob == 0.0:
            assert len(tokens) >= 1


@FAST
@given(small_alphabet_seqs(max_len=50), st.integers(1, 10), PROBS)
def test_frequent_continuation_from_the_root(seq, max_tokens, min_prob):
    # min_match 0 with an empty match walks from the empty string: every
    # position is an occurrence
    sa = SuffixAutomaton(seq, count_depth=EXACT)
    tokens, probs = sa.frequent_continuation(max_tokens, min_prob, 0, match=(0, 0))
    check_frequent_walk(seq, [], tokens, probs, max_tokens, min_prob, 0)


def test_frequent_continuation_example():
    # [1] is followed by 2 once and by 3 twice; [1, 3] by 4 twice; [1, 3, 4] by
    # 9 and by 1 (a tie at 1/2); then the walk is forced up to the end of the
    # text: [1, 3, 4, 9, 1, 3, 4, 1] occurs only there, so the walk falls back to
    # its longest suffix that occurs elsewhere, the match [1], and goes on (3 at 2/3)
    seq = [1, 2, 1, 3, 4, 9, 1, 3, 4, 1]
    sa = SuffixAutomaton(seq, count_depth=EXACT)
    assert sa.match_len == 1
    tokens, probs = sa.frequent_continuation(8, 0.0)
    assert tokens == [3, 4, 9, 1, 3, 4, 1, 3]
    assert probs == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 2 / 9])
    # min_prob bounds each step's share (2/3, 1, 1/2, 1, 1, 1, 1, 2/3), not their product
    assert sa.frequent_continuation(8, 0.5)[0] == tokens
    assert sa.frequent_continuation(7, 0.0)[0] == tokens[:7]
    assert sa.frequent_continuation(8, 0.51) == ([3, 4], pytest.approx([2 / 3, 2 / 3]))
    assert sa.frequent_continuation(8, 0.7) == ([], [])
    assert sa.frequent_continuation(1, 0.0) == ([3], pytest.approx([2 / 3]))
    assert sa.frequent_continuation(0, 0.0) == ([], [])
    assert sa.frequent_continuation(8, 0.0, min_match=2) == ([], [])
    # the default depth used by SamProposer counts these short texts exactly
    assert SuffixAutomaton(seq, count_depth=32).frequent_continuation(8, 0.0)[0] == tokens


def test_frequent_continuation_needs_counts():
    sa = SuffixAutomaton([1, 2, 1])
    with pytest.raises(ValueError, match="count_depth"):
        sa.frequent_continuation(4, 0.3)
    # [1] -> 2 -> 1 reaches the end of the text; [1, 2, 1] falls back to [1]
    assert SuffixAutomaton([1, 2, 1], count_depth=1).frequent_continuation(4, 0.3)[0] == [
        2, 1, 2, 1]


@pytest.mark.parametrize("pattern", [[7], [1, 2, 3], [4, 8, 15, 16, 23, 42, 4, 8]])
def test_frequent_continuation_on_a_periodic_text(pattern):
    # the match (all but the first period) occurs once earlier, with one period
    # after it; at the end of the text the walk falls back to the match again
    seq = pattern * 20
    sa = SuffixAutomaton(seq, count_depth=EXACT)
    n, p = len(seq), len(pattern)
    assert sa.match_len == n - p
    tokens, probs = sa.frequent_continuation(30, 0.9)
    assert tokens == [pattern[(n + k) % p] for k in range(30)]
    assert probs == [1.0] * 30
    # a min_match above the match: nothing; at the match: the fallback is allowed
    assert sa.frequent_continuation(30, 0.9, min_match=n - p + 1) == ([], [])
    assert sa.frequent_continuation(30, 0.9, min_match=n - p)[0] == tokens


def test_frequent_continuation_falls_back_only_to_min_match():
    # a query continued in another text: [3, 4, 5] is followed by 6 at the end
    # of the text; [3, 4, 5, 6] occurs nowhere else, and its longest suffix that
    # does is [6] (at the start), followed by 1 2 3 4 5 6, then [6] again
    text = [6, 1, 2, 3, 4, 5, 6]
    sa = SuffixAutomaton(text, count_depth=EXACT)
    s, l = 0, 0
    for t in [9, 3, 4, 5]:
        s, l = sa.advance(s, l, t)
    assert l == 3
    assert sa.frequent_continuation(10, 0.0, 1, match=(s, l)) == (
        [6, 1, 2, 3, 4, 5, 6, 1, 2, 3], [1.0] * 10)
    assert sa.frequent_continuation(10, 0.0, 2, match=(s, l)) == ([6], [1.0])  # [6] < 2
    assert sa.frequent_continuation(10, 0.0, 3, match=(s, l)) == ([6], [1.0])
    assert sa.frequent_continuation(10, 0.0, 4, match=(s, l)) == ([], [])
    # from the root (min_match 0): 6 is the most frequent token (2/7); [6] then
    # [6, 1] ... [6, 1, 2, 3, 4, 5, 6] reach the end, whose longest suffix
    # occurring elsewhere is [6]; never the root
    tokens, probs = sa.frequent_continuation(9, 0.0, 0, match=(0, 0))
    assert tokens == [6, 1, 2, 3, 4, 5, 6, 1, 2]
    assert probs == pytest.approx([2 / 7] * 9)
    # a text whose last token occurs nowhere else: from the root the walk takes
    # 1 (2/3), then 1 or 2 (a tie at 1/2), and stops after 2 (every suffix of a
    # context ending in 2 occurs only at the end: its shorter context is the root)
    sa = SuffixAutomaton([1, 1, 2], count_depth=EXACT)
    tokens, probs = sa.frequent_continuation(5, 0.0, 0, match=(0, 0))
    assert tokens in ([1, 1, 2], [1, 2])
    check_frequent_walk([1, 1, 2], [], tokens, probs, 5, 0.0, 0)


@FAST
@given(small_alphabet_seqs(max_len=60), st.integers(1, 8), PROBS, st.integers(1, 3),
       st.integers(1, 3))
def test_frequent_continuation_with_any_depth_stays_in_the_text(seq, max_tokens, min_prob,
                                                                  depth, min_match):
    # a small count depth undercounts short strings, so the choice may differ
    # from the exact one, but every token followed an occurrence of the walk's
    # context, and the walk ends early only where it may
    sa = SuffixAutomaton(seq, count_depth=depth)
    tokens, probs = sa.frequent_continuation(max_tokens, min_prob, min_match)
    assert len(tokens) == len(probs) <= max_tokens
    if sa.match_len < min_match:
        assert tokens == []
        return
    x = seq[len(seq) - sa.match_len:]
    steps = list(walk_contexts(seq, x, tokens, min_match))
    assert len(steps) == len(tokens) + 1
    for (c, counts), t in zip(steps, tokens):
        assert len(c) >= min_match and counts[t] > 0, (c, t, counts)
    assert all(0 < p <= 1 for p in probs)
    assert all(a >= b for a, b in zip(probs, probs[1:]))
    # the match occurred earlier and is never left for a context below it: the
    # walk goes on (min_prob 0 stops nothing) up to max_tokens
    if min_prob == 0.0:
        assert len(tokens) == max_tokens


@FAST
@given(small_alphabet_seqs(max_len=40), st.integers(1, 8), PROBS)
def test_frequent_continuation_depth_past_the_text_is_exact(seq, max_tokens, min_prob):
    exact = SuffixAutomaton(seq, count_depth=EXACT)
    deep = SuffixAutomaton(seq, count_depth=len(seq) + 1)
    assert deep.frequent_continuation(max_tokens, min_prob) == exact.frequent_continuation(
        max_tokens, min_prob)
    assert deep.num_states == exact.num_states == SuffixAutomaton(seq).num_states
    assert deep.match_len == exact.match_len


# ------------------------------------------- advance: a query against the text
def bf_longest_substring_suffix(text, query) -> int:
    """Longest suffix of query that is a substring of text."""
    for length in range(len(query), 0, -1):
        if occurrence_starts(text, query[len(query) - length:]):
            return length
    return 0


@st.composite
def text_and_query(draw, max_len: int = 40):
    k = draw(st.integers(1, 4))
    text = draw(st.lists(st.integers(0, k - 1), max_size=max_len))
    # the query: pieces of the text and tokens (some not in the text)
    query: list[int] = []
    for _ in range(draw(st.integers(0, 6))):
        if text and draw(st.booleans()):
            a = draw(st.integers(0, len(text) - 1))
            b = draw(st.integers(a, min(len(text), a + 12)))
            query += text[a:b]
        else:
            query += draw(st.lists(st.integers(0, k), max_size=4))
    return text, query


@FAST
@given(text_and_query(), st.data())
def test_advance_matches_a_query_against_another_text(tq, data):
    text, query = tq
    sa = SuffixAutomaton(text, count_depth=EXACT)
    frozen = (list(sa.tokens), sa.num_states, sa.match_state, sa.match_len)
    s, l = 0, 0
    for i, t in enumerate(query):
        s, l = sa.advance(s, l, t)
        assert l == bf_longest_substring_suffix(text, query[:i + 1]), (text, query[:i + 1])
        if l == 0:
            assert s == 0
        x = query[i + 1 - l:i + 1]
        # frequent_continuation from this match walks the other text
        max_tokens = data.draw(st.integers(1, 8), label="max_tokens")
        min_prob = data.draw(PROBS, label="min_prob")
        min_match = data.draw(st.integers(1, 3), label="min_match")
        tokens, probs = sa.frequent_continuation(max_tokens, min_prob, min_match, match=(s, l))
        if l < min_match:
            assert (tokens, probs) == ([], [])
        else:
            check_frequent_walk(text, x, tokens, probs, max_tokens, min_prob, min_match)
        # and so does continuation (first occurrences, shorter matches if needed)
        length, cont = sa.continuation(max_tokens, min_match, match=(s, l))
        if l < min_match:
            assert (length, cont) == (l, [])
            continue
        assert min_match <= length <= l
        e = first_end(text, x[len(x) - length:])
        assert cont == text[e + 1:e + 1 + max_tokens]
        if length < l:
            assert len(text) - 1 - first_end(text, x) < max_tokens
    # matching a query does not change the automaton or its running match
    assert (list(sa.tokens), sa.num_states, sa.match_state, sa.match_len) == frozen


def first_end(text, x) -> int:
    return occurrence_starts(text, x)[0] + len(x) - 1


def test_advance_example():
    sa = SuffixAutomaton([1, 2, 3, 4, 2, 3, 5])
    got = []
    s, l = 0, 0
    for t in [9, 2, 3, 4, 2, 3, 5, 1, 2, 7]:
        s, l = sa.advance(s, l, t)
        got.append(l)
    assert got == [0, 1, 2, 3, 4, 5, 6, 1, 2, 0]  # [1], [1, 2] start the text
    # [2, 3] first occurs ending at 2: continuation(match=...) copies what follows
    s, l = 0, 0
    for t in [8, 2, 3]:
        s, l = sa.advance(s, l, t)
    assert l == 2
    assert sa.continuation(3, 1, match=(s, l)) == (2, [4, 2, 3])
    # at the end of the text: [3, 5] has nothing after it, and [5] neither
    s, l = sa.advance(s, l, 5)
    assert l == 3  # [2, 3, 5]
    assert sa.continuation(3, 1, match=(s, l)) == (3, [])
    # an empty automaton matches nothing
    empty = SuffixAutomaton()
    assert empty.advance(0, 0, 1) == (0, 0)


@FAST
@given(small_alphabet_seqs(max_len=50))
def test_running_match_is_advance_over_the_text_before(seq):
    # the running match after appending t is advance() of the previous match over
    # the automaton before t
    sa = SuffixAutomaton(count_depth=EXACT)
    for t in seq:
        steps = sa.link_steps
        expected = sa.advance(sa.match_state, sa.match_len, t)
        sa.link_steps = steps
        sa.append(t)
        assert sa.match_len == expected[1]



@FAST
@given(small_alphabet_seqs(), st.lists(st.integers(0, 4), max_size=10))
def test_support_against_brute_force(text, draft):
    """What the learned stop rule's ctx_* features read: how much of a draft
    from elsewhere the request's own text supports (a token outside the
    text's alphabet, 4 may be one, gives 0)."""
    sa = SuffixAutomaton(text)
    before = (sa.link_steps, sa.match_state, sa.match_len)
    assert sa.support(draft) == brute_support(text, draft)
    assert (sa.link_steps, sa.match_state, sa.match_len) == before   # a query only
