"""Debug proposers that exercise tree verification (not for speed).

* ``debug_oracle_tree``: knows the expected greedy output (``oracle_file``:
  JSON ``{"sequences": [[prompt + output token ids], ...]}``) and hides the
  true continuation at a random branch and depth among wrong siblings. With
  greedy verification each step must accept exactly the hidden depth; it
  counts steps where that did not happen (``debug_stats``).
* ``debug_random_tree``: random tokens (from ``random_tokens`` if given) in
  a random tree, a function of the context; output must still equal plain
  decoding's (greedy) or be distributed as plain sampling.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar, Sequence

import numpy as np

from ..options import Option
from ..tree import depths
from .base import Draft, Proposer, TargetTopK


class _ContextTracking(Proposer):
    """Keeps each request's full token list."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = int(num_speculative_tokens)
        self._ctx: dict[str, list[int]] = {}

    def start(self, req_id: str, token_ids: Sequence[int]) -> None:
        self._ctx[req_id] = list(token_ids)

    def observe(self, req_id: str, committed_ids: Sequence[int],
                target_topk: TargetTopK | None = None) -> None:
        self._ctx[req_id].extend(int(t) for t in committed_ids)

    def finish(self, req_id: str) -> None:
        self._ctx.pop(req_id, None)

    def active_requests(self) -> int:
        return len(self._ctx)


def _check_file(path: str) -> str | None:
    return None if Path(path).is_file() else f"file {path!r} does not exist"


class OracleTreeProposer(_ContextTracking):
    name: ClassVar[str] = "debug_oracle_tree"
    drafts_trees: ClassVar[bool] = True
    options: ClassVar[tuple[Option, ...]] = (
        Option("oracle_file", str, "", "JSON with the expected token sequences",
               check=_check_file),
        Option("oracle_width", int, 2, "wrong siblings per level", minimum=0, maximum=16),
        Option("oracle_seed", int, 0, "random seed", minimum=0),
    )

    def __init__(self, num_speculative_tokens: int, oracle_file: str = "",
                 oracle_width: int = 2, oracle_seed: int = 0) -> None:
        super().__init__(num_speculative_tokens)
        data = json.loads(Path(oracle_file).read_text())
        self.sequences = [list(map(int, s)) for s in data["sequences"]]
        self.width = oracle_width
        self.rng = np.random.default_rng(oracle_seed)
        self._pending: dict[str, int] = {}
        # req_id -> the true tokens hidden in the last tree (its depth's worth)
        self._truth_drafted: dict[str, list[int]] = {}
        self.stats = {"steps": 0, "hidden_depth_total": 0, "accepted_total": 0,
                      "mismatched_steps": 0}

    def _truth(self, ctx: list[int]) -> list[int]:
        n = len(ctx)
        for s in self.sequences:
            if len(s) > n and s[:n] == ctx:
                return s[n:]
        return []

    def propose(self, req_id: str, budget: int) -> Draft:
        budget = min(budget, self.num_speculative_tokens)
        truth = self._truth(self._ctx[req_id])
        levels = budget // (self.width + 1)
        if not truth or levels == 0:
            return Draft.empty()
        depth = int(self.rng.integers(0, min(levels, len(truth)) + 1))
        tokens: list[int] = []
        parents: list[int] = []
        true_node = -1  # the true path's node at the previous level (-1: root)
        prev_level: list[int] = [-1]
        for level in range(levels):
            nodes = []
            has_true = level < depth
            kinds = ["wrong"] * self.width + (["true"] if has_true else [])
            self.rng.shuffle(kinds)
            for kind in kinds:
                if kind == "true":
                    parent, tok = true_node, truth[level]
                else:
                    parent = int(self.rng.choice(prev_level))
                    tok = int(self.rng.integers(0, 49152))
                    if parent == true_node and level < len(truth) and tok == truth[level]:
                        tok = (tok + 1) % 49152
                tokens.append(tok)
                parents.append(parent)
                nodes.append(len(tokens) - 1)
                if kind == "true":
                    new_true = len(tokens) - 1
            if has_true:
                true_node = new_true
            prev_level = nodes
        self._pending[req_id] = depth
        self._truth_drafted[req_id] = truth[:depth]
        return Draft(np.array(tokens), np.array(parents))

    def draft_cut(self, req_id: str, kept: Draft) -> None:
        """The hidden depth becomes the longest prefix of the true path left
        in ``kept`` (no wrong sibling of a true node carries the true token)."""
        truth = self._truth_drafted.get(req_id)
        if truth is None or req_id not in self._pending:
            return
        parents, tokens = kept.parent_array(), kept.tokens.tolist()
        node, depth = -1, 0
        while depth < len(truth):
            nxt = [i for i in range(len(tokens))
                   if parents[i] == node and tokens[i] == truth[depth]]
            if not nxt:
                break
            node, depth = nxt[0], depth + 1
        self._pending[req_id] = depth

    def observe(self, req_id: str, committed_ids: Sequence[int],
                target_topk: TargetTopK | None = None) -> None:
        depth = self._pending.pop(req_id, None)
        if depth is not None:
            accepted = len(committed_ids) - 1
            self.stats["steps"] += 1
            self.stats["hidden_depth_total"] += depth
            self.stats["accepted_total"] += accepted
            self.stats["mismatched_steps"] += int(accepted != depth)
        super().observe(req_id, committed_ids)

    def finish(self, req_id: str) -> None:
        self._pending.pop(req_id, None)
        self._truth_drafted.pop(req_id, None)
        super().finish(req_id)

    def debug_stats(self) -> dict:
        return dict(self.stats)


class RandomTreeProposer(_ContextTracking):
    name: ClassVar[str] = "debug_random_tree"
    drafts_trees: ClassVar[bool] = True
    options: ClassVar[tuple[Option, ...]] = (
        Option("random_seed", int, 0, "random seed", minimum=0),
        Option("random_tokens", str, "",
               "comma-separated token ids to draw from (default: ids 0..49151); "
               "';'-separated lists draw the i-th token after the request's first "
               "drafting context from the i-th list (the last list beyond)",
               check=lambda v: None if all(t.strip().isdigit() for part in v.split(";")
                                           for t in part.split(",")) or not v
               else "expected comma-separated token ids, lists separated by ';'"),
        Option("random_shape", str, "tree", "a random tree, or a chain of random tokens",
               choices=("tree", "chain")),
        Option("random_sizes", str, "",
               "comma-separated node counts: the i-th request started drafts sizes[i % len] "
               "nodes, 0 none (for cost measurements; default: the budget)",
               check=lambda v: None if all(t.strip().isdigit() for t in v.split(",") if v)
               else "expected comma-separated integers >= 0"),
    )

    def __init__(self, num_speculative_tokens: int, random_seed: int = 0,
                 random_tokens: str = "", random_shape: str = "tree",
                 random_sizes: str = "") -> None:
        super().__init__(num_speculative_tokens)
        self.sizes = [int(t) for t in random_sizes.split(",")] if random_sizes else []
        self._size: dict[str, int] = {}
        self._started = 0
        self.chain = random_shape == "chain"
        self.seed = random_seed
        # One token list per generated position (a single list: all positions).
        self.vocab = ([np.array([int(t) for t in part.split(",")])
                       for part in random_tokens.split(";")] if random_tokens else None)
        self._prompt_len: dict[str, int] = {}

    def start(self, req_id: str, token_ids) -> None:
        super().start(req_id, token_ids)
        self._prompt_len.setdefault(req_id, len(token_ids))
        if self.sizes and req_id not in self._size:
            self._size[req_id] = self.sizes[self._started % len(self.sizes)]
            self._started += 1

    def finish(self, req_id: str) -> None:
        super().finish(req_id)
        self._size.pop(req_id, None)
        self._prompt_len.pop(req_id, None)

    def propose(self, req_id: str, budget: int) -> Draft:
        n = min(budget, self.num_speculative_tokens, self._size.get(req_id, budget))
        if n <= 0:
            return Draft.empty()
        # Deterministic in the context, so a seeded request is reproducible.
        ctx = self._ctx[req_id]
        rng = np.random.default_rng([self.seed, len(ctx), ctx[-1] if ctx else 0])
        parents = [i - 1 if self.chain else int(rng.integers(-1, i)) for i in range(n)]
        if self.vocab is None:
            tokens = rng.integers(0, 49152, size=n)
        else:
            generated = len(ctx) - self._prompt_len.get(req_id, len(ctx))
            lists = self.vocab
            # depths() counts the root's children as 1; list i is for offset i
            tokens = np.array([rng.choice(lists[min(generated + int(d) - 1, len(lists) - 1)])
                               for d in depths(np.array(parents, dtype=np.int32))],
                              dtype=np.int64)
        return Draft(tokens, np.array(parents, dtype=np.int32))
