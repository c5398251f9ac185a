"""SAM[TR]: SAM-Decoding's hybrid drafter with Token Recycling as the fallback.

Each step, SAM gives the length of the longest earlier match of the
context's suffix (in the request's own text, or in a static corpus automaton
less ``sam_corpus_bias``: ``SamProposer.match_len``). If it reaches
``sam_tr_threshold``, the step drafts SAM's continuation as a chain (long
matches are usually copied text); otherwise Token Recycling's tree. Both
proposers see every committed token and Token Recycling's matrix learns from
every verify forward, whichever branch drafted.

Per-branch counts and accepted tokens are kept (``debug_stats``), so the
benchmark can report how often each branch was taken and its tau.
"""
from __future__ import annotations

from typing import ClassVar, Sequence

from ..options import Option
from .base import Draft, Proposer, TargetTopK
from .sam import SamProposer
from .token_recycling import TokenRecyclingProposer

# Chain budget of the SAM branch when the node budget is "auto".
SAM_CHAIN_BUDGET = 16


class SamTokenRecyclingProposer(Proposer):
    name: ClassVar[str] = "sam_tr"
    drafts_trees: ClassVar[bool] = True
    wants_target_topk: ClassVar[bool] = True
    auto_budget_max: ClassVar[int] = TokenRecyclingProposer.auto_budget_max
    default_num_speculative_tokens: ClassVar[int | str] = "auto"
    options: ClassVar[tuple[Option, ...]] = (
        Option("sam_tr_threshold", int, 5,
               "draft SAM's chain when the match is at least this long, else Token "
               "Recycling's tree", minimum=1, maximum=1024),
        *SamProposer.options,
        *TokenRecyclingProposer.options,
    )

    @classmethod
    def check_options(cls, num_speculative_tokens: int, options: dict) -> None:
        for part in (SamProposer, TokenRecyclingProposer):
            part.check_options(num_speculative_tokens, _pick(options, part))

    @classmethod
    def check_model(cls, options: dict, tokenizer: str) -> None:
        for part in (SamProposer, TokenRecyclingProposer):
            part.check_model(_pick(options, part), tokenizer)

    def __init__(self, num_speculative_tokens: int, sam_tr_threshold: int = 5,
                 auto_budget: bool = False, **options) -> None:
        self.threshold = int(sam_tr_threshold)
        k = int(num_speculative_tokens)
        self.sam = SamProposer(min(k, SAM_CHAIN_BUDGET) if auto_budget else k,
                               **_pick(options, SamProposer))
        self.tr = TokenRecyclingProposer(k, auto_budget=auto_budget,
                                         **_pick(options, TokenRecyclingProposer))
        self.target_topk_k = self.tr.target_topk_k
        self._branch: dict[str, str] = {}
        self.stats = {"sam_steps": 0, "sam_accepted": 0, "tr_steps": 0, "tr_accepted": 0,
                      "none_steps": 0, "none_accepted": 0}

    def start(self, req_id: str, token_ids: Sequence[int]) -> None:
        self._branch.pop(req_id, None)
        self.sam.start(req_id, token_ids)
        self.tr.start(req_id, token_ids)

    def observe(self, req_id: str, committed_ids: Sequence[int],
                target_topk: TargetTopK | None = None) -> None:
        branch = self._branch.pop(req_id, None)
        if branch is not None and committed_ids:
            self.stats[f"{branch}_steps"] += 1
            self.stats[f"{branch}_accepted"] += len(committed_ids) - 1
        self.sam.observe(req_id, committed_ids)
        self.tr.observe(req_id, committed_ids, target_topk)

    def match_len(self, req_id: str) -> int:
        return self.sam.match_len(req_id)

    def propose(self, req_id: str, budget: int) -> Draft:
        self.tr.relative_token_cost = self.relative_token_cost
        if self.match_len(req_id) >= self.threshold:
            draft = self.sam.propose(req_id, budget)
            if len(draft):
                self._branch[req_id] = "sam"
                return draft
        draft = self.tr.propose(req_id, budget)
        self._branch[req_id] = "tr" if len(draft) else "none"
        return draft

    def draft_cut(self, req_id: str, kept: Draft) -> None:
        if self._branch.get(req_id) == "sam":
            self.sam.draft_cut(req_id, kept)
        if len(kept) == 0 and req_id in self._branch:
            self._branch[req_id] = "none"

    def finish(self, req_id: str) -> None:
        self._branch.pop(req_id, None)
        self.sam.finish(req_id)
        self.tr.finish(req_id)

    def active_requests(self) -> int:
        return self.sam.active_requests()

    def state_nbytes(self) -> int:
        return self.sam.state_nbytes() + self.tr.state_nbytes()

    def debug_stats(self) -> dict:
        s = dict(self.stats)
        for b in ("sam", "tr"):
            steps = s[f"{b}_steps"]
            s[f"{b}_tau"] = round(1 + s[f"{b}_accepted"] / steps, 4) if steps else None
        s["sam"] = self.sam.debug_stats()
        s["token_recycling"] = self.tr.debug_stats()
        return s


def _pick(options: dict, cls: type[Proposer]) -> dict:
    names = {o.name for o in cls.options}
    return {k: v for k, v in options.items() if k in names}
