"""How much could a draft *tree* add to sam's chain? A replay bound.

    python scripts/sam_branch_bound.py > branch_odd.txt   # ~5 min, one core

Greedy replay of ``sam`` (learned rule, budget 32, the global store on, this
CPU's cost line) over the odd halves of the recorded workloads. At every
step whose draft is rejected at position a, the best single alternative a
tree could have put beside the draft's token a is taken as the most
frequent other token that follows the longest suffix of the accepted text
(up to 12 tokens) that has earlier occurrences, in the request's own text
or in the earlier records' outputs (what the global store holds). Printed
per workload: steps, rejected steps, how often that alternative is the
true token ("hit") and how often there is none. The alternative is placed
where the rejection happens, which a drafter does not know in advance, so
the hit rate bounds what one branch per step could recover.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vllm_specplug.bench import curves as C  # noqa: E402
from vllm_specplug.bench import stop_fit as F  # noqa: E402
from vllm_specplug.bench.simulate import accepted_length  # noqa: E402
from vllm_specplug.proposers.sam import SamProposer  # noqa: E402

R = REPO / "results"
WORKLOADS = {"pipeline": (R / "curves/pipeline_greedy_hf.jsonl", "odd"),
             "agentic": (R / "curves/agentic_greedy_hf.jsonl", "odd"),
             "spec_bench": (R / "runs/global_store/specbench_greedy_hf.jsonl", "odd")}
MAX_SUFFIX = 12


def next_tokens(arr: np.ndarray, suffix: np.ndarray) -> np.ndarray:
    """Tokens that follow each occurrence of ``suffix`` in ``arr``."""
    L = suffix.size
    if arr.size <= L:
        return arr[:0]
    win = np.lib.stride_tricks.sliding_window_view(arr[:-1], L)
    return arr[np.nonzero(np.all(win == suffix, axis=1))[0] + L]


def alternative(text: np.ndarray, docs: list[np.ndarray], drafted: int) -> int | None:
    """The most frequent token other than ``drafted`` after the longest
    suffix of ``text`` that occurs earlier (in ``text`` or ``docs``)."""
    for L in range(min(MAX_SUFFIX, text.size - 1), 0, -1):
        suffix = text[-L:]
        nxt = np.concatenate([next_tokens(text[:-1], suffix)]
                             + [next_tokens(d, suffix) for d in docs])
        if nxt.size:
            tokens, counts = np.unique(nxt[nxt != drafted], return_counts=True)
            return int(tokens[np.argmax(counts)]) if tokens.size else None
    return None


def main() -> None:
    line = C.cpu_cost_line()
    print(f"replay: sam, learned rule, budget 32, CPU line relative cost "
          f"{line.relative_token_cost:.4f}; odd halves")
    for name, (path, half) in WORKLOADS.items():
        rows = C.load_records(path, None, half=half)
        sam = SamProposer(32, sam_stop="learned")
        sam.relative_token_cost = line.relative_token_cost
        docs: list[np.ndarray] = []
        n = {"steps": 0, "rejected": 0, "hit": 0, "none": 0}
        prompt: list[int] = []

        def step_of(rid, out, pos):
            draft = sam.propose(rid, 32)
            a = accepted_length(draft, out, pos)
            n["steps"] += 1
            if a < len(draft) and pos + a < len(out):
                n["rejected"] += 1
                alt = alternative(np.asarray(prompt + out[:pos + a]), docs,
                                  int(draft.tokens[a]))
                n["hit" if alt == out[pos + a] else "none" if alt is None else "miss"] = (
                    n.get("hit" if alt == out[pos + a] else
                          "none" if alt is None else "miss", 0) + 1)
            return draft

        for r in rows:
            prompt[:] = list(r["prompt_ids"])
            F.drive(sam, [r], step_of)
            docs.append(np.asarray(r["output_ids"]))
        print(f"{name}: {n['steps']} steps, {n['rejected']} rejected, alternative is the "
              f"true token {n['hit']} ({n['hit'] / max(n['rejected'], 1):.3f}), "
              f"no alternative {n['none']} ({n['none'] / max(n['rejected'], 1):.3f})",
              flush=True)


if __name__ == "__main__":
    main()
