"""Acceptance rules: which drafted nodes the target accepts, and the bonus token.

By name (built-ins and third-party entry points): ``scorers.registry``.
"""
from .base import Acceptance, Scorer
from .block import BlockScorer
from .greedy import GreedyScorer
from .rejection import RejectionScorer
from .typical import TypicalScorer

__all__ = ["Acceptance", "BlockScorer", "GreedyScorer", "RejectionScorer", "Scorer",
           "TypicalScorer"]
