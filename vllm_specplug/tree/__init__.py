"""Draft-tree machinery shared by tree proposers, scorers and the adapter."""
from .structure import (ancestor_mask, children_lists, compaction_moves, depths, node_positions,
                        path_to, validate_parents)

__all__ = ["ancestor_mask", "children_lists", "compaction_moves", "depths", "node_positions",
           "path_to", "validate_parents"]
