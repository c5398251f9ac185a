"""Edge cases of vllm_specplug/tree/structure.py that mutation testing found
unchecked (docs/testing.md): dtypes callers rely on, the error message, list
sizes, and merging drafts with and without scores."""
from __future__ import annotations

import numpy as np
import pytest

from vllm_specplug.proposers.base import Draft
from vllm_specplug.tree.structure import (ancestor_mask, children_lists, depths, merge_drafts,
                                          validate_parents)


def test_parents_are_flattened_int32_and_checked():
    p = validate_parents(np.array([[-1, 0], [1, -1]], dtype=np.int64))
    assert p.dtype == np.int32 and p.tolist() == [-1, 0, 1, -1]
    for bad in ([0], [-1, 1], [-2]):
        with pytest.raises(ValueError,
                           match="^tree parents must be -1 or point to an earlier node$"):
            validate_parents(np.array(bad))


def test_depths_and_masks_have_the_dtypes_callers_index_with():
    parents = np.array([-1, 0, -1, 2, 3])
    d = depths(parents)
    assert d.dtype == np.int32 and d.tolist() == [1, 2, 1, 2, 3]
    m = ancestor_mask(parents)
    assert m.dtype == bool and m[4].tolist() == [False, False, True, True, True]


def test_children_lists_has_one_list_per_node_and_the_root():
    assert children_lists(np.array([-1, 0, -1])) == [[0, 2], [1], [], []]


def test_merging_drafts_without_scores_or_with_one_scored():
    a = Draft(np.array([1, 2]), np.array([-1, 0]))
    b = Draft(np.array([1, 3]), np.array([-1, 0]), np.array([0.9, 0.4]))
    merged, idx = merge_drafts(a, Draft(np.array([1, 3]), np.array([-1, 0])))
    assert merged.scores is None and merged.tokens.tolist() == [1, 2, 3] and idx == [0, 2]
    merged, _ = merge_drafts(a, b)     # only one scored: no scores
    assert merged.scores is None and merged.parents.tolist() == [-1, 0, 0]
