"""Tenants do not see each other through drafts (docs/security.md).

Requests of different tenants (``RequestInfo.tenant``: cache_salt and LoRA
adapter) never draft from each other's text: every edge of request B's
drafts (a token after the one before it, the last committed token first)
must then be one B's own text (sam) or B's own target top-k (Token
Recycling) produced. With the same tenant B does draft A's text (the positive
control that lets these tests fail). Also: the tenancy bounds, the opt-out,
the adapter's key, and the two ways prompts entered the global store while
``sam_global_prompts`` is off.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from vllm_specplug.bench.simulate import accepted_length
from vllm_specplug.config import translate
from vllm_specplug.options import SpecPlugConfigError
from vllm_specplug.proposers import sam as sam_module
from vllm_specplug.proposers.base import RequestInfo, TargetTopK, start_request
from vllm_specplug.proposers.hybrid import SamTokenRecyclingProposer
from vllm_specplug.proposers.sam import SamProposer
from vllm_specplug.proposers.tenants import Partitions, TenantStores
from vllm_specplug.proposers.token_recycling import TokenRecyclingProposer
from vllm_specplug.vllm_adapter.v1 import tenancy

ANSWER = [100 + i for i in range(40)]          # no token repeats: no self-match
OTHER = [500 + i for i in range(30)]
FILLER = 9000                                   # the second top-k candidate


def topk_rows(inputs: list[int], truth: dict[int, int]) -> TargetTopK:
    """The target's top-2 after each input: its true next token, then FILLER."""
    rows = np.array([[truth.get(t, FILLER + 1), FILLER] for t in inputs], dtype=np.int32)
    return TargetTopK(np.asarray(inputs, dtype=np.int32), rows, np.zeros(rows.shape))


def run(prop, req_id: str, prompt: list[int], out: list[int], info: RequestInfo,
        budget: int = 8) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Replay one request greedily; per step (context, draft edges), an edge
    being (parent token, token), the last committed token parenting roots.
    Proposers that want the target's top-k get the truth's rows."""
    truth = {t: n for t, n in zip(out, out[1:])}
    ctx = list(prompt) + out[:1]
    start_request(prop, req_id, ctx, info)
    steps, pos = [], 1
    while pos < len(out):
        draft = prop.propose(req_id, budget)
        tokens, parents = draft.tokens.tolist(), draft.parent_array().tolist()
        edges = [(tokens[p] if p >= 0 else ctx[-1], t) for t, p in zip(tokens, parents)]
        steps.append((list(ctx), edges))
        n = min(accepted_length(draft, out, pos) + 1, len(out) - pos)
        committed = out[pos:pos + n]
        rows = None
        if prop.wants_target_topk:
            rows = topk_rows([ctx[-1]] + committed[:-1], truth)
        prop.observe(req_id, committed, rows)
        ctx += committed
        pos += n
    prop.complete(req_id)
    prop.finish(req_id)
    return steps


def bigrams(tokens: list[int]) -> set[tuple[int, int]]:
    return set(zip(tokens, tokens[1:]))


def foreign_edges(steps, own) -> list[tuple[int, int]]:
    """Draft edges not explained by the request's own text so far: ``own``
    maps the step's context to the edges it may draft."""
    return [e for ctx, edges in steps for e in edges if e not in own(ctx)]


def sam_tenants(a_tenant, b_tenant, prop=None):
    """A produces ANSWER, then B (another prompt) produces ANSWER too."""
    prop = prop or SamProposer(8, sam_min_accept_prob=0.0)
    run(prop, "a", [1, 2, 3], ANSWER, RequestInfo(a_tenant, 3))
    return run(prop, "b", [7, 8], ANSWER, RequestInfo(b_tenant, 2))


# ------------------------------------------------------------------ sam
@pytest.mark.parametrize("a_tenant, b_tenant", [
    (("salt-a", None), ("salt-b", None)),      # two salts
    (("s", "lora-1"), ("s", "lora-2")),        # one salt, two adapters
    ((), ("salt-b", None)),                    # unsalted A, salted B
    (None, ()),                                # A opted out: it feeds nothing
    ((), None),                                # B opted out: it reads nothing
])
def test_sam_never_drafts_another_tenants_text(a_tenant, b_tenant):
    steps = sam_tenants(a_tenant, b_tenant)
    assert foreign_edges(steps, bigrams) == []


@pytest.mark.parametrize("tenant", [(), ("salt-a", None), ("s", "lora-1")])
def test_sam_drafts_the_same_tenants_text(tenant):
    """The positive control: the same checks fail when B shares A's tenant."""
    steps = sam_tenants(tenant, tenant)
    foreign = foreign_edges(steps, bigrams)
    assert len(foreign) >= 20 and set(foreign) <= bigrams(ANSWER)


def test_sam_tenants_in_one_proposer_keep_their_own_stores():
    # documents counted: finished outputs only (live windows: tests/test_sam_live.py)
    prop = SamProposer(8, sam_min_accept_prob=0.0, sam_global_live=False)
    run(prop, "a", [1], ANSWER, RequestInfo(("x", None), 1))
    run(prop, "c", [2], OTHER, RequestInfo(("y", None), 1))
    prop.start("z", [3], RequestInfo(None))   # finished outputs are added from here
    assert len(prop.stores) == 2 and prop.debug_stats()["global_store_tenants"] == 2
    assert prop.stores.peek(("x", None)).documents() == [ANSWER]
    assert prop.stores.peek(("y", None)).documents() == [OTHER]
    # a "y" request producing ANSWER drafts nothing; an "x" one drafts it
    assert foreign_edges(run(prop, "b", [7], ANSWER, RequestInfo(("y", None), 1)),
                         bigrams) == []
    assert foreign_edges(run(prop, "d", [7], ANSWER, RequestInfo(("x", None), 1)), bigrams)


def test_an_opted_out_request_has_no_store_match_and_adds_nothing():
    prop = SamProposer(8)
    run(prop, "a", [1], ANSWER, RequestInfo(None, 1))
    prop.start("z", [3], RequestInfo(None))   # finished outputs are added from here
    assert len(prop.stores) == 0 and prop.stores.num_tokens == 0
    assert "a" not in prop._tenant and not prop._global_matches


# ------------------------------------------------------------------ Token Recycling
def tr_own_edges(out):
    """Edges B's own top-k rows can give: its true next tokens so far and
    FILLER after them (the rows it observed), and its prompt's bigrams."""
    def own(ctx):
        edges = bigrams(ctx)
        for t in ctx:
            edges |= {(t, FILLER), (FILLER, FILLER), (FILLER, FILLER + 1)}
        return edges
    return own


@pytest.mark.parametrize("cls", [TokenRecyclingProposer, SamTokenRecyclingProposer])
@pytest.mark.parametrize("a_tenant, b_tenant", [
    (("salt-a", None), ("salt-b", None)), ((), ("s", "lora")), (None, ()), ((), None)])
def test_token_recycling_never_drafts_another_tenants_rows(cls, a_tenant, b_tenant):
    prop = cls(8, tr_topk=2, sam_min_accept_prob=0.0) if cls is SamTokenRecyclingProposer \
        else cls(8, tr_topk=2)
    steps = sam_tenants(a_tenant, b_tenant, prop)
    assert foreign_edges(steps, tr_own_edges(ANSWER)) == []


@pytest.mark.parametrize("cls", [TokenRecyclingProposer, SamTokenRecyclingProposer])
def test_token_recycling_drafts_the_same_tenants_rows(cls):
    prop = cls(8, tr_topk=2, sam_min_accept_prob=0.0) if cls is SamTokenRecyclingProposer \
        else cls(8, tr_topk=2)
    steps = sam_tenants(("s", None), ("s", None), prop)
    foreign = foreign_edges(steps, tr_own_edges(ANSWER))
    a_rows = bigrams(ANSWER) | {(t, FILLER) for t in ANSWER}
    assert len(foreign) >= 20 and set(foreign) <= a_rows


def test_token_recycling_private_matrix_is_freed_and_sparse():
    prop = TokenRecyclingProposer(8, tr_topk=2)
    start_request(prop, "p", [1, 2, 3], RequestInfo(None, 2))
    prop.observe("p", [4], topk_rows([3], {3: 4}))
    assert len(prop.parts) == 0 and 0 < prop.state_nbytes() < 10_000
    prop.finish("p")
    assert prop.state_nbytes() == 0 and not prop._adj


# ------------------------------------------------------------------ bounds
def test_partitions_keep_the_most_recently_used():
    made = []
    parts = Partitions(lambda: made.append(1) or len(made), 2)
    parts.get("a"), parts.get("b"), parts.get("a"), parts.get("c")
    assert list(k for k, _ in parts.items()) == ["a", "c"] and parts.dropped == 1
    assert parts.get("b", create=False) is None and len(made) == 3


def test_tenant_stores_share_one_token_budget():
    stores = TenantStores(4096, 8)
    rng = np.random.default_rng(0)
    for i in range(40):
        stores.add(("t", i % 12), rng.integers(0, 50_000, 300).tolist())
        assert len(stores) <= 8
        assert stores.num_tokens <= 4096
        assert stores.resident_nbytes() <= stores.max_nbytes
    # the newest tenant's document is always kept
    assert stores.peek(("t", 39 % 12)).num_documents >= 1


def test_tenant_stores_drop_stores_to_keep_their_bytes():
    stores = TenantStores(4096, 64)
    for i in range(64):
        stores.add(i, [1, 2, 3, 4])
        assert stores.resident_nbytes() <= stores.max_nbytes
    assert len(stores) < 64   # each store's hash table costs bytes: some were dropped


def test_sam_tenants_are_bounded():
    prop = SamProposer(8, sam_global_tenants=3, sam_global_tokens=4096)
    for i in range(10):
        run(prop, f"r{i}", [1], OTHER, RequestInfo(("salt", str(i)), 1))
    assert len(prop.stores) == 3


def test_token_recycling_tenants_are_bounded():
    prop = TokenRecyclingProposer(8, tr_topk=2, tr_tenants=2)
    for i in range(5):
        run(prop, f"r{i}", [1], OTHER[:5], RequestInfo((str(i), None), 1))
    assert len(prop.parts) == 2 and prop.debug_stats()["tenants"] == 2


# ------------------------------------------------------------------ the prompts stay out
def test_a_prompt_forgotten_past_max_tracked_prompts_does_not_enter_the_store(monkeypatch):
    """More live requests than MAX_TRACKED_PROMPTS: the oldest one's prompt
    length is forgotten; its prompt must not then go to the store whole."""
    monkeypatch.setattr(sam_module, "MAX_TRACKED_PROMPTS", 2, raising=False)
    prop = SamProposer(8)
    prompt = [11, 12, 13, 14]
    prop.start("a", prompt + ANSWER[:1])
    prop.start("b", [1, 2])
    prop.start("c", [3, 4])
    prop.observe("a", ANSWER[1:10])
    prop.complete("a")
    prop.finish("a")
    prop.start("z", [3])                      # finished outputs are added from here
    for doc in prop.global_store.documents():
        assert not set(prompt) & set(doc), doc


def test_a_request_aborted_while_preempted_leaves_nothing_behind(patch_calls):
    """Preempted (it left the batch: state freed, prompt length kept), then
    aborted (the runner removes its state): nothing of it may stay."""
    from helpers import make_vllm_config, step

    from vllm_specplug.vllm_adapter.v1.drafter import SpecPlugDrafter

    d = SpecPlugDrafter(make_vllm_config({"method": "sam", "num_speculative_tokens": 4}))
    hist = [1, 2, 3, ANSWER[0]]
    step(d, ["a"], [hist], [[ANSWER[0]]])
    step(d, ["a"], [hist + ANSWER[1:2]], [[ANSWER[1]]])
    step(d, ["b"], [[7, 8, 9]], [[9]])          # "a" left the batch: preempted
    d.finish_request("a")                        # then aborted
    assert "a" not in d.proposer._prompt_len
    assert "a" not in d.requests
    d.finish_request("b")
    assert not d.proposer._prompt_len and not d.requests


def test_the_adapters_prompt_length_is_exact_over_a_preemption():
    prop = SamProposer(8)
    prop.start("a", [1, 2] + ANSWER[:1], RequestInfo((), 2))
    prop.observe("a", ANSWER[1:6])
    prop.finish("a")                                       # preempted
    prop.start("a", [1, 2] + ANSWER[:6], RequestInfo((), 2))
    prop.observe("a", ANSWER[6:9])
    prop.complete("a")
    prop.finish("a")
    prop.start("z", [3])                      # finished outputs are added from here
    assert prop.global_store.documents() == [ANSWER[:9]]


# ------------------------------------------------------------------ the adapter's key
class _Params:
    def __init__(self, extra_args=None):
        self.extra_args = extra_args
        self.max_tokens = None


class _State:
    def __init__(self, extra_args=None, lora=None, prompt=3):
        self.sampling_params = _Params(extra_args)
        self.lora_request = None if lora is None else (
            lora if isinstance(lora, SimpleNamespace)
            else SimpleNamespace(lora_name=lora, lora_int_id=1, lora_path=f"/a/{lora}"))
        self.num_prompt_tokens = prompt


def _new(req_id, salt):
    return SimpleNamespace(req_id=req_id, **{tenancy.SALT_ATTR: salt})


def _info(runner, req_id, news, mode, scheduled=True):
    """``request_info_of`` with the salt recorded from a scheduler output
    holding ``news`` (as the drafter records it in the request's record)."""
    salts = dict(tenancy.new_request_salts(SimpleNamespace(scheduled_new_reqs=news)))
    return tenancy.request_info_of(runner, req_id, mode, scheduled,
                                   salts.get(req_id, tenancy.NOT_RECORDED))


@pytest.mark.parametrize("mode, salt, lora, extra, want", [
    ("salt", None, None, None, ()),
    ("salt", "s1", None, None, ("s1", None)),
    ("salt", None, "ad", None, (None, ("ad", 1, "/a/ad"))),
    ("salt", "s1", "ad", {"specplug_share": True}, ("s1", ("ad", 1, "/a/ad"))),
    ("salt", "s1", "ad", {"specplug_share": 1}, ("s1", ("ad", 1, "/a/ad"))),
    ("salt", "s1", None, {"specplug_share": False}, None),
    ("salt", "s1", None, {"specplug_share": 0}, None),     # the OpenAI server's false
    ("salt", "s1", None, {"specplug_share": "no"}, None),  # malformed: the safe side
    ("salt", "s1", None, {"other": 1}, ("s1", None)),
    ("none", "s1", "ad", None, ()),
    ("none", "s1", None, {"specplug_share": False}, None),
    ("request", None, None, None, None),
])
def test_request_info_from_the_runners_state(mode, salt, lora, extra, want):
    runner = SimpleNamespace(requests={"r": _State(extra, lora, prompt=5)})
    info = _info(runner, "r", [_new("r", salt)], mode)
    assert info == RequestInfo(want, 5)


def test_a_request_without_a_recorded_salt_shares_nothing_and_says_why():
    runner = SimpleNamespace(requests={"r": _State()})
    with pytest.raises(RuntimeError, match="no cache_salt was recorded"):
        _info(runner, "r", [], "salt")
    # a NewRequestData without our attribute (the patch did not run) too
    with pytest.raises(RuntimeError, match="no cache_salt was recorded"):
        _info(runner, "r", [SimpleNamespace(req_id="r")], "salt")


def test_a_real_runner_without_any_recorded_scheduler_output_fails_closed():
    """Issue 45 item 8: with a runner but no scheduler output recorded (the
    ``_update_states`` patch did not run), a salted request must not join the
    no-salt tenant: the lookup raises (the request drafts without
    cross-request memory), it never returns the shared key ``()``."""
    runner = SimpleNamespace(requests={"r": _State()})
    with pytest.raises(RuntimeError, match="no scheduler output was recorded"):
        _info(runner, "r", [], "salt", scheduled=False)
    # modes that do not read the salt need no scheduler output
    assert _info(runner, "r", [], "none", scheduled=False).tenant == ()
    assert _info(runner, "r", [], "request", scheduled=False).tenant is None


def test_a_lora_name_re_pointed_to_another_adapter_is_another_tenant():
    """Issue 45 item 5: the LoRA part of the key holds the adapter's name, id
    and path, so a name loaded again from another path (or under another id)
    never drafts from the previous adapter's outputs."""
    news = [_new(r, None) for r in "abcd"]
    ad = lambda name, i, path: SimpleNamespace(lora_name=name, lora_int_id=i, lora_path=path)
    runner = SimpleNamespace(requests={
        "a": _State(lora=ad("x", 1, "/v1")), "b": _State(lora=ad("x", 1, "/v2")),
        "c": _State(lora=ad("x", 2, "/v1")), "d": _State(lora=ad("x", 1, "/v1"))})
    keys = {r: _info(runner, r, news, "salt").tenant for r in "abcd"}
    assert len({keys["a"], keys["b"], keys["c"]}) == 3
    assert keys["a"] == keys["d"]            # the same adapter: one tenant


def test_drafter_keeps_salted_requests_apart(patch_calls):
    """Through the drafter as the runner drives it: the scheduler's new
    requests carry their salt; B (another salt) gets no draft from A's
    output, C (A's salt) does."""
    from helpers import arrays, make_vllm_config

    from vllm_specplug.vllm_adapter.v1.drafter import SpecPlugDrafter

    d = SpecPlugDrafter(make_vllm_config({"method": "sam", "num_speculative_tokens": 4,
                                          "sam_min_accept_prob": 0.0}))
    d.runner = SimpleNamespace(requests={r: _State(prompt=2) for r in "abc"})

    def step(req_ids, hists, new=()):
        d.note_scheduler_output(SimpleNamespace(scheduled_new_reqs=list(new),
                                                total_num_scheduled_tokens=len(req_ids),
                                                finished_req_ids=set()))
        d.begin_step(list(req_ids), None)
        n, ids = arrays(hists)
        return d.propose([[h[-1]] for h in hists], n, ids)

    hist = [1, 2] + ANSWER[:1]
    step(["a"], [hist], [_new("a", "salt-1")])
    for t in ANSWER[1:12]:
        hist = hist + [t]
        step(["a"], [hist])
    d.finish_request("a")
    b = step(["b", "c"], [[7, 8] + ANSWER[:3], [5, 6] + ANSWER[:3]],
             [_new("b", "salt-2"), _new("c", "salt-1")])
    assert b == [[], ANSWER[3:7]]
    assert d.proposer.stores.peek(("salt-1", None)).documents() == [ANSWER[:12]]


# ------------------------------------------------------------------ options
def test_isolation_is_validated_before_the_engine_starts():
    assert translate({"method": "sam"})[1]["isolation"] == "salt"
    for mode in ("none", "request"):
        assert translate({"method": "token_recycling", "isolation": mode})[1]["isolation"] \
            == mode
    with pytest.raises(SpecPlugConfigError, match=r"isolation.*'salt', 'none', 'request'"):
        translate({"method": "sam", "isolation": "tenant"})


@pytest.mark.parametrize("extra, error", [
    ({"specplug_share": "false"}, "must be true or false"),
    ({"specplug_share": 2}, "must be true or false"),
    ({"specplug_share": 0.0}, "must be true or false"),
    ({"specplug_shared": False}, "unknown vllm_specplug keys"),
    ({"specplug": {"share": False}}, "unknown vllm_specplug keys"),
    ({"specplug_draft": "off"}, r"\['specplug_draft'\] must be true or false"),
    ({"specplug_draft": 2}, r"\['specplug_draft'\] must be true or false"),
    ({"specplug_max_draft": -1}, r"\['specplug_max_draft'\] must be an integer >= 0"),
    ({"specplug_max_draft": 2.0}, r"\['specplug_max_draft'\] must be an integer >= 0"),
    ({"specplug_max_draft": True}, r"\['specplug_max_draft'\] must be an integer >= 0"),
    ({"specplug_maxdraft": 2}, "unknown vllm_specplug keys.*'specplug_max_draft'"),
])
def test_a_malformed_opt_out_is_refused(extra, error):
    with pytest.raises(ValueError, match=error):
        tenancy.check_extra_args(extra)


@pytest.mark.parametrize("extra", [{"specplug_draft": False}, {"specplug_draft": 1},
                                   {"specplug_max_draft": 0}, {"specplug_max_draft": 3},
                                   {"specplug_draft": 0, "specplug_share": 0}])
def test_per_request_draft_keys_are_accepted(extra):
    tenancy.check_extra_args(extra)


class _CapParams:
    def __init__(self, extra):
        self.extra_args = extra


class _CapRunner:
    def __init__(self, extra):
        self.requests = {"r": type("S", (), {"sampling_params": _CapParams(extra)})()}


@pytest.mark.parametrize("extra, cap", [
    (None, None), ({}, None), ({"other": 1}, None),
    ({"specplug_draft": True}, None), ({"specplug_draft": 1}, None),
    ({"specplug_draft": False}, 0), ({"specplug_draft": 0}, 0),
    ({"specplug_max_draft": 3}, 3), ({"specplug_max_draft": 0}, 0),
    ({"specplug_draft": 0, "specplug_max_draft": 3}, 0),
    ({"specplug_max_draft": "3"}, 0),     # malformed (refused by vLLM with our patch): none
    ({"specplug_draft": "yes"}, 0),
])
def test_the_request_draft_cap(extra, cap):
    assert tenancy.draft_cap(_CapRunner(extra), "r") == cap
    assert tenancy.draft_cap(None, "r") is None


def test_vllm_refuses_a_malformed_opt_out_when_patched():
    """The patch of ``SamplingParams._verify_extra_args`` refuses it where vLLM
    validates the request (a 400 from the server)."""
    from vllm import SamplingParams

    from vllm_specplug.vllm_adapter import v1 as adapter
    from vllm_specplug.vllm_adapter.patching import apply

    apply(adapter.EXTRA_ARGS_PATCH)
    SamplingParams(extra_args={"specplug_share": False})
    SamplingParams(extra_args={"other_plugin": "x"})
    with pytest.raises(ValueError, match="must be true or false"):
        SamplingParams(extra_args={"specplug_share": "no"})


def test_new_request_data_carries_the_salt():
    """The scheduler-side patch copies ``Request.cache_salt`` onto the
    ``NewRequestData`` the workers receive."""
    class Fake:
        @classmethod
        def from_request(cls, request, block_ids):
            return SimpleNamespace(req_id=request.request_id)

    made = tenancy.make_from_request(Fake.__dict__["from_request"])
    new = made.__get__(None, Fake)(SimpleNamespace(request_id="r", cache_salt="s"), ())
    assert getattr(new, tenancy.SALT_ATTR) == "s"


def test_a_start_without_info_keeps_working():
    """Proposers written before ``RequestInfo`` (two-argument ``start``, as
    examples/third_party_plugin's) are started without it."""
    from vllm_specplug.proposers.testing import RandomTreeProposer

    class Old(RandomTreeProposer):
        def start(self, req_id, token_ids):
            self.started = (req_id, list(token_ids))

    old = Old(4)
    start_request(old, "r", [1, 2], RequestInfo(None, 1))
    assert old.started == ("r", [1, 2])
    seen = []
    new = SamProposer(4)
    new.start = lambda req_id, token_ids, info=None: seen.append(info)
    start_request(new, "r", [1, 2], RequestInfo(("s", None), 1))
    assert seen == [RequestInfo(("s", None), 1)]
