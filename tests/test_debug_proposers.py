"""The debug proposers used by the engine tests (no vLLM)."""
import pytest

from vllm_specplug.proposers.testing import RandomTreeProposer


def _depths(parents):
    d = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


def test_random_tokens_per_position_follow_depth_and_progress():
    p = RandomTreeProposer(6, random_tokens="1,2;3,4;5", random_shape="tree")
    p.start("r", [9, 9, 9])
    for generated in range(4):
        draft = p.propose("r", 6)
        for tok, d in zip(draft.tokens, _depths(draft.parents)):
            allowed = ({1, 2}, {3, 4}, {5})[min(generated + d, 2)]
            assert int(tok) in allowed
        p.observe("r", [7])


def test_random_chain_shape_and_sizes():
    p = RandomTreeProposer(8, random_shape="chain", random_sizes="2,5")
    p.start("a", [1, 2])
    p.start("b", [1, 2])
    a, b = p.propose("a", 8), p.propose("b", 8)
    assert len(a.tokens) == 2 and len(b.tokens) == 5 and b.is_chain
    assert list(b.parents) == [-1, 0, 1, 2, 3]


@pytest.mark.parametrize("bad", ["1,x", "1;;2", "a"])
def test_random_tokens_rejects_bad_lists(bad):
    opt = next(o for o in RandomTreeProposer.options if o.name == "random_tokens")
    assert opt.check(bad) is not None
    assert opt.check("1,2;3") is None and opt.check("") is None
