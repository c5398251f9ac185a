"""`sam_global_bytes`: a cap in bytes on sam's global store (issue 35: bound
it "in tokens and bytes"). No vLLM, no engine."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_specplug.options import SpecPlugConfigError, validate_options
from vllm_specplug.proposers.global_store import DEFAULT_SEGMENTS, GlobalStore, tokens_for_bytes
from vllm_specplug.proposers.sam import MIN_GLOBAL_TOKENS, SamProposer


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 3_000_000))
def test_tokens_for_bytes_is_the_largest_store_that_fits(max_bytes):
    """Against the definition, checked at the answer and one token above."""
    t = tokens_for_bytes(max_bytes)
    if t:
        assert GlobalStore(t).max_nbytes() <= max_bytes
    if t + 1 >= DEFAULT_SEGMENTS:       # the smallest store there is
        assert GlobalStore(t + 1).max_nbytes() > max_bytes


def test_tokens_for_bytes_brute_force_on_small_stores():
    sizes = {t: GlobalStore(t, num_segments=2).max_nbytes() for t in range(2, 400)}
    for b in range(0, max(sizes.values()) + 50, 97):
        want = max((t for t, n in sizes.items() if n <= b), default=0)
        assert tokens_for_bytes(b, num_segments=2) == want, b


def test_a_byte_cap_bounds_the_store_under_traffic():
    cap = 2_000_000
    prop = SamProposer(8, sam_global_tokens=500_000, sam_global_bytes=cap)
    assert prop.stores.max_tokens == tokens_for_bytes(cap) < 500_000
    assert prop.stores.max_nbytes <= cap
    rng = np.random.default_rng(0)
    for i in range(300):     # ~3x the capped budget in finished outputs
        rid = f"r{i}"
        prop.start(rid, rng.integers(0, 400, size=20).tolist())
        prop.observe(rid, rng.integers(0, 400, size=int(rng.integers(20, 80))).tolist())
        prop.complete(rid)
        prop.finish(rid)
        assert prop.stores.allocated_nbytes() <= cap
    assert prop.stores.num_tokens <= prop.stores.max_tokens
    # a cap above the token budget's bytes changes nothing
    loose = SamProposer(8, sam_global_tokens=4096, sam_global_bytes=1 << 30)
    assert loose.stores.max_tokens == 4096


def test_a_cap_below_the_smallest_store_is_refused_naming_the_minimum():
    need = GlobalStore(MIN_GLOBAL_TOKENS).max_nbytes()
    with pytest.raises(SpecPlugConfigError, match=f"at least {need}"):
        validate_options("sam", SamProposer.options, {"sam_global_bytes": need - 1})
    assert validate_options("sam", SamProposer.options,
                            {"sam_global_bytes": need})["sam_global_bytes"] == need
    assert validate_options("sam", SamProposer.options, {})["sam_global_bytes"] == 0
