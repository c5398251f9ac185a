"""An upper bound for drafting by copying: the best of several sources, cut at
exactly the accepted length, every step (issue 20's targets, checked for
feasibility).

    python scripts/oracle_bound.py [--workloads spec_bench,pipeline,agentic] [--half odd]
    python scripts/oracle_bound.py --engine-outputs RUN/raw/plain.json --out FILE

``--engine-outputs``: instead of the Hugging Face records, plain decoding's
outputs of a ``specplug bench`` run on Spec-Bench (its ``raw/plain.json``:
token ids per prompt id), with the prompts rebuilt from the vendored
Spec-Bench file and the model's chat template; ``--per-category`` and
``--half`` must be the run's.

Issue 20 asks ``sam`` to pick, each step, between its sources (the request's
own automaton, the global store, the static corpus) by expected acceptance
and to size the draft from the same estimates. No such choice can do better
than an oracle that knows the true continuation: it looks at every
candidate draft of the step (``sam`` with its global store, drafting as long
as it can with no cost cut; vLLM's ``suffix`` at its default; vLLM's
``ngram``), keeps the one accepted deepest and verifies exactly its accepted
tokens (no rejected token is ever verified). Its expected speedup on a cost
line (``a + b * tokens`` a step) bounds what source selection plus draft
sizing can reach with these sources. Compared with the replayed ``suffix``
(vLLM's default, 24 tokens) on the same line, it says whether a target of
"``sam`` >= X times ``suffix``" is reachable at all by that design.

Replay as ``bench/simulate.py`` (greedy, batch size 1, the records of
``scripts/acceptance_curves.py``, one proposer per source for the whole half
in file order); every source observes every committed token, whichever
source's draft was kept. Writes ``results/curves/oracle_bound.json`` and
prints a table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from acceptance_curves import RECORDS  # noqa: E402
from vllm_specplug.bench import curves as C  # noqa: E402

#: this machine kind's measured b / a (2026-12-02 and 2026-12-03, docs/architecture.md:
#: 0.054-0.057 from 40 to 1,500 tokens of context)
CPU_NOW_B_OVER_A = 0.055


#: the oracle's budget: sam drafts up to this many tokens
ORACLE_BUDGET = 64


def oracle(rows) -> dict:
    sam = C._sam(ORACLE_BUDGET, sam_spec_factor=1e9)
    sam.relative_token_cost = 0.0      # no cost cut: as long as it can
    sources = {"sam_global": sam, "suffix": C.SuffixBaseline(24), "ngram": C.NgramBaseline(8)}
    return C.oracle_replay(sources, C.requests_of(rows), ORACLE_BUDGET)


def method(rows, name: str, n: int, rel_cost: float | None) -> dict:
    """``bench.curves.curve`` of one method at budget n."""
    return C.curve(name, rows, (n,), relative_token_cost=rel_cost)[0]


def engine_rows(path: str, per_category: int, half: str) -> list[dict]:
    """Records of a bench run's plain outputs (see the module doc)."""
    from record_greedy_hf import prompt_ids
    from transformers import AutoTokenizer

    from vllm_specplug.bench.prompts import load_prompts
    from vllm_specplug.bench.workloads import build_messages
    from vllm_specplug.models import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    prompts = {str(p["id"]): p for p in load_prompts(per_category=per_category, half=half)}
    rows = []
    for r in json.loads(Path(path).read_text())["results"]:
        p = prompts.get(str(r["id"]))
        if p is None:
            raise SystemExit(f"{path}: prompt id {r['id']} is not in Spec-Bench's {half} half "
                             f"at {per_category} a category; pass the run's --per-category")
        # the messages the bench sent (``llm.chat``), tokenized as the recorder does
        rows.append({"prompt_ids": prompt_ids(tok, build_messages(p, [])),
                     "output_ids": list(r["token_ids"]),
                     "category": p["category"], "pos": 1})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="spec_bench,pipeline,agentic")
    ap.add_argument("--half", default="odd", choices=("odd", "even"))
    ap.add_argument("--engine-outputs", default="", help="a bench run's raw/plain.json")
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "results" / "curves" / "oracle_bound.json"))
    args = ap.parse_args(argv)
    lines = [C.cpu_cost_line(), C.CostLine(1.0, CPU_NOW_B_OVER_A, "cpu_now",
                                           "2026-12-02/03 machine, b/a measured"),
             C.gpu_like_cost_line()]
    report = {"half": args.half, "lines": {ln.name: ln.as_dict() for ln in lines},
              "workloads": {}}
    workloads = ["engine_outputs"] if args.engine_outputs else args.workloads.split(",")
    for w in workloads:
        if args.engine_outputs:
            rows = engine_rows(args.engine_outputs, args.per_category, args.half)
            report["source"] = args.engine_outputs
        else:
            rows = C.load_records(RECORDS[w][0], None, half=args.half)
        res = {"requests": len(rows), "oracle": oracle(rows),
               "suffix": method(rows, "suffix", 24, None)}
        for ln in lines:
            res[f"sam_global@{ln.name}"] = method(rows, "sam_global", 32,
                                                  ln.relative_token_cost)
        for ln in lines:
            o = res["oracle"]
            s = res["suffix"]
            g = res[f"sam_global@{ln.name}"]
            so = ln.speedup(o["tau"], o["nodes_per_step"])
            ss = ln.speedup(s["tau"], s["nodes_per_step"])
            sg = ln.speedup(g["tau"], g["nodes_per_step"])
            res[f"speedup@{ln.name}"] = {"oracle": so, "suffix": ss, "sam_global": sg,
                                         "oracle_over_suffix": so / ss,
                                         "sam_over_suffix": sg / ss}
        report["workloads"][w] = res
        print(f"\n{w}: {len(rows)} requests; oracle tau {res['oracle']['tau']:.3f} "
              f"({res['oracle']['nodes_per_step']:.2f} nodes a step), wins "
              f"{res['oracle']['wins']}")
        for ln in lines:
            s = res[f"speedup@{ln.name}"]
            print(f"  {ln.name:9s} (b/a {ln.b / ln.a:.4f}): oracle {s['oracle']:.3f}x, "
                  f"suffix {s['suffix']:.3f}x, sam {s['sam_global']:.3f}x; "
                  f"oracle / suffix {s['oracle_over_suffix']:.3f}, "
                  f"sam / suffix {s['sam_over_suffix']:.3f}")
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
