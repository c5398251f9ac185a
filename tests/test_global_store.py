"""``proposers.global_store``: the bounded cross-request store, against brute force;
``sam``'s use of it (source choice, commit at completion). No vLLM."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_specplug.bench.simulate import replay, replay_many
from vllm_specplug.proposers.global_store import GlobalMatch, GlobalStore
from vllm_specplug.proposers.sam import SamProposer

docs_st = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=12), max_size=12)
query_st = st.lists(st.integers(0, 3), max_size=10)


# ------------------------------------------------------------ brute force
def brute_segments(docs, max_tokens, num_segments):
    """The ring's rule, written out: the documents of each kept segment."""
    cap = max_tokens // num_segments
    segs: list[list[list[int]]] = []
    for d in docs:
        d = d[-cap:]
        if not d:
            continue
        if not segs or sum(map(len, segs[-1])) + len(d) > cap:
            segs.append([])
            if len(segs) > num_segments:
                segs.pop(0)
        segs[-1].append(list(d))
    return segs


def occurs(u, doc):
    n = len(u)
    return any(doc[i:i + n] == u for i in range(len(doc) - n + 1))


def longest_match(query, docs):
    best = 0
    for n in range(1, len(query) + 1):
        if any(occurs(query[-n:], d) for d in docs):
            best = n
    return best


def next_counts(u, docs):
    counts: dict[int, int] = {}
    n = len(u)
    for d in docs:
        for i in range(len(d) - n):
            if d[i:i + n] == u:
                counts[d[i + n]] = counts.get(d[i + n], 0) + 1
    return counts


def brute_frequent(u, docs, k, min_prob=0.0, min_match=1):
    out = []
    while len(out) < k:
        counts = next_counts(u, docs)
        while not counts:
            # the longest shorter suffix with a continuation
            u = next((u[i:] for i in range(1, len(u)) if next_counts(u[i:], docs)), [])
            if len(u) < min_match or not u:
                return out
            counts = next_counts(u, docs)
        total = sum(counts.values())
        best = min(counts, key=lambda t: (-counts[t], t))
        if counts[best] < min_prob * total:
            return out
        out.append(best)
        u = u + [best]
    return out


def brute_first(u, docs, k):
    for d in docs:
        for i in range(len(d) - len(u) + 1):
            if d[i:i + len(u)] == u:
                return d[i + len(u):i + len(u) + k]
    return []


def brute_best_segment(query, segs):
    """(index, length) of the longest match, the newest segment on a tie."""
    best = (-1, 0)
    for i, seg in enumerate(segs):
        n = longest_match(query, seg)
        if n > 0 and n >= best[1]:
            best = (i, n)
    return best


# ------------------------------------------------------------ properties
@settings(max_examples=300, deadline=None)
@given(docs=docs_st, max_tokens=st.integers(8, 48), num_segments=st.integers(2, 4))
def test_eviction_keeps_exactly_the_newest_segments_within_the_bound(docs, max_tokens,
                                                                      num_segments):
    g = GlobalStore(max_tokens, num_segments=num_segments)
    for d in docs:
        g.add(d)
    segs = brute_segments(docs, max_tokens, num_segments)
    assert g.documents() == [d for seg in segs for d in seg]
    assert g.num_tokens == sum(len(d) for seg in segs for d in seg) <= max_tokens
    assert len(g.segments) <= num_segments
    # the documents kept are the newest ones (a suffix of what was added, each
    # truncated to a segment), and every document newer than the oldest kept
    # segment's is there
    added = [d[-(max_tokens // num_segments):] for d in docs if d]
    kept = g.documents()
    assert added[len(added) - len(kept):] == kept


@settings(max_examples=300, deadline=None)
@given(docs=docs_st, query=query_st, max_tokens=st.integers(8, 64),
       num_segments=st.integers(2, 4), k=st.integers(1, 6),
       min_prob=st.sampled_from([0.0, 0.4, 0.6]))
def test_match_and_continuations_equal_brute_force(docs, query, max_tokens, num_segments, k,
                                                    min_prob):
    g = GlobalStore(max_tokens, num_segments=num_segments)
    for d in docs:
        g.add(d)
    segs = brute_segments(docs, max_tokens, num_segments)
    seg, state, length = g.match(query)
    bseg, blen = brute_best_segment(query, segs)
    assert (seg, length) == (bseg, blen)
    assert length == longest_match(query, [d for s in segs for d in s])
    if length == 0:
        assert g.continuation(seg, state, k) == []
        return
    u = query[-length:]
    assert g.continuation(seg, state, k, "first") == brute_first(u, segs[seg], k)
    # documents of at most 12 tokens: occurrence counts (kept for the 32 longest
    # suffixes of each token) are exact
    assert g.continuation(seg, state, k, "frequent", min_prob) == \
        brute_frequent(u, segs[seg], k, min_prob)


@settings(max_examples=150, deadline=None)
@given(before=docs_st, after=docs_st, query=query_st, k=st.integers(1, 6))
def test_frequent_continuation_follows_documents_added_after_a_query(before, after, query, k):
    """The per-state cache of the most frequent transition is redone when its
    segment receives documents."""
    g = GlobalStore(1000, num_segments=2)
    for docs in (before, after):
        for d in docs:
            g.add(d)
        seg, state, length = g.match(query)
        segs = brute_segments(before + (after if docs is after else []), 1000, 2)
        if length:
            assert g.continuation(seg, state, k) == brute_frequent(query[-length:], segs[seg], k)


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, 3), min_size=1, max_size=10)),
    st.tuples(st.just("commit"), st.lists(st.integers(0, 3), min_size=1, max_size=4))),
    max_size=16), prompt=st.lists(st.integers(0, 3), max_size=6))
def test_incremental_match_equals_a_fresh_match(steps, prompt):
    """A request's match, advanced with its committed tokens while documents
    arrive (stale segments re-matched), equals a fresh match of its context
    (here shorter than the window)."""
    g = GlobalStore(40, num_segments=2, window=64)
    m = GlobalMatch()
    context = list(prompt)
    g.refresh(m, context)
    for kind, tokens in steps:
        if kind == "add":
            g.add(tokens)
        else:
            context += tokens
            g.advance(m, tokens)
        g.refresh(m, context)
        assert g.best(m)[2] == g.match(context)[2] == longest_match(context, g.documents())
        assert g.best(m)[0] == g.match(context)[0]


def test_hand_example():
    g = GlobalStore(1024)
    for d in ([1, 2, 3, 4, 5], [2, 3, 9, 9], [7, 2, 3, 4, 6]):
        g.add(d)
    seg, state, length = g.match([8, 2, 3])
    assert (seg, length) == (0, 2)
    # "2 3" is followed by 4 twice and 9 once; "2 3 4" by 5 and 6 (tie: smaller id)
    assert g.continuation(seg, state, 5) == [4, 5]
    assert g.continuation(seg, state, 5, "first") == [4, 5]
    assert g.match([5, 6])[2] == 1 and g.match([42])[2] == 0


def test_long_documents_keep_their_tail_and_old_segments_are_dropped_whole():
    g = GlobalStore(4096, num_segments=4)            # segments of 1024 tokens
    g.add(list(range(3000)))
    assert g.documents() == [list(range(3000 - 1024, 3000))]
    for i in range(4):
        g.add([5000 + i] * 1000)
    assert len(g.segments) == 4 and g.segments_dropped == 1
    assert g.documents() == [[5000 + i] * 1000 for i in range(4)]
    assert g.num_tokens == 4000 <= g.max_tokens


def test_memory_stays_bounded_over_many_documents():
    """1,000 requests of 200 tokens into a 50k-token store: the size stops
    growing once the ring is full (resident bytes measured from the arrays)."""
    rng = np.random.default_rng(0)
    g = GlobalStore(50_000, num_segments=4)
    sizes = []
    for i in range(1000):
        g.add(rng.integers(0, 150_000, 200))
        sizes.append(g.resident_nbytes())
    assert g.num_tokens <= 50_000 and len(g.segments) == 4
    # worst case per token (random ids: ~2 states and 3 transitions a token)
    assert max(sizes) <= 200 * 50_000
    assert max(sizes[500:]) <= 1.1 * max(sizes[:500])


@pytest.mark.parametrize("bad", [[-1], [1 << 31]])
def test_bad_token_ids_are_refused(bad):
    with pytest.raises(ValueError, match="token ids"):
        GlobalStore(1024).add(bad)


def test_constructor_checks():
    with pytest.raises(ValueError):
        GlobalStore(3, num_segments=4)
    with pytest.raises(ValueError):
        GlobalStore(1024, num_segments=1)


# ------------------------------------------------------------------ sam
ANSWER = [100 + i for i in range(40)]


def test_sam_drafts_a_previous_requests_output_only_after_it_completes():
    prop = SamProposer(8, sam_min_accept_prob=0.0)
    prop.start("a", [1, 2, 3] + ANSWER[:1])
    prop.observe("a", ANSWER[1:10])
    # "b" is running while "a" has not finished: a's output is not visible
    prop.start("b", [7, 8] + ANSWER[:3])
    assert prop.propose("b", 8).tokens.tolist() == []
    prop.complete("a")
    prop.finish("a")
    # visible from the next draft on, without re-starting "b"
    assert prop.propose("b", 8).tokens.tolist() == ANSWER[3:10]
    assert prop.debug_stats()["global_drafts"] == 1


def test_a_preempted_request_is_not_added():
    prop = SamProposer(8, sam_min_accept_prob=0.0)
    prop.start("a", [1, 2] + ANSWER[:1])
    prop.observe("a", ANSWER[1:6])
    prop.finish("a")                                 # preempted: freed, not completed
    prop.start("b", [9] + ANSWER[:2])
    assert len(prop.propose("b", 8)) == 0 and prop.global_store.num_tokens == 0
    prop.start("a", [1, 2] + ANSWER[:6])             # resumed with its output so far
    prop.observe("a", ANSWER[6:12])
    prop.complete("a")
    prop.finish("a")
    prop.propose("b", 8)
    # added once, from the first output token (the prompt length is kept over the preemption)
    assert prop.global_store.documents() == [ANSWER[:12]]


def test_prompts_are_added_with_sam_global_prompts():
    for prompts, expected in ((False, [ANSWER[:5]]), (True, [[1, 2] + ANSWER[:5]])):
        prop = SamProposer(8, sam_global_prompts=prompts)
        prop.start("a", [1, 2] + ANSWER[:1])
        prop.observe("a", ANSWER[1:5])
        prop.complete("a")
        prop.finish("a")
        prop.start("b", [3])
        assert prop.global_store.documents() == expected


def test_a_steps_finished_requests_are_added_in_request_id_order():
    stores = []
    for order in (("x", "y", "z"), ("z", "x", "y")):
        prop = SamProposer(8)
        for r in order:
            prop.start(r, [ord(r)] + [ord(r) + 1000])
            prop.observe(r, [ord(r) + 2000])
        for r in order:
            prop.complete(r)
            prop.finish(r)
        prop.start("next", [1])
        stores.append(prop.global_store.documents())
    assert stores[0] == stores[1] == [[ord(r) + 1000, ord(r) + 2000] for r in "xyz"]


def test_no_store_with_zero_tokens():
    prop = SamProposer(8, sam_global_tokens=0)
    assert prop.global_store is None
    replay(prop, [1, 2, 3], ANSWER[:8], 8)
    assert "global_drafts" not in prop.debug_stats()


def _trained(prop, source, length, accepted_rate, n=200):
    """Feed a source's acceptance table: drafts of 8 from a match of ``length``
    accepted through position i with chance accepted_rate ** (i+1)."""
    table = prop._table(source)
    rng = np.random.default_rng(1)
    for _ in range(n):
        a = 0
        while a < 8 and rng.random() < accepted_rate:
            a += 1
        table.update(length, 8, a)


def test_source_choice_follows_the_learned_acceptance():
    """The own match (length 3) and the global match (length 3) offer different
    drafts; the one whose source was accepted more often is drafted, and the
    cut follows that source's estimates."""
    own_ctx = [1, 2, 3, 50, 51, 52, 53, 54, 1, 2, 3]          # own: 50 51 52 ...
    for good, expected in (("dynamic", [50, 51, 52]), ("global", [60, 61, 62])):
        prop = SamProposer(8, sam_min_accept_prob=0.3, sam_continuation="first")
        prop.start("old", [9])
        prop.observe("old", [1, 2, 3, 60, 61, 62, 63, 64, 65, 66, 67])
        prop.complete("old")
        prop.finish("old")
        bad = "global" if good == "dynamic" else "dynamic"
        _trained(prop, good, 3, 0.9)
        _trained(prop, bad, 3, 0.2)
        prop.start("r", own_ctx)
        assert prop._automata["r"].match_len == 3
        draft = prop.propose("r", 8).tokens.tolist()
        assert draft[:3] == expected
        # the cut: positions whose estimate is >= 0.3 (0.9^(i+1) >= 0.3: i <= 10)
        kept = int(np.sum(prop._table(good).prob(3) >= 0.3))
        assert 3 <= len(draft) == kept <= 8
        assert prop.match_len("r") == 3


def test_source_choice_prefers_the_longer_expected_draft_on_equal_estimates():
    """Fresh tables (prior 1/2 at every position): the draft with more tokens
    before the cut has the higher expected accepted length."""
    prop = SamProposer(8, sam_min_accept_prob=0.0, sam_continuation="first")
    prop.start("old", [9])
    prop.observe("old", [1, 2, 3, 60, 61, 62, 63, 64, 65, 66, 67])
    prop.complete("old")
    prop.finish("old")
    prop.start("r", [1, 2, 3, 50, 1, 2, 3])   # own: 50 1 2 3 (end of text); global: 60..67
    d = prop.propose("r", 8).tokens.tolist()
    assert d == [60, 61, 62, 63, 64, 65, 66, 67]
    assert prop.debug_stats()["global_drafts"] == 1


def test_corpus_bias_set_keeps_the_fixed_rule_for_the_static_corpus(tmp_path):
    from vllm_specplug.proposers.corpus_automaton import build_corpus_automaton

    doc = list(range(10, 40))
    path = tmp_path / "c.sam"
    build_corpus_automaton([doc], 0, {"name": "t", "vocab_sha256": "x"}, path, progress=False)
    prompt = [12, 13, 14, 77, 10, 11, 12, 13, 14]   # own match 3 (then 77), static 5
    fixed = SamProposer(4, sam_corpus=str(path), sam_corpus_bias=2,
                        sam_continuation="first", sam_min_accept_prob=0.0)
    fixed.start("r", prompt)
    assert fixed.propose("r", 4).tokens.tolist() == [77, 10, 11, 12]
    chosen = SamProposer(4, sam_corpus=str(path), sam_continuation="first",
                         sam_min_accept_prob=0.0)
    chosen.start("r", prompt)
    # unset: equal fresh estimates, both drafts 4 tokens: the tie goes to the own match
    assert chosen.propose("r", 4).tokens.tolist() == [77, 10, 11, 12]
    _trained(chosen, "static", 5, 0.95)
    _trained(chosen, "dynamic", 3, 0.1)
    assert chosen.propose("r", 4).tokens.tolist() == doc[5:9]


def test_replay_many_gains_from_answers_that_repeat_across_requests():
    """The same answer to different prompts: with the store, the second and
    later requests draft it from the first one."""
    rng = np.random.default_rng(0)
    answer = rng.integers(1000, 2000, 120).tolist()
    requests = [(rng.integers(0, 999, 20).tolist(), answer) for _ in range(4)]
    without = replay_many(SamProposer(8, sam_global_tokens=0), requests, 8)
    with_store = replay_many(SamProposer(8), requests, 8)
    assert without["generated"] == with_store["generated"] == 480
    assert without["tau"] < 1.2 and with_store["tau"] > 2.5


# ------------------------------------------------- the drafter without vLLM
def test_drafter_adds_a_finished_request_not_a_preempted_one(patch_calls):
    """SpecPlugDrafter driven as the runner does (tests/helpers.step): the
    runner's request-removed hook (``finish_request``) adds the output; a
    request that only leaves the batch (preempted) is freed without it."""
    from helpers import make_vllm_config, step

    from vllm_specplug.vllm_adapter.v1.drafter import SpecPlugDrafter

    d = SpecPlugDrafter(make_vllm_config({"method": "sam", "num_speculative_tokens": 4}))
    store = d.proposer.global_store
    answer = ANSWER[:12]
    hist = [1, 2, 3] + answer[:1]
    step(d, ["a"], [hist], [[answer[0]]])
    for t in answer[1:6]:
        hist = hist + [t]
        step(d, ["a"], [hist], [[t]])
    step(d, ["b"], [[7, 7, 7, answer[0]]], [[answer[0]]])  # "a" left the batch: preempted
    assert store.num_tokens == 0 and d.proposer.active_requests() == 1
    for t in answer[6:]:                                      # "a" resumes, then finishes
        hist = hist + [t]
        step(d, ["a"], [hist], [[t]])
    d.finish_request("a")
    drafts = step(d, ["b"], [[7, 7, 7, answer[0], answer[1]]], [[answer[1]]])
    assert store.documents() == [answer]
    assert drafts == [answer[2:6]]

