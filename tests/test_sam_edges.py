"""SamProposer's edges that its life-cycle and property tests
(tests/test_sam_proposer.py, tests/test_global_store.py) do not reach: option
defaults and checks, the acceptance table's sums and caches, the statistics,
where each source's draft and estimate come from, the per-step choice cache,
the static corpus match against brute force, and the sizes it reports.
Written for the survivors of mutation testing (results/mutation/2026-12-04/
sam.txt; docs/testing.md). No vLLM."""
from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

from helpers import brute_support

from vllm_specplug.config import translate
from vllm_specplug.options import SpecPlugConfigError
from vllm_specplug.proposers import corpus_automaton
from vllm_specplug.proposers import sam as sam_module
from vllm_specplug.proposers.base import Draft, RequestInfo
from vllm_specplug.proposers.corpus_automaton import build_corpus_automaton
from vllm_specplug.proposers.sam import AcceptanceByMatchLength, SamProposer, stop_rule_of
from vllm_specplug.proposers.suffix_automaton import SuffixAutomaton

CTX = [1, 2, 3, 4, 5, 1, 2, 3]      # match [1, 2, 3]; "frequent" drafts the period 4 5 1 2 3
PERIOD = [4, 5, 1, 2, 3, 4, 5, 1]
NO_CUT = {"sam_min_accept_prob": 0.0}
IDENTITY = {"name": "t", "vocab_sha256": "0123456789abcdef" * 4}


def _corpus(tmp_path, docs, name="c.sam") -> str:
    path = tmp_path / name
    build_corpus_automaton(docs, 0, IDENTITY, path, progress=False)
    return str(path)


def _own(**options) -> SamProposer:
    """A proposer drafting from the request's own text only (no global store)."""
    return SamProposer(8, sam_global_tokens=0, **options)


# ------------------------------------------------------------- options
def test_constructor_defaults_are_the_options_defaults():
    """The engine passes every option; a proposer built in code (tests,
    benchmarks, the warm-up's twin) gets the constructor's defaults: they
    must be the documented ones."""
    params = inspect.signature(SamProposer.__init__).parameters
    defaults = {o.name: o.default for o in SamProposer.options}
    assert defaults == {name: p.default for name, p in params.items()
                        if name not in ("self", "num_speculative_tokens")}

    def built(p: SamProposer) -> tuple:
        return (p.continuation, p.min_match_len, p.min_accept_prob,
                p.spec_factor, p.corpora, p.corpus_bias, p.stores.max_tokens,
                p.stores.max_partitions, p.global_prompts, p._stop is None)

    assert built(SamProposer(8)) == built(SamProposer(8, **defaults))


def test_the_smallest_byte_cap_named_is_accepted():
    from vllm_specplug.proposers.global_store import GlobalStore

    need = GlobalStore(1024).max_nbytes()
    translate({"method": "sam", "sam_global_bytes": need})
    with pytest.raises(SpecPlugConfigError, match=f"at least {need}, got {need - 1}"):
        translate({"method": "sam", "sam_global_bytes": need - 1})


def test_stop_options_that_would_not_be_read_are_refused_with_their_reason():
    with pytest.raises(SpecPlugConfigError, match=(
            r"^speculative_config\['sam_min_accept_prob'\] is the table rule's threshold "
            r"and is not read with sam_stop 'learned' \(which cuts by the measured verify "
            r"cost\); remove one of them$")):
        SamProposer.check_options(8, {"sam_stop": "learned", "sam_min_accept_prob": 0.5})
    for options in ({"sam_stop": "table", "sam_stop_file": "f"},
                    {"sam_stop_file": "f", "sam_min_accept_prob": 0.5},
                    {"sam_stop": "auto", "sam_stop_file": "f", "sam_min_accept_prob": 0.0}):
        with pytest.raises(SpecPlugConfigError, match=(
                r"^speculative_config\['sam_stop_file'\] is read only by the learned rule "
                r"\(sam_stop 'learned', or 'auto' without sam_min_accept_prob\); use that "
                r"rule or remove sam_stop_file$")):
            SamProposer.check_options(8, options)
    # "auto" without a threshold is the learned rule: its file is read
    SamProposer.check_options(8, {"sam_stop": "auto", "sam_stop_file": "f"})
    SamProposer.check_options(8, {"sam_stop_file": "f"})


@pytest.mark.parametrize("stop,threshold,rule", [
    ("auto", None, "learned"), ("auto", 0.0, "table"), ("auto", 0.3, "table"),
    ("table", None, "table"), ("learned", None, "learned")])
def test_auto_stop_rule_is_the_table_only_with_its_threshold(stop, threshold, rule):
    assert stop_rule_of(stop, threshold) == rule
    sam = SamProposer(8, sam_stop=stop, sam_min_accept_prob=threshold, sam_global_tokens=0)
    assert (sam._stop is not None) == (rule == "learned")


@pytest.mark.parametrize("tokens,ok", [(0, True), (1, False), (1023, False), (1024, True)])
def test_global_tokens_is_zero_or_at_least_the_minimum(tokens, ok):
    spec = {"method": "sam", "sam_global_tokens": tokens}
    if ok:
        translate(spec)
    else:
        with pytest.raises(SpecPlugConfigError, match="at least 1024"):
            translate(spec)


def test_check_model_without_a_corpus_loads_no_tokenizer(monkeypatch):
    def fail(path):
        raise AssertionError("loaded a tokenizer")

    monkeypatch.setattr(corpus_automaton, "load_tokenizer_identity", fail)
    SamProposer.check_model({}, "/no/such/tokenizer")
    SamProposer.check_model({"sam_corpus": ""}, "/no/such/tokenizer")


def test_check_model_names_a_tokenizer_it_cannot_load(tmp_path, monkeypatch):
    path = _corpus(tmp_path, [[1, 2, 3]])

    def fail(tokenizer):
        raise OSError("no such folder")

    monkeypatch.setattr(corpus_automaton, "load_tokenizer_identity", fail)
    with pytest.raises(SpecPlugConfigError,
                       match=r"cannot load the model's tokenizer '/no/tok' to check the "
                             r"corpus files against it: no such folder"):
        SamProposer.check_model({"sam_corpus": path}, "/no/tok")


def test_check_model_names_both_vocabularies_by_12_hex_digits(tmp_path, monkeypatch):
    path = _corpus(tmp_path, [[1, 2, 3]])
    monkeypatch.setattr(corpus_automaton, "load_tokenizer_identity",
                        lambda tok: {"name": "other", "vocab_sha256": "fedcba9876543210" * 4})
    with pytest.raises(SpecPlugConfigError) as e:
        SamProposer.check_model({"sam_corpus": path}, "/m")
    message = str(e.value)
    assert "vocabulary sha256 0123456789ab)" in message, message
    assert "vocabulary sha256 fedcba987654)" in message, message


# ------------------------------------------------------ acceptance table
def _fed_table(k=8) -> AcceptanceByMatchLength:
    t = AcceptanceByMatchLength(k)
    for drafted, accepted in ((8, 3), (8, 8), (4, 0), (6, 2), (8, 5)):
        t.update(3, drafted, accepted)
    return t


def test_expected_is_the_sum_of_the_first_n_estimates():
    t = _fed_table()
    p = t.prob(3)
    for n in range(0, 9):
        assert t.expected(3, n) == pytest.approx(float(np.sum(p[:n]))), n


def test_best_length_follows_the_cost_asked():
    t = AcceptanceByMatchLength(8)          # fresh: every estimate 0.5
    assert t.best_length(3, 8, 0.0) == 8    # verifying is free: keep all
    assert t.best_length(3, 8, 1.0) == 0    # a token costs more than it brings
    assert t.best_length(3, 8, 0.0) == 8
    assert t.cut(3, 8, None) == 8           # no cost given: free


def test_best_lengths_keep_the_shortest_of_equal_rates():
    # one token whose estimate equals its cost: 1 token gives the rate of none
    assert AcceptanceByMatchLength._best_lengths([0.5], 0.5) == [0, 0]
    assert AcceptanceByMatchLength._best_lengths([0.5, 0.9], 0.25) == [0, 1, 2]


def test_rows_and_best_lengths_are_computed_once_per_update(monkeypatch):
    calls = {"prob": 0, "best": 0}
    prob, best = AcceptanceByMatchLength.prob, AcceptanceByMatchLength._best_lengths

    def counting_prob(self, match_len):
        calls["prob"] += 1
        return prob(self, match_len)

    def counting_best(p, cost):
        calls["best"] += 1
        return best(p, cost)

    monkeypatch.setattr(AcceptanceByMatchLength, "prob", counting_prob)
    monkeypatch.setattr(AcceptanceByMatchLength, "_best_lengths", staticmethod(counting_best))
    t = _fed_table()
    for _ in range(5):
        t.expected(3, 4)
        t.best_length(3, 8, 0.08)
    assert calls == {"prob": 1, "best": 1}
    t.update(3, 8, 1)
    t.best_length(3, 8, 0.08)
    assert calls == {"prob": 2, "best": 2}


# ------------------------------------------------------------ statistics
def test_drafts_tokens_and_accepted_add_up_over_steps():
    prop = _own(**NO_CUT)
    prop.start("r", CTX)
    d1 = prop.propose("r", 8)
    assert d1.tokens.tolist() == PERIOD
    prop.draft_cut("r", Draft.chain(d1.tokens[:3]))    # the batch budget kept 3
    prop.observe("r", [4, 5, 1, 2])                     # all 3 accepted, then the bonus
    assert prop.acceptance.tried[3].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert prop.acceptance.accepted[3].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    d2 = prop.propose("r", 8)
    assert len(d2) == 8
    prop.observe("r", d2.tokens[:1].tolist() + [99])
    s = prop.debug_stats()
    assert (s["dynamic_drafts"], s["dynamic_tokens"], s["dynamic_accepted"]) == (2, 11, 4), s


def test_tokens_committed_past_the_draft_count_the_whole_draft():
    """Tokens committed over more than one step (a step the drafter did not
    see) after a fully accepted draft: the whole draft counts, nothing raises."""
    prop = _own(**NO_CUT)
    prop.start("r", CTX)
    d = prop.propose("r", 4).tokens.tolist()
    prop.observe("r", d + [7, 7, 7])
    assert prop.debug_stats()["dynamic_accepted"] == 4


def test_each_source_feeds_its_own_acceptance_table(tmp_path):
    path = _corpus(tmp_path, [list(range(10, 40))])
    prop = _own(sam_corpus=path, **NO_CUT)
    prop.start("r", [77, 12, 13, 14])                  # own match 0, static match 3
    d = prop.propose("r", 4).tokens.tolist()
    assert d == [15, 16, 17, 18]
    prop.observe("r", [15, 16, 99])
    assert prop.static_acceptance.tried.sum() == 4
    assert prop.static_acceptance.accepted.sum() == 2
    assert prop.acceptance.tried.sum() == prop.global_acceptance.tried.sum() == 0


# ---------------------------------------------------------- draft sources
def _with_documents(*docs, **options) -> SamProposer:
    prop = SamProposer(8, **options)
    for doc in docs:
        prop.stores.add((), doc)
    return prop


def test_frequent_global_drafts_are_not_capped_by_the_spec_factor():
    prop = _with_documents(list(range(1, 21)), **NO_CUT)
    prop.start("r", [50, 51, 5])                        # own match 0; global "5"
    assert prop.propose("r", 8).tokens.tolist() == list(range(6, 14))


@pytest.mark.parametrize("continuation,draft", [("first", [1, 1]), ("frequent", [2])])
def test_global_drafts_follow_the_continuation_rule(continuation, draft):
    # after 5: 1 first (once), 2 most often (twice, a share of 2/3)
    prop = _with_documents([5, 1, 1], [5, 2], [5, 2], sam_continuation=continuation, **NO_CUT)
    prop.start("r", [60, 5])
    assert prop.propose("r", 8).tokens.tolist() == draft


def test_min_match_len_bounds_the_walk_to_shorter_matches():
    # own text, "first": the match's first occurrence has 7 tokens after it;
    # a shorter match (length 1 or 2) would give 8, but sam_min_match_len is 3
    own = _own(sam_continuation="first", sam_min_match_len=3, **NO_CUT)
    own.start("r", [3, 2, 3, 3, 3, 2, 3, 1, 2, 3, 3])
    assert own.propose("r", 8).tokens.tolist() == [3, 2, 3, 1, 2, 3, 3]
    # global store, "frequent": the walk ends after [2, 3] unless it may fall
    # back to a match shorter than 3
    glob = _with_documents([3, 2, 1, 2, 3], [3, 1, 2, 2, 3, 2, 3], [1, 3, 2, 2, 2, 3],
                           sam_min_match_len=3, **NO_CUT)
    glob.start("r", [2, 1, 3, 2, 1])                    # own match 2 (< 3); global 3
    assert glob.propose("r", 8).tokens.tolist() == [2, 3]


@pytest.mark.parametrize("continuation,draft", [("frequent", PERIOD), ("first", CTX[3:])])
def test_a_tie_between_sources_goes_to_the_own_text(continuation, draft):
    # both match [1, 2, 3] and draft as many tokens: 8 ("frequent"), or 5
    # ("first": the global draft ends with its document, below its
    # full-budget value, so it is fetched and compared)
    prop = _with_documents([1, 2, 3, 60, 61, 62, 63, 64], sam_continuation=continuation,
                           **NO_CUT)
    prop.start("r", CTX)
    assert prop.propose("r", 8).tokens.tolist() == draft
    s = prop.debug_stats()
    assert (s["dynamic_drafts"], s["global_drafts"]) == (1, 0), s


def test_reading_the_store_does_not_create_a_tenants_store():
    prop = SamProposer(8)
    prop.stores.add((), [1, 2, 3, 4])
    prop.start("r", CTX, RequestInfo(tenant=("salt-a",)))
    prop.propose("r", 8)
    assert ("salt-a",) not in prop.stores and len(prop.stores) == 1


def test_value_of_an_empty_draft_is_below_any_draft():
    prop = _own(sam_min_accept_prob=0.9)               # a fresh 0.5 estimate is cut: 0 kept
    assert prop._value("dynamic", 3, 0) < prop._value("dynamic", 3, 1) == (0.0, 0.5)
    never = _own(**NO_CUT)
    never.relative_token_cost = 1.0                     # best_length would keep 0
    assert never._value("dynamic", 3, 4) == (2.0, 0.5)


@pytest.mark.parametrize("min_accept_prob,cost,fetched", [
    (None, 1.0, 1),      # the cost cut keeps 0: fetch 1 (the exploration step)
    (None, 0.0, 8),
    (0.9, 0.08, 1),      # the threshold cut keeps 0
    (1.0, 0.08, 1),
    (0.0, 1.0, 8),       # 0: never cut
])
def test_the_walk_fetches_the_cut_plus_one(monkeypatch, min_accept_prob, cost, fetched):
    asked = []
    walk = SuffixAutomaton.frequent_continuation

    def counting(self, max_tokens, *args, **kwargs):
        asked.append(max_tokens)
        return walk(self, max_tokens, *args, **kwargs)

    monkeypatch.setattr(SuffixAutomaton, "frequent_continuation", counting)
    prop = _own(sam_min_accept_prob=min_accept_prob, sam_stop="table")
    prop.relative_token_cost = cost
    prop.start("r", CTX)
    prop.propose("r", 8)
    assert asked == [fetched]


# ------------------------------------------------------- the step's choice
def test_the_choice_is_made_once_a_step(monkeypatch):
    calls = []
    walk = SuffixAutomaton.frequent_continuation
    monkeypatch.setattr(SuffixAutomaton, "frequent_continuation",
                        lambda self, *a, **k: calls.append(a) or walk(self, *a, **k))
    prop = _own(**NO_CUT)
    prop.start("r", CTX)
    assert prop.match_len("r") == 3                     # sam_tr asks first, then drafts
    assert prop.propose("r", 8).tokens.tolist() == PERIOD
    assert len(calls) == 1
    prop.start("s", CTX)
    prop.match_len("s")
    assert len(prop.propose("s", 2)) == 2               # another budget: chosen again


def _fresh_draft(history: list[list[int]]) -> list[int]:
    prop = _own(**NO_CUT)
    prop.start("r", history[0])
    for committed in history[1:]:
        prop.observe("r", committed)
    return prop.propose("r", 8).tokens.tolist()


def test_a_new_start_or_step_forgets_the_choice():
    prop = _own(**NO_CUT)
    prop.start("r", CTX)
    prop.match_len("r")
    prop.observe("r", [4, 5, 1])
    assert prop.propose("r", 8).tokens.tolist() == _fresh_draft([CTX, [4, 5, 1]])
    prop.match_len("r")
    prop.start("r", [7, 8, 9, 7, 8])                    # restarted (preempted) elsewhere
    assert prop.propose("r", 8).tokens.tolist() == _fresh_draft([[7, 8, 9, 7, 8]])
    prop.match_len("r")
    prop.finish("r")
    assert prop.structure_sizes()["sam_choices"] == 0


# ------------------------------------------------------------ static corpus
def _first_match(corpora: list[list[int]], prompt: list[int], k: int):
    """Brute force: (corpus index, length, draft) of the longest suffix of
    ``prompt`` in any corpus (the first listed on a tie; -1 and 0: none), the
    draft being the tokens after its first occurrence, up to the EOS (0)."""
    best = (-1, 0, [])
    for i, flat in enumerate(corpora):
        for length in range(len(prompt), best[1], -1):
            tail = prompt[-length:]
            at = next((j for j in range(len(flat) - length + 1)
                       if flat[j:j + length] == tail), None)
            if at is not None:
                rest = flat[at + length:]
                end = rest.index(0) if 0 in rest else len(rest)
                best = (i, length, rest[:min(end, k)])
                break
    return best


def test_static_matches_are_the_longest_first_occurrences(tmp_path):
    rng = np.random.default_rng(7)
    corpora, paths = [], []
    for c in range(2):
        docs = [rng.integers(1, 4, int(rng.integers(5, 30))).tolist() for _ in range(6)]
        corpora.append([t for d in docs for t in d + [0]])
        paths.append(_corpus(tmp_path, docs, f"c{c}.sam"))
    prop = _own(sam_corpus=",".join(paths))
    ties = 0
    for r in range(300):
        prompt = rng.integers(1, 5, int(rng.integers(1, 10))).tolist()   # 4: in no corpus
        prop.start(f"r{r}", prompt)
        index, state, length = prop._static_match(f"r{r}")
        want = _first_match(corpora, prompt, 6)
        assert (index, length) == want[:2], (prompt, index, length, want)
        if index >= 0:
            assert prop.corpora[index].continuation(state, length, 6).tolist() == want[2]
        ties += index == 0 and _first_match(corpora[1:], prompt, 6)[1] == length
        prop.finish(f"r{r}")
    assert ties > 10                                    # the first listed won real ties


def test_corpus_bias_without_a_corpus_is_harmless():
    prop = _own(sam_corpus_bias=2, **NO_CUT)
    prop.start("r", CTX)
    assert prop.match_len("r") == 3
    assert prop.propose("r", 8).tokens.tolist() == PERIOD


def test_corpus_bias_counts_the_global_match_as_the_requests_own():
    prop = _with_documents([1, 2, 3, 4, 5, 6, 7, 8], sam_corpus_bias=2, **NO_CUT)
    prop.start("r", [9, 1, 2, 3, 4])                    # own match 0, global 4
    assert prop.match_len("r") == 4


def test_corpus_bias_rule_keeps_the_min_match_len(tmp_path):
    path = _corpus(tmp_path, [list(range(10, 40))])
    prop = _own(sam_corpus=path, sam_corpus_bias=0, sam_min_match_len=3, **NO_CUT)
    prop.start("r", [77, 12, 13])                       # static match 2 < 3
    assert len(prop.propose("r", 4)) == 0
    prop.observe("r", [14])                             # static match 3
    assert prop.propose("r", 4).tokens.tolist() == [15, 16, 17, 18]


# ------------------------------------------------------- the global store
def test_a_restarted_request_is_the_newest_prompt_length(monkeypatch):
    monkeypatch.setattr(sam_module, "MAX_TRACKED_PROMPTS", 2)
    prop = SamProposer(8)
    for r in ("x", "y", "z"):
        prop.start(r, [7, 7, 7])
    assert prop.structure_sizes()["sam_prompt_lens"] == 2
    prop = SamProposer(8)
    prop.start("a", [1, 2, 3, 40, 41], RequestInfo(num_prompt_tokens=3))
    prop.start("b", [5, 6, 7])
    prop.start("a", [1, 2, 3, 40, 41], RequestInfo(num_prompt_tokens=3))   # preempted, back
    prop.start("c", [8, 9])                             # forgets the oldest: b, not a
    prop.complete("a")
    prop.finish("a")
    prop.start("d", [1])
    assert prop.global_store.documents() == [[40, 41]]


def test_failed_insertions_are_counted_and_the_log_names_their_cause(caplog):
    """Issue 45 item 7: the insertion runs inside the next request's start,
    which must not raise for it; the failure is counted and logged with the
    request and the cause (the traceback once)."""
    import logging

    prop = SamProposer(8)
    for r in ("b", "a"):
        prop.start(r, [1, 2, 3], RequestInfo(num_prompt_tokens=1))
    for r in ("b", "a"):
        prop.complete(r)
        prop.finish(r)
    cause = ValueError("store full")

    def add(key, tokens):
        raise cause

    prop.stores.add = add
    with caplog.at_level(logging.ERROR, logger="vllm_specplug"):
        prop.start("x", [1])
    assert prop.debug_stats()["global_store_failed_documents"] == 2
    records = [r for r in caplog.records if r.name == "vllm_specplug"]
    assert len(records) == 1 and records[0].exc_info[1] is cause   # the first, with its traceback
    assert "request a" in records[0].getMessage()
    assert "ValueError: store full" in records[0].getMessage()


# ------------------------------------------------------------------- sizes
def test_sizes_bytes_and_stats_report_every_structure(tmp_path):
    path = _corpus(tmp_path, [list(range(10, 40))])
    prop = SamProposer(8, sam_corpus=path, sam_stop="table")   # the learned rule's: below
    prop.stores.add((), [1, 2, 3, 4, 5, 6])
    prop.start("r1", [1, 2, 3, 12, 13])
    prop.start("r2", CTX)
    prop.propose("r1", 8)
    prop.match_len("r2")
    tables = (prop.acceptance, prop.global_acceptance, prop.static_acceptance)
    cache = sum(len(t._rows) + len(t._best) for t in tables)
    assert cache > 0 and any(t._best for t in tables)
    sizes = prop.structure_sizes()
    sizes.pop("sam_stop_requests", None)                # sam_stop "learned" only
    assert sizes == {"sam_requests": 2, "sam_prompt_lens": 2, "sam_completed": 0,
                     "sam_pending": 1, "sam_choices": 1, "sam_corpus_matches": 2,
                     "sam_global_matches": 2, "sam_tenants": 2, "sam_output_ends": 0, "sam_live_marks": 0,
                     "sam_acceptance_cache": cache}
    # the automata, two int64 a corpus match, a [state, length, version] list
    # (48 bytes) a segment a request has a global match in
    segments = sum(len(m.per_segment) for m in prop._global_matches.values())
    assert segments == 2
    assert prop.state_nbytes() == (sum(sa.nbytes() for sa in prop._automata.values())
                                   + 16 * 1 * 2 + 48 * segments)
    stats = prop.debug_stats()
    assert stats["global_store_bytes"] == prop.stores.resident_nbytes() > 0
    assert stats["global_store_tokens"] == 6 and stats["global_store_tenants"] == 1


# ------------------------------------------- the learned stopping rule's wiring
def _learned(monkeypatch, **options):
    """A ``sam_stop`` "learned" proposer and the calibrated chances of each
    draft it chose (recorded as ``LearnedStop.drafted`` receives them)."""
    from vllm_specplug.proposers.stop_rule import LearnedStop

    chosen = []
    drafted = LearnedStop.drafted

    def record(self, req_id, source, raw, q):
        chosen.append((source, np.asarray(q).copy()))
        drafted(self, req_id, source, raw, q)

    monkeypatch.setattr(LearnedStop, "drafted", record)
    return SamProposer(8, sam_stop="learned", **options), chosen


def test_learned_drafts_carry_their_chances_and_are_counted(monkeypatch):
    prop, chosen = _learned(monkeypatch, sam_global_tokens=0)
    prop.relative_token_cost = 0.0                      # free tokens: nothing cut
    prop.start("r", CTX)
    d1 = prop.propose("r", 8)
    assert d1.tokens.tolist() == PERIOD and chosen[-1][0] == "dynamic"
    np.testing.assert_allclose(d1.scores, chosen[-1][1][:8])
    assert not np.allclose(d1.scores, prop.acceptance.prob(3)[:8])   # not the table's
    prop.observe("r", [4, 5, 9])
    prop.observe("r", [1, 2, 3])                         # no draft in between
    d2 = prop.propose("r", 8)
    assert len(d2) > 0
    s = prop.debug_stats()
    assert (s["dynamic_drafts"], s["dynamic_tokens"]) == (2, 8 + len(d2)), s


def test_learned_drafts_explore_one_token_past_the_cut(monkeypatch):
    from vllm_specplug.proposers.stop_rule import best_cut

    prop, chosen = _learned(monkeypatch, sam_global_tokens=0)
    prop.start("r", CTX)
    prop.relative_token_cost = 0.0
    prop.propose("r", 8)
    q = chosen[-1][1]
    # a cost whose best cut keeps some tokens but not all, at a rate below 2
    # (a draft worth less than 2 tokens a unit of cost is still drafted)
    cost = next(c for c in np.linspace(0.05, 0.95, 19)
                if 0 < best_cut(q, c)[0] < q.size - 1 and best_cut(q, c)[1] < 2.0)
    prop.relative_token_cost = float(cost)
    lengths = []
    for _ in range(2 * sam_module.EXPLORE_EVERY):
        lengths.append(len(prop.propose("r", 8)))
        assert chosen[-1][1].tolist() == q.tolist()      # same context: same chances
    m = best_cut(q, cost)[0]
    assert sorted(set(lengths)) == [m, m + 1] and lengths.count(m + 1) == 2, (m, lengths)


def test_learned_rule_reads_every_source_past_a_short_own_match(monkeypatch):
    prop, chosen = _learned(monkeypatch, sam_min_match_len=2)
    prop.relative_token_cost = 0.0
    prop.stores.add((), list(range(1, 21)))
    prop.start("r", [50, 51, 5, 6])                       # own match 0 (< 2); global 2
    assert prop.propose("r", 8).tokens.tolist() == list(range(7, 15))
    assert chosen[-1][0] == "global"


def _scored(monkeypatch):
    """What the learned rule is asked, per source: (table_p, agree,
    in_prompt, support), through ``LearnedStop.score`` (what propose runs)
    or ``LearnedStop.conditional`` (what it runs while recording candidates)."""
    from vllm_specplug.proposers.stop_rule import LearnedStop

    asked = {}
    score, conditional = LearnedStop.score, LearnedStop.conditional

    def note(source, table_p, in_prompt, agree, support):
        asked[source] = (list(table_p), None if agree is None else np.asarray(agree).tolist(),
                         in_prompt, None if support is None else list(support))

    def record_score(self, req_id, source, match_len, table_p, shares, depths, in_prompt,
                     agree, support, relative_cost):
        note(source, table_p, in_prompt, agree, support)
        return score(self, req_id, source, match_len, table_p, shares, depths,
                     in_prompt, agree, support, relative_cost)

    def record_conditional(self, req_id, source, match_len, table_p, shares, depths, in_prompt,
                           agree=None, support=None):
        note(source, table_p, in_prompt, agree, support)
        return conditional(self, req_id, source, match_len, table_p, shares, depths,
                           in_prompt, agree, support)

    monkeypatch.setattr(LearnedStop, "score", record_score)
    monkeypatch.setattr(LearnedStop, "conditional", record_conditional)
    return asked


def test_learned_rule_reads_each_sources_table_and_the_other_drafts(monkeypatch):
    from vllm_specplug.proposers.stop_rule import agreement

    asked = _scored(monkeypatch)
    prop, chosen = _learned(monkeypatch)
    prop.relative_token_cost = 0.0
    prop.stores.add((), [1, 2, 3, 4, 5, 60, 61, 62])
    for _ in range(50):                                   # the tables disagree
        prop.global_acceptance.update(3, 8, 6)
        prop.acceptance.update(3, 8, 1)
    candidates = []
    prop._stop.record = lambda req_id, source, tokens: candidates.append(
        (req_id, source, list(tokens)))
    prop.start("r", CTX)
    prop.propose("r", 8)
    drafts = {source: tokens for _, source, tokens in candidates}
    assert {r for r, _, _ in candidates} == {"r"} and set(drafts) == {"dynamic", "global"}
    assert drafts["global"] == [4, 5, 60, 61, 62]          # agrees with the own draft for 2
    for source, table in (("dynamic", prop.acceptance), ("global", prop.global_acceptance)):
        assert asked[source][0] == table.prob(3).tolist(), source
        other = drafts["global" if source == "dynamic" else "dynamic"]
        assert asked[source][1] == agreement(drafts[source], [other]).tolist(), source
    assert asked["dynamic"][1][:3] == [1.0, 1.0, 0.0]
    # the global draft's support in the request's own text, by brute force
    # (the dynamic draft is a copy of that text: no support computed)
    assert asked["dynamic"][3] is None
    assert asked["global"][3] == brute_support(CTX, drafts["global"])
    assert 0 in asked["global"][3]                          # 60.. never occur in CTX



def test_learned_rule_keeps_the_better_source(monkeypatch):
    prop, chosen = _learned(monkeypatch)
    prop.relative_token_cost = 0.0
    prop.stores.add((), [1, 2, 3, 60])                   # global: one token
    prop.start("r", CTX)                                  # own: eight
    assert prop.propose("r", 8).tokens.tolist() == PERIOD
    assert [s for s, _ in chosen] == ["dynamic"]


def test_learned_rule_with_first_occurrence_drafts(monkeypatch):
    prop, chosen = _learned(monkeypatch, sam_global_tokens=0, sam_continuation="first")
    prop.relative_token_cost = 0.0
    prop.start("r", CTX)
    assert prop.propose("r", 8).tokens.tolist() == CTX[3:]


def test_learned_rule_scores_a_source_without_coefficients_by_its_table(tmp_path,
                                                                        monkeypatch):
    """The static corpus has no coefficients: its chances through each
    position are its table's estimates made non-increasing (a fresh
    calibration leaves them as they are)."""
    path = _corpus(tmp_path, [list(range(10, 40))])
    prop, chosen = _learned(monkeypatch, sam_global_tokens=0, sam_corpus=path)
    prop.relative_token_cost = 0.0
    for drafted, accepted in ((8, 2), (8, 8), (6, 5), (8, 0), (8, 4)):
        prop.static_acceptance.update(3, drafted, accepted)
    row = prop.static_acceptance.prob(3)[:8]
    assert np.any(np.diff(row) > 0)                       # not already non-increasing
    prop.start("r", [77, 12, 13, 14])                     # own match 0, static 3
    d = prop.propose("r", 8)
    assert d.tokens.tolist() == list(range(15, 23)) and chosen[-1][0] == "static"
    np.testing.assert_allclose(chosen[-1][1], np.minimum.accumulate(row), rtol=1e-12)


def test_learned_rule_leaves_the_corpus_bias_rule_alone(tmp_path, monkeypatch):
    path = _corpus(tmp_path, [list(range(10, 40))])
    prop, chosen = _learned(monkeypatch, sam_global_tokens=0, sam_corpus=path,
                            sam_corpus_bias=0)
    prop.relative_token_cost = 0.0
    prop.start("r", [12, 13, 14, 77, 11, 12, 13])          # own 2, static 3: the bias rule
    assert prop.propose("r", 4).tokens.tolist() == [14, 15, 16, 17]
    assert chosen == []


def test_a_learned_draft_cut_to_nothing_teaches_nothing(monkeypatch):
    prop, chosen = _learned(monkeypatch, sam_global_tokens=0)
    prop.relative_token_cost = 0.0
    prop.start("r", CTX)
    prop.propose("r", 8)
    prop.draft_cut("r", Draft.empty())                    # the batch budget dropped it
    prop.observe("r", [9])
    assert prop._stop.calib_est.sum() == 0 and sum(prop._stop._req["r"].drafts) == 0


def test_a_match_first_seen_in_the_first_output_token_is_not_a_prompt_copy(monkeypatch):
    asked = _scored(monkeypatch)
    prop, _ = _learned(monkeypatch, sam_global_tokens=0)
    prop.relative_token_cost = 0.0
    start = [11, 12, 13, 14, 15, 16, 17, 18]              # 7 prompt tokens, then the first output
    for req_id, committed, in_prompt in (("a", 18, False), ("b", 17, True)):
        prop.start(req_id, start)
        prop.observe(req_id, [committed])                  # matches its earlier occurrence
        prop.propose(req_id, 8)
        assert asked["dynamic"][2] is in_prompt, req_id
