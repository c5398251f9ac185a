"""``sam_global_live``: running requests feed their tenant's global store as
their output grows, so requests running together draft from each other."""
from __future__ import annotations

import pytest

from vllm_specplug.proposers.base import OutputEnd, RequestInfo
from vllm_specplug.proposers.sam import LIVE_CONTEXT, LIVE_EVERY, MIN_GLOBAL_TOKENS, SamProposer

ANSWER = list(range(100, 160))   # 60 distinct tokens: a request's own text never repeats


def _prop(**kw) -> SamProposer:
    return SamProposer(8, sam_global_tokens=MIN_GLOBAL_TOKENS, **{"sam_global_live": True, **kw})


def _commit(prop: SamProposer, req_id: str, tokens: list[int]) -> None:
    for t in tokens:   # one committed token a step
        prop.observe(req_id, [t])


def _running_pair(prop: SamProposer, a_info: RequestInfo, b_info: RequestInfo,
                  a_tokens: int = 40, b_tokens: int = 5):
    """Request a commits ``a_tokens`` of ANSWER while b, started beside it,
    commits ANSWER's first ``b_tokens``; b's draft, with neither finished."""
    prop.start("a", [1, 2, 3], a_info)
    prop.start("b", [4, 5, 6], b_info)
    _commit(prop, "a", ANSWER[:a_tokens])
    _commit(prop, "b", ANSWER[:b_tokens])
    return prop.propose("b", 8).tokens.tolist()


def test_a_running_request_drafts_from_another_running_request_of_its_tenant():
    prop = _prop()
    draft = _running_pair(prop, RequestInfo((), 3), RequestInfo((), 3))
    assert draft and draft == ANSWER[5:5 + len(draft)]
    assert prop.stats["global_drafts"] == 1
    # windows of LIVE_EVERY new output tokens, each with the LIVE_CONTEXT before it
    docs = prop.global_store.documents()
    assert docs == [ANSWER[:LIVE_EVERY], ANSWER[LIVE_EVERY - LIVE_CONTEXT:2 * LIVE_EVERY]]


def test_without_live_windows_only_finished_requests_feed_the_store():
    prop = _prop(sam_global_live=False)
    assert _running_pair(prop, RequestInfo((), 3), RequestInfo((), 3)) == []
    assert prop.global_store is None or prop.global_store.num_documents == 0


@pytest.mark.parametrize("b_tenant", [("other", None), None])
def test_live_windows_stay_with_their_tenant(b_tenant):
    prop = _prop()
    assert _running_pair(prop, RequestInfo(("salt-a", None), 3), RequestInfo(b_tenant, 3)) == []
    # and a's own tenant would have drafted it
    assert prop.stores.get(("salt-a", None), create=False).num_documents == 2


def test_a_request_with_stop_strings_feeds_no_live_window():
    """Its output is not known to have reached the user (``OutputEnd.unknown``)."""
    prop = _prop()
    a = RequestInfo((), 3, OutputEnd(unknown=True))
    assert _running_pair(prop, a, RequestInfo((), 3)) == []


def test_live_windows_end_at_the_output_the_user_receives():
    """Nothing past a stop token enters (a verify step can commit accepted
    draft tokens after it that vLLM drops)."""
    prop = _prop()
    stop = ANSWER[20]
    a = RequestInfo((), 3, OutputEnd(frozenset({stop})))
    _running_pair(prop, a, RequestInfo((), 3), a_tokens=40)
    docs = prop.global_store.documents()
    assert docs == [ANSWER[:LIVE_EVERY]]        # 21 received: one window, nothing past 20
    assert all(t not in d for d in docs for t in ANSWER[21:])


def test_live_marks_are_freed_with_their_requests():
    prop = _prop()
    _running_pair(prop, RequestInfo((), 3), RequestInfo((), 3))
    assert prop.structure_sizes()["sam_live_marks"] == 1     # a wrote windows, b not yet
    for rid in ("a", "b"):
        prop.complete(rid)
        prop.finish(rid)
    assert prop.structure_sizes()["sam_live_marks"] == 0
