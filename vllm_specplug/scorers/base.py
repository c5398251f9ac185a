"""The scorer interface.

``target_probs`` has one row per tree position: row 0 is the target's
next-token distribution after the last committed token (the root), row i+1
the distribution after node i (temperature, top-k/top-p and penalties
already applied, as plain sampling would). ``draft_probs`` (optional) row i
is the distribution node i's token was drawn from; without it drafts count
as deterministic (one-hot).

Scorers are registered by name (``vllm_specplug.scorers.registry``); their
parameters are ``options``, passed to ``__init__`` as keywords.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..options import Option
from ..proposers.base import Draft


@dataclass(frozen=True)
class Acceptance:
    path: list[int]   # accepted node indices, root's child first
    bonus: int        # the token emitted after the last accepted node

    def tokens(self, draft: Draft) -> list[int]:
        return [int(draft.tokens[i]) for i in self.path] + [self.bonus]


class Scorer(ABC):
    name: str
    #: Whether emitted tokens are distributed exactly as plain sampling from
    #: ``target_probs`` would give them.
    lossless: bool = True
    #: Keys this scorer accepts (passed to ``__init__`` as keywords).
    options: ClassVar[tuple[Option, ...]] = ()

    @abstractmethod
    def accept(self, draft: Draft, target_probs: np.ndarray,
               draft_probs: np.ndarray | None, rng: np.random.Generator) -> Acceptance:
        ...
