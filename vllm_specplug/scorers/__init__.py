"""Acceptance rules: which drafted nodes the target accepts, and the bonus token."""
from .base import Acceptance, Scorer
from .greedy import GreedyScorer
from .rejection import RejectionScorer

__all__ = ["Acceptance", "GreedyScorer", "RejectionScorer", "Scorer"]
