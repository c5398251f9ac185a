"""SAM[TR]: SAM-Decoding's hybrid drafter with Token Recycling as the fallback.

Each step, SAM gives the length of the longest earlier match of the
context's suffix (in the request's own text, or in a static corpus automaton
less ``sam_corpus_bias``: ``SamProposer.match_len``). If it reaches
``sam_tr_threshold``, the step drafts SAM's continuation as a chain (long
matches are usually copied text); otherwise Token Recycling's tree. Both
proposers see every committed token and Token Recycling's matrix learns from
every verify forward, whichever branch drafted.

``sam_eagle2`` is the same hybrid with EAGLE-2's dynamic tree
(``proposers/eagle2.py``) as the fallback: SAM's chain on long matches (at
least ``sam_eagle2_threshold``), else EAGLE-2's tree, merged with SAM's
short-match chain unless ``sam_eagle2_merge`` is false. It binds the EAGLE
head like ``eagle2`` (``target_hook``, ``bind_target``) and takes its keys
(``model``: the head folder, ``depth``, ``topk``).

Per-branch counts and accepted tokens are kept (``debug_stats``), so the
benchmark can report how often each branch was taken and its tau. ``start``'s
``RequestInfo`` (the request's tenant) goes to both parts.
"""
from __future__ import annotations

from typing import ClassVar, Sequence

import numpy as np

from ..budget import best_node_count, monotone_values, subset
from ..options import Option
from ..tree.structure import merge_drafts
from .base import SHARED, Draft, Proposer, RequestInfo, TargetTopK, start_request
from ..folders import check_draft_vocab, check_head_against_model, check_head_path
from .eagle2 import Eagle2Proposer, EagleDraftHook, path_length
from .sam import SamProposer
from .token_recycling import TokenRecyclingProposer

__all__ = ["SamEagle2Proposer", "SamHybridProposer", "SamTokenRecyclingProposer",
           "path_length"]

# Chain budget of the SAM branch when the node budget is "auto".
SAM_CHAIN_BUDGET = 16


def switch_options(prefix: str, tree: str) -> tuple[Option, Option]:
    """A hybrid's ``{prefix}_threshold`` and ``{prefix}_merge`` keys."""
    return (
        Option(f"{prefix}_threshold", int, 5,
               f"draft SAM's chain when the match is at least this long, else {tree}",
               minimum=1, maximum=1024),
        Option(f"{prefix}_merge", bool, True,
               f"below the threshold, draft the union of {tree} and SAM's chain from its "
               f"shorter match (the nodes worth verifying); false: the tree alone, as in "
               f"SAM-Decoding"),
    )


class SamHybridProposer(Proposer):
    """SAM's chain on long matches, else the tree of ``fallback_cls``
    (SAM-Decoding's hybrid); subclasses name the fallback and the keys."""

    drafts_trees: ClassVar[bool] = True
    default_num_speculative_tokens: ClassVar[int | str] = "auto"
    #: The tree proposer drafting below the threshold.
    fallback_cls: ClassVar[type[Proposer]]
    #: Its name in the branch counters (``{branch}_steps``, ``{branch}_tau``)
    #: and its key in ``debug_stats()``.
    branch: ClassVar[str]
    stats_key: ClassVar[str]

    @classmethod
    def check_options(cls, num_speculative_tokens: int, options: dict) -> None:
        for part in (SamProposer, cls.fallback_cls):
            part.check_options(num_speculative_tokens, _pick(options, part))

    @classmethod
    def check_model(cls, options: dict, tokenizer: str) -> None:
        for part in (SamProposer, cls.fallback_cls):
            part.check_model(_pick(options, part), tokenizer)

    def __init__(self, num_speculative_tokens: int, threshold: int, merge: bool,
                 auto_budget: bool, options: dict) -> None:
        self.threshold = int(threshold)
        self.merge = bool(merge)
        # req_id -> SAM's chain tokens inside the last tree draft
        self._sam_chain: dict[str, np.ndarray] = {}
        k = int(num_speculative_tokens)
        self.sam = SamProposer(min(k, SAM_CHAIN_BUDGET) if auto_budget else k,
                               **_pick(options, SamProposer))
        self.fallback = self.fallback_cls(k, auto_budget=auto_budget,
                                          **_pick(options, self.fallback_cls))
        self._branch: dict[str, str] = {}
        b = self.branch
        self.stats = {"sam_steps": 0, "sam_accepted": 0, f"{b}_steps": 0, f"{b}_accepted": 0,
                      "none_steps": 0, "none_accepted": 0, "merged_sam_nodes": 0}

    def start(self, req_id: str, token_ids: Sequence[int],
              info: RequestInfo = SHARED) -> None:
        self._branch.pop(req_id, None)
        self.sam.start(req_id, token_ids, info)
        start_request(self.fallback, req_id, token_ids, info)

    def observe(self, req_id: str, committed_ids: Sequence[int],
                target_topk: TargetTopK | None = None) -> None:
        branch = self._branch.pop(req_id, None)
        if branch is not None and committed_ids:
            self.stats[f"{branch}_steps"] += 1
            self.stats[f"{branch}_accepted"] += len(committed_ids) - 1
        self.sam.observe(req_id, committed_ids)
        self.fallback.observe(req_id, committed_ids, target_topk)

    def complete(self, req_id: str) -> None:
        self.sam.complete(req_id)

    def match_len(self, req_id: str) -> int:
        return self.sam.match_len(req_id)

    def propose(self, req_id: str, budget: int) -> Draft:
        self.fallback.relative_token_cost = self.relative_token_cost
        self.sam.relative_token_cost = self.relative_token_cost
        self._sam_chain.pop(req_id, None)
        long_match = self.match_len(req_id) >= self.threshold
        if long_match:
            draft = self.sam.propose(req_id, budget)
            if len(draft):
                self._branch[req_id] = "sam"
                return draft
        draft = self.fallback.propose(req_id, budget)
        if self.merge and not long_match:
            tree = draft
            draft = self._with_sam_chain(req_id, tree, budget)
            if draft is not tree:
                # the fallback hears what of the step's tree is verified
                self.fallback.draft_cut(req_id, draft)
        self._branch[req_id] = self.branch if len(draft) else "none"
        return draft

    def _with_sam_chain(self, req_id: str, tree: Draft, budget: int) -> Draft:
        """The tree branch also holds SAM's chain from its (short) match:
        the union of both, cut to the nodes worth verifying (by their
        acceptance estimates against the step's verify cost, as "auto"
        budgets do; a fixed budget keeps the best ``budget`` nodes)."""
        chain = self.sam.propose(req_id, budget)
        if not len(chain):
            return tree
        if not len(tree):
            self._sam_chain[req_id] = chain.tokens
            self.stats["merged_sam_nodes"] += len(chain)
            return chain
        if tree.scores is None or chain.scores is None:
            self.sam.draft_cut(req_id, Draft.empty())
            return tree
        merged, sam_index = merge_drafts(tree, chain)
        values = monotone_values(merged.scores, merged.parents)
        order = np.argsort(-values, kind="stable")
        n = (best_node_count(values[order], self.relative_token_cost, budget)
             if self.fallback.auto_budget else min(budget, len(merged)))
        keep = np.zeros(len(merged), dtype=bool)
        keep[order[:n]] = True
        sam_kept = 0
        while sam_kept < len(sam_index) and keep[sam_index[sam_kept]]:
            sam_kept += 1
        if sam_kept < len(chain):
            self.sam.draft_cut(req_id, Draft.chain(chain.tokens[:sam_kept]))
        if not keep.any():
            return Draft.empty()
        if sam_kept:
            self._sam_chain[req_id] = chain.tokens[:sam_kept]
        self.stats["merged_sam_nodes"] += sam_kept
        return subset(merged, keep)

    def draft_cut(self, req_id: str, kept: Draft) -> None:
        if self._branch.get(req_id) == "sam":
            self.sam.draft_cut(req_id, kept)
        else:
            self.fallback.draft_cut(req_id, kept)
            if req_id in self._sam_chain:
                # SAM's chain inside the tree: as far as its path is still there
                chain = self._sam_chain[req_id]
                n = path_length(kept, chain)
                if n < len(chain):
                    self._sam_chain[req_id] = chain[:n]
                    self.sam.draft_cut(req_id, Draft.chain(chain[:n]))
        if len(kept) == 0 and req_id in self._branch:
            self._branch[req_id] = "none"

    def finish(self, req_id: str) -> None:
        self._branch.pop(req_id, None)
        self._sam_chain.pop(req_id, None)
        self.sam.finish(req_id)
        self.fallback.finish(req_id)

    def active_requests(self) -> int:
        return self.sam.active_requests()

    def state_nbytes(self) -> int:
        return self.sam.state_nbytes() + self.fallback.state_nbytes()

    def structure_sizes(self) -> dict[str, int]:
        return {**self.sam.structure_sizes(), **self.fallback.structure_sizes(),
                "hybrid_branches": len(self._branch), "hybrid_chains": len(self._sam_chain)}

    def debug_stats(self) -> dict:
        s = dict(self.stats)
        for b in ("sam", self.branch):
            steps = s[f"{b}_steps"]
            s[f"{b}_tau"] = round(1 + s[f"{b}_accepted"] / steps, 4) if steps else None
        s["sam"] = self.sam.debug_stats()
        s[self.stats_key] = self.fallback.debug_stats()
        return s


class SamTokenRecyclingProposer(SamHybridProposer):
    name: ClassVar[str] = "sam_tr"
    wants_target_topk: ClassVar[bool] = True
    auto_budget_max: ClassVar[int] = TokenRecyclingProposer.auto_budget_max
    fallback_cls: ClassVar[type[Proposer]] = TokenRecyclingProposer
    branch: ClassVar[str] = "tr"
    stats_key: ClassVar[str] = "token_recycling"
    options: ClassVar[tuple[Option, ...]] = (
        *switch_options("sam_tr", "Token Recycling's tree"),
        *SamProposer.options,
        *TokenRecyclingProposer.options,
    )

    def __init__(self, num_speculative_tokens: int, sam_tr_threshold: int = 5,
                 sam_tr_merge: bool = True, auto_budget: bool = False, **options) -> None:
        super().__init__(num_speculative_tokens, sam_tr_threshold, sam_tr_merge,
                         auto_budget, options)
        self.tr = self.fallback
        self.target_topk_k = self.tr.target_topk_k


class SamEagle2Proposer(SamHybridProposer):
    name: ClassVar[str] = "sam_eagle2"
    auto_budget_max: ClassVar[int] = Eagle2Proposer.auto_budget_max
    takes_model_path: ClassVar[bool] = True
    target_hook: ClassVar[str] = Eagle2Proposer.target_hook
    fallback_cls: ClassVar[type[Proposer]] = Eagle2Proposer
    branch: ClassVar[str] = "eagle2"
    stats_key: ClassVar[str] = "eagle2"
    options: ClassVar[tuple[Option, ...]] = (
        *switch_options("sam_eagle2", "EAGLE-2's tree"),
        *SamProposer.options,
        *Eagle2Proposer.options,
    )

    @classmethod
    def check_options(cls, num_speculative_tokens: int, options: dict) -> None:
        SamProposer.check_options(num_speculative_tokens, _pick(options, SamProposer))
        options["model"] = check_head_path(options.get("model", ""), cls.name)
        check_draft_vocab(options, cls.name)

    @classmethod
    def check_model(cls, options: dict, tokenizer: str) -> None:
        SamProposer.check_model(_pick(options, SamProposer), tokenizer)
        check_head_against_model(options["model"], tokenizer, cls.name)

    def __init__(self, num_speculative_tokens: int, sam_eagle2_threshold: int = 5,
                 sam_eagle2_merge: bool = True, auto_budget: bool = False,
                 **options) -> None:
        super().__init__(num_speculative_tokens, sam_eagle2_threshold, sam_eagle2_merge,
                         auto_budget, options)
        self.eagle = self.fallback

    def bind_target(self, hook: EagleDraftHook) -> None:
        """Attach the EAGLE head (the adapter calls this at engine start)."""
        self.eagle.bind_target(hook)


def _pick(options: dict, cls: type[Proposer]) -> dict:
    names = {o.name for o in cls.options}
    return {k: v for k, v in options.items() if k in names}
