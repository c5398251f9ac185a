"""Token Recycling's cross-request memory under concurrency and its prompts
(issue 45, "Trust, second pass": items 1, 2 and 10c; docs/security.md).

* Item 1: a running request's tenant is pinned, so the full matrices alive
  (kept, or held by a running request) never exceed ``tr_tenants`` however
  many tenants run at once; ``sizes.tr_matrices`` reports them; finishing
  (or preempting, or restarting) a request unpins.
* Item 2: a prompt's bigrams serve its own request only, never the tenant's
  shared matrix (nor the saved one).
* Item 10c: reading or saving the default tenant's matrix neither makes it
  nor evicts a tenant.
No vLLM, milliseconds.
"""
from __future__ import annotations

import gc
import weakref

import numpy as np

from vllm_specplug.proposers.base import RequestInfo, TargetTopK, start_request
from vllm_specplug.proposers.hybrid import SamTokenRecyclingProposer
from vllm_specplug.proposers.tenants import Partitions
from vllm_specplug.proposers.token_recycling import TokenRecyclingProposer


def topk(inputs, rows) -> TargetTopK:
    rows = np.asarray(rows, dtype=np.int32)
    return TargetTopK(np.asarray(inputs, dtype=np.int32), rows, np.zeros(rows.shape))


def track_matrices(prop) -> list:
    """Weak references to every tenant matrix the proposer makes from now on."""
    made = []
    factory = prop.parts.factory

    def tracked():
        adj = factory()
        made.append(weakref.ref(adj))
        return adj

    prop.parts.factory = tracked
    return made


def alive(made) -> int:
    gc.collect()
    return sum(r() is not None for r in made)


# ---------------------------------------------------------------- item 1
def test_partitions_never_drop_a_pinned_partition():
    parts = Partitions(dict, 2)
    a = parts.acquire("a")
    parts.acquire("b")
    assert parts.acquire("c") is None and "c" not in parts      # both pinned: nothing made
    assert parts.get("a", create=False) is a and len(parts) == 2
    parts.unpin("b")
    assert parts.acquire("c") is not None                       # b, idle, made room
    assert list(k for k, _ in parts.items()) == ["a", "c"] and parts.dropped == 1
    assert parts.acquire("a") is a and parts.num_pinned == 2    # two pins on a
    parts.unpin("a")
    assert parts.pinned("a")
    parts.unpin("a"), parts.unpin("c")
    assert parts.num_pinned == 0
    parts.acquire("d", pin=False)                                # droppable at once
    assert len(parts) == 2 and not parts.pinned("d")


def test_partitions_without_pins_behave_as_before():
    """sam's stores never pin: ``get`` keeps its least recently used order."""
    made = []
    parts = Partitions(lambda: made.append(1) or len(made), 2)
    parts.get("a"), parts.get("b"), parts.get("a"), parts.get("c")
    assert list(k for k, _ in parts.items()) == ["a", "c"] and parts.dropped == 1


def test_concurrent_requests_keep_at_most_tr_tenants_matrices_alive():
    """64 requests under 64 salts running at once, tr_tenants=8: 8 matrices
    alive (the old code kept one per running request: 64), ``sizes`` says
    so, and every request still drafts (from its own text when no slot was
    free) and learns."""
    prop = TokenRecyclingProposer(8, tr_topk=4, tr_tenants=8)
    made = track_matrices(prop)
    n = 64
    for i in range(n):
        start_request(prop, f"r{i}", [1000 + i, 2000 + i], RequestInfo((f"salt-{i}", None), 2))
    for step in range(3):
        for i in range(n):
            last = prop._last[f"r{i}"]
            prop.observe(f"r{i}", [3000 + step], topk([last], [[3000 + step, 5, 6, 7]]))
        assert alive(made) <= 8        # once a step: gc.collect is slow on a big heap
    assert alive(made) == 8
    sizes = prop.structure_sizes()
    assert sizes["tr_matrices"] == 8 and sizes["tr_private_matrices"] == n - 8
    stats = prop.debug_stats()
    assert stats["tenants"] == 8 and stats["tenants_running"] == 8
    assert stats["tenant_overflows"] == n - 8
    # every request drafts what it learned itself (own matrix or its tenant's)
    for i in range(n):
        prop.observe(f"r{i}", [4000], topk([3002], [[4000, 1, 2, 3]]))
        prop.update(np.array([4000]), np.array([[9, 9, 9, 9]]),
                    prop._adj[f"r{i}"][1])
        assert len(prop.propose(f"r{i}", 4)) > 0
    # finishing (here half preempted: finish without complete) unpins
    for i in range(n):
        if i % 2:
            prop.complete(f"r{i}")
        prop.finish(f"r{i}")
    sizes = prop.structure_sizes()
    assert sizes["tr_private_matrices"] == 0 and sizes["tr_matrices"] <= 8
    assert prop.parts.num_pinned == 0 and prop.state_nbytes() == 0
    # with the slots free again, 8 new tenants each get a tenant matrix
    for i in range(8):
        start_request(prop, f"n{i}", [1, 2], RequestInfo((f"new-{i}", None), 2))
    sizes = prop.structure_sizes()
    assert sizes["tr_private_matrices"] == 0 and sizes["tr_matrices"] == 8
    assert alive(made) == 8


def test_a_running_tenants_matrix_is_neither_dropped_nor_restarted_empty():
    """tr_tenants=2: A runs while B and C start. The old code dropped A's
    matrix for C, so A's next request began from an empty one; now A stays,
    C drafts from its own text, and A's next request drafts A's rows."""
    prop = TokenRecyclingProposer(4, tr_topk=2, tr_tenants=2, tr_prompt_bigrams=False)
    a, b, c = ("a", None), ("b", None), ("c", None)
    start_request(prop, "a1", [10], RequestInfo(a, 1))
    prop.observe("a1", [11], topk([10], [[11, 12]]))
    start_request(prop, "b1", [20], RequestInfo(b, 1))
    prop.observe("a1", [12], topk([11], [[12, 13]]))
    start_request(prop, "c1", [30], RequestInfo(c, 1))
    prop.observe("a1", [13], topk([12], [[13, 14]]))      # a1 keeps learning into A's
    assert a in prop.parts and b in prop.parts and c not in prop.parts
    start_request(prop, "a2", [10], RequestInfo(a, 1))
    assert prop.propose("a2", 4).tokens[:1].tolist() == [11]
    assert prop.structure_sizes()["tr_matrices"] == 2
    # a restart of the same id (a rebuild) does not pin twice
    start_request(prop, "b1", [20, 21], RequestInfo(b, 2))
    prop.finish("b1")
    assert not prop.parts.pinned(b)
    start_request(prop, "c2", [30], RequestInfo(c, 1))    # B, idle, gives way
    assert c in prop.parts and b not in prop.parts and a in prop.parts


def test_the_hybrid_frees_its_token_recycling_pins():
    prop = SamTokenRecyclingProposer(8, tr_topk=2, tr_tenants=2, sam_min_accept_prob=0.0)
    for i in range(6):
        start_request(prop, f"r{i}", [1, 2, 3], RequestInfo((str(i), None), 3))
    assert prop.structure_sizes()["tr_matrices"] == 2
    for i in range(6):
        prop.complete(f"r{i}")
        prop.finish(f"r{i}")
    assert prop.tr.parts.num_pinned == 0
    assert prop.structure_sizes()["tr_private_matrices"] == 0


# ---------------------------------------------------------------- item 2
PROMPT = [300, 301, 302, 303, 304, 300]      # the secret: 300 301 302 303 304


def test_a_prompt_serves_its_own_request_and_never_the_tenants_matrix(tmp_path):
    """Default options: A's prompt bigrams give A drafts, but B (same
    tenant, started after A, then after A finished) drafts none of them, and
    neither the shared nor the saved matrix holds them."""
    path = tmp_path / "tr.npy"
    prop = TokenRecyclingProposer(8, tr_topk=2, tr_save_matrix=str(path))
    assert prop.prompt_bigrams                          # the default
    start_request(prop, "a", PROMPT, RequestInfo((), len(PROMPT)))
    own = prop.propose("a", 4).tokens.tolist()
    assert own[:3] == [301, 302, 303]                   # the benefit is kept
    start_request(prop, "b", [300], RequestInfo((), 1))
    assert prop.propose("b", 4).tokens.tolist() == []   # not while A runs
    prop.observe("a", [5], topk([300], [[5, 6]]))      # the target's lesson is shared
    prop.finish("a")
    assert prop.propose("b", 4).tokens.tolist() == [5, 6]   # the lesson, no prompt token
    for t in PROMPT[:-1]:
        assert (prop.matrix[t] == -1).all() if t != 300 else prop.matrix[t].tolist() == [5, 6]
    prop.finish("b")
    saved = np.load(path, allow_pickle=False)
    assert saved[300].tolist() == [5, 6] and (saved[301:305] == -1).all()


def test_an_own_matrix_also_keeps_its_prompt_apart():
    """An opted-out request drafts its prompt too; its matrix holds only
    what the target taught it, and its prompt's bigrams cost 8 bytes a
    distinct token, freed at finish."""
    prop = TokenRecyclingProposer(8, tr_topk=2)
    start_request(prop, "p", PROMPT, RequestInfo(None, len(PROMPT)))
    assert prop.propose("p", 4).tokens.tolist()[:2] == [301, 302]
    view = prop._adj["p"][1]
    assert view.adj.rows == {} and view.prompt.nbytes() == 8 * 5
    prop.finish("p")
    assert prop.state_nbytes() == 0


# ---------------------------------------------------------------- item 10c
def test_reading_or_saving_the_matrix_never_makes_the_default_tenant(tmp_path):
    """tr_tenants=2, two salted tenants kept: ``.matrix``, ``save_matrix``
    and the save when the last request finishes neither make the no-salt
    tenant nor evict a real one; nothing is written for a tenant that does
    not exist (an earlier file is kept)."""
    path = tmp_path / "tr.npy"
    prop = TokenRecyclingProposer(4, tr_topk=2, tr_tenants=2, tr_save_matrix=str(path))
    for salt in ("a", "b"):
        start_request(prop, salt, [10], RequestInfo((salt, None), 1))
        prop.observe(salt, [11], topk([10], [[11, 12]]))
    kept = [("a", None), ("b", None)]
    prop.finish("a")
    prop.finish("b")                                   # the last one: a save is due
    assert [k for k, _ in prop.parts.items()] == kept and not path.exists()
    assert prop.matrix.shape == (0, 2)
    assert [k for k, _ in prop.parts.items()] == kept
    assert prop.save_matrix(str(path)) is False and not path.exists()
    assert [k for k, _ in prop.parts.items()] == kept
    assert prop.debug_stats()["tenants"] == 2
    # once the default tenant exists it is saved, still without evicting
    start_request(prop, "c", [10], RequestInfo((), 1))  # evicts idle A: a real request
    prop.observe("c", [11], topk([10], [[11, 13]]))
    prop.finish("c")
    assert np.load(path, allow_pickle=False)[10].tolist() == [11, 13]
    assert [k for k, _ in prop.parts.items()] == [("b", None), ()]
