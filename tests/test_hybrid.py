"""SAM[TR] hybrid: branch choice by match length, both parts kept in sync."""
from __future__ import annotations

import numpy as np
import pytest

from vllm_specplug.config import build_proposer, translate
from vllm_specplug.options import SpecPlugConfigError
from vllm_specplug.proposers.base import TargetTopK
from vllm_specplug.proposers.hybrid import SamTokenRecyclingProposer


def _topk(inputs, rows):
    rows = np.asarray(rows, dtype=np.int32)
    return TargetTopK(np.asarray(inputs, dtype=np.int32), rows, np.zeros(rows.shape))


def test_long_match_drafts_sams_chain_else_a_tree():
    p = SamTokenRecyclingProposer(8, sam_tr_threshold=3, sam_min_accept_prob=0.0,
                                  tr_prompt_bigrams=False, tr_topk=2)
    text = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8]          # suffix 5 6 7 8 seen before
    p.start("a", text)
    assert p.match_len("a") == 4
    d = p.propose("a", 8)
    assert d.is_chain and d.tokens[:3].tolist() == [9, 10, 11]
    p.observe("a", [9, 10, 11, 12], _topk([8, 9, 10, 11], [[9, 1], [10, 1], [11, 1], [12, 1]]))
    # the matrix learned from the verify forward whichever branch drafted
    assert p.tr.matrix[8].tolist() == [9, 1]
    p.start("b", [40, 41, 8])                             # match of length 1 only
    d = p.propose("b", 8)
    assert p.match_len("b") < 3
    assert d.tokens[0] == 9                               # TR: row 8's best candidate
    s = p.debug_stats()
    assert s["sam_steps"] == 1 and s["sam_accepted"] == 3 and s["sam_tau"] == 4.0


def test_no_draft_when_neither_part_has_one():
    p = SamTokenRecyclingProposer(8, tr_prompt_bigrams=False)
    p.start("a", [1, 2, 3])
    assert len(p.propose("a", 8)) == 0
    p.observe("a", [4])
    assert p.debug_stats()["none_steps"] == 1
    p.finish("a")
    assert p.active_requests() == 0 and p.tr.active_requests() == 0


def test_config_keys_of_both_parts_and_auto_budget(tmp_path):
    _, plugin = translate({"method": "sam_tr", "sam_tr_threshold": 7,
                           "sam_continuation": "first", "tr_topk": 4})
    p = build_proposer(plugin)
    assert p.threshold == 7 and p.sam.continuation == "first" and p.tr.k == 4
    assert plugin["auto_budget"] and p.tr.auto_budget
    assert p.sam.num_speculative_tokens == 16
    with pytest.raises(SpecPlugConfigError, match="sam_tr_threshold"):
        translate({"method": "sam_tr", "sam_tr_threshold": 0})
    with pytest.raises(SpecPlugConfigError, match="tr_template"):
        translate({"method": "sam_tr", "tr_template": str(tmp_path / "none.json")})
