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


@pytest.mark.parametrize("room", [0, 1, 2, 3, 9])
def test_oracle_tree_hidden_depth_follows_a_cut(tmp_path, room):
    """Cut by depth (as at max_tokens), the oracle expects as many accepted
    tokens as the true path keeps: min(hidden depth, room)."""
    import json

    import numpy as np

    from vllm_specplug.budget import subset
    from vllm_specplug.proposers.testing import OracleTreeProposer
    from vllm_specplug.tree import depths

    f = tmp_path / "oracle.json"
    f.write_text(json.dumps({"sequences": [[1, 2, 3, 10, 11, 12, 13, 14, 15]]}))
    seen = set()
    for seed in range(12):
        p = OracleTreeProposer(9, oracle_file=str(f), oracle_width=2, oracle_seed=seed)
        p.start("r", [1, 2, 3])
        draft = p.propose("r", 9)
        hidden = p._pending["r"]
        kept = subset(draft, depths(draft.parent_array()) <= room)
        p.draft_cut("r", kept)
        assert p._pending["r"] == min(hidden, room)
        seen.add(hidden)
        p.observe("r", [10, 11, 12, 13][: min(hidden, room)] + [99])
        assert p.stats["mismatched_steps"] == 0
    assert len(seen) > 1   # several hidden depths were drawn
