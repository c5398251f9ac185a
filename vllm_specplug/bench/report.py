"""Markdown tables, the JSON file and PNG plots of a benchmark result."""
from __future__ import annotations

import json
import math
from pathlib import Path

from .plausibility import OVERALL_TOLERANCE, check, speedup_above_tau


def _f(x: float, nd: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _speedup(summary: dict) -> str:
    """A speedup cell, marked ``!`` when it is above tau (implausible)."""
    sp = summary.get("speedup")
    mark = " !" if sp is not None and speedup_above_tau(summary["tau"], sp,
                                                        OVERALL_TOLERANCE) else ""
    return f"{_f(sp)}x{mark}"


def _ttft(t: dict | None) -> str:
    """A TTFT cell: median (first) in seconds."""
    if not t:
        return "n/a"
    return f"{t['median']:.2f} s ({t['first']:.2f} s)"


def markdown(res: dict) -> str:
    s = res["settings"]
    methods = list(res["methods"])
    workload = s.get("workload", "spec_bench")
    lines = [(f"Workload: `{workload}`. " if workload != "spec_bench" else "")
             + f"Model: `{res['model']}`; max_tokens {s['max_tokens']}, temperature "
             f"{s['temperature']}, batch size 1, repeat {s['repeat']}"
             f"{' (each repeat in a fresh engine)' if s.get('repeat_in_fresh_engines') else ''}; "
             f"CPU: {res['environment']['cpu']} ({res['environment']['cores']} cores); "
             f"vLLM {res['environment']['vllm']}, torch {res['environment']['torch']}.", ""]
    for n in res.get("notes", []):
        lines += [f"Note: {n}", ""]
    flags = check(res)
    if flags:
        lines += ["**Implausible measurements** (speedups marked `!` are above tau, which "
                  "speculation cannot reach; do not quote them, rerun on a quiet machine):", ""]
        lines += [f"* {f.message}" for f in flags] + [""]
    lines += ["| method | tau | tokens/s | speedup | decode tokens/s | decode speedup | "
              "TTFT median (first) | draft tok/step | accept rate | outputs differing from plain |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for m in methods:
        o = res["methods"][m]["overall"]
        lines.append(f"| {m} | {_f(o['tau'])} | {_f(o['tokens_per_second'], 1)} | "
                     f"{_speedup(o)} | {_f(o.get('decode_tokens_per_second'), 1)} | "
                     f"{_f(o.get('decode_speedup'))}x | {_ttft(res['methods'][m].get('ttft'))} | "
                     f"{_f(o['draft_tokens_per_step'])} | {_f(o['acceptance_rate'])} | "
                     f"{res['methods'][m]['outputs_differing_from_plain']} |")
    lines += ["", "Decode tokens/s: each request's tokens after its first over the engine's "
              "time from its first to its last token (prefill and queueing left out: "
              "the part of the latency speculation can shorten). TTFT: time to first token, "
              "the median over the measured requests and, in brackets, the first measured "
              "request's (after one unmeasured warm-up request per engine)."]
    cats = list(next(iter(res["methods"].values()))["categories"])
    lines += ["", "Per category: tau / speedup against plain decoding", "",
              "| category | " + " | ".join(methods) + " |",
              "|---|" + "---|" * len(methods)]
    for c in cats:
        cells = []
        for m in methods:
            e = res["methods"][m]["categories"][c]
            cells.append(f"{_f(e['tau'])} / {_speedup(e)}")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines += ["", "Acceptance rate per draft position (accepted at position i / drafted steps)",
              "", "| method | per position |", "|---|---|"]
    for m in methods:
        pp = list(res["methods"][m]["overall"]["acceptance_per_position"] or [])
        while pp and not pp[-1]:  # tree budgets leave long tails of unused positions
            pp.pop()
        if pp:
            lines.append(f"| {m} | " + ", ".join(_f(x) for x in pp) + " |")
    if any("quality" in e for e in res["methods"].values()):
        lines += ["", "Quality: the target's mean log-likelihood per generated token of each "
                  "method's outputs (a lossless method matches plain sampling up to noise)", "",
                  "| method | mean log-likelihood / token | tokens |", "|---|---|---|"]
        for m, e in res["methods"].items():
            q = e.get("quality")
            if q:
                lines.append(f"| {m} | {_f(q['mean_logprob_per_token'], 3)} | {q['tokens']} |")
    hybrid = {m: e["drafter_stats"]["proposer"] for m, e in res["methods"].items()
              if "sam_steps" in ((e.get("drafter_stats") or {}).get("proposer") or {})}
    if hybrid:
        lines += ["", "Hybrid drafter branches (steps drafted by each branch and its tau "
                  "over those steps)", "",
                  "| method | SAM chain steps | SAM tau | tree branch | tree steps | tree tau | "
                  "undrafted steps |", "|---|---|---|---|---|---|---|"]
        for m, h in hybrid.items():
            # the tree branch's counters: tr_* (sam_tr), eagle2_* (sam_eagle2)
            b = next((k[: -len("_steps")] for k in h
                      if k.endswith("_steps") and k not in ("sam_steps", "none_steps")), None)
            lines.append(f"| {m} | {h['sam_steps']} | {_f(h.get('sam_tau'))} | {b or '-'} | "
                         f"{h.get(f'{b}_steps', '-')} | {_f(h.get(f'{b}_tau'))} | "
                         f"{h['none_steps']} |")
    if any("batch" in e for e in res["methods"].values()):
        bs = s.get("batch_size")
        lines += ["", f"In batches of {bs} (each turn of every session before the next turn)"
                  if bs else "All prompts in one batch (sessions: all of a turn at once)", "",
                  "| method | tau | tokens/s | speedup | outputs differing |", "|---|---|---|---|---|"]
        for m in methods:
            b = res["methods"][m].get("batch")
            if b:
                lines.append(f"| {m} | {_f(b['tau'])} | {_f(b['tokens_per_second'], 1)} | "
                             f"{_speedup(b)} | {b['outputs_differing_from_plain']} |")
    return "\n".join(lines) + "\n"


def verdicts(res: dict, baseline: str = "suffix") -> list[str]:
    """One sentence per method that answers a user's question: faster or
    slower than vLLM's ``baseline`` (by tokens/s) on this run, by how much,
    and whether every output was token-identical to plain decoding. The
    baseline's own line (and plain's) says what they are; a run without the
    baseline compares with plain decoding."""
    methods = res["methods"]
    flagged = {f.method for f in check(res)}
    ref = baseline if baseline in methods else "plain" if "plain" in methods else None
    out = []
    for m, e in methods.items():
        if m == "plain":
            continue
        tps = e["overall"]["tokens_per_second"]
        n_diff = e["outputs_differing_from_plain"]
        same = ("every output token-identical to plain decoding" if n_diff == 0 else
                f"{n_diff} output(s) differ from plain decoding")
        if m == ref or ref is None or not tps or not methods[ref]["overall"]["tokens_per_second"]:
            sp = e["overall"].get("speedup")
            rel = (f"{sp:.2f}x plain decoding's tokens/s" if sp else "no tokens/s measured")
            out.append(f"{m}: {rel}; {same}.")
            continue
        ratio = tps / methods[ref]["overall"]["tokens_per_second"]
        word = ("on par with" if abs(ratio - 1.0) < 0.02 else
                "faster than" if ratio > 1.0 else "slower than")
        by = f"{(ratio - 1) * 100:+.0f}%"
        who = f"vLLM's `{ref}`" if ref != "plain" else "plain decoding"
        caveat = (" (measurement flagged as implausible: rerun on a quiet machine)"
                  if m in flagged or ref in flagged else "")
        out.append(f"{m}: {word} {who} on this run ({tps:.1f} against "
                   f"{methods[ref]['overall']['tokens_per_second']:.1f} tokens/s, {by}); "
                   f"{same}{caveat}.")
    return out


#: Our methods within this share of the fastest count as "on par" in a
#: workload verdict (run-to-run spread of one run on this machine: ~2-5%).
ON_PAR = 0.02


def workload_verdicts(res: dict, recommends: dict[str, str | tuple | None]) -> list[str]:
    """One line per workload (a category of the run, ``recommends``: the
    method README.md recommends for it, or a tuple of methods it recommends
    alike; None: no method is expected to gain much): every method's tokens/s
    and speedup there, then whether the run agrees with the README: the
    (best) recommended method is the fastest or within ``ON_PAR`` of it; with
    no recommendation, none of ours is slower than plain decoding by more
    than ``ON_PAR``. Flagged methods are said so."""
    methods = res["methods"]
    flagged = {f.method for f in check(res)}
    ours = [m for m in methods if m not in ("plain", "ngram", "suffix")]
    lines = []
    for cat, rec in recommends.items():
        tps = {m: e["categories"][cat]["tokens_per_second"] for m, e in methods.items()
               if cat in e["categories"]}
        if "plain" not in tps or not tps["plain"]:
            continue
        figures = ", ".join(f"`{m}` {tps[m] / tps['plain']:.2f}x" for m in tps if m != "plain")
        best = max(tps, key=tps.get)
        if isinstance(rec, tuple):   # the fastest of the methods recommended alike
            ran = [m for m in rec if m in tps]
            rec = max(ran, key=tps.get) if ran else " or ".join(rec)
        if rec is None:
            slow = [m for m in ours if m in tps and tps[m] < (1 - ON_PAR) * tps["plain"]]
            verdict = ("as expected, drafts from text gain little here and none of ours is "
                       "slower than plain decoding" if not slow else
                       f"**not as expected**: {', '.join(f'`{m}`' for m in slow)} slower than "
                       f"plain decoding")
        elif rec not in tps:
            verdict = f"`{rec}` (recommended) was not run"
        elif best == rec:
            verdict = f"the recommended `{rec}` is the fastest"
        elif tps[rec] >= (1 - ON_PAR) * tps[best]:
            verdict = f"the recommended `{rec}` is on par with the fastest, `{best}`"
        else:
            verdict = (f"**not as the README says**: `{best}` is "
                       f"{(tps[best] / tps[rec] - 1) * 100:.0f}% faster than the recommended "
                       f"`{rec}`")
        caveat = ("; flagged as implausible (" + ", ".join(sorted(flagged & set(tps))) +
                  "): rerun on a quiet machine" if flagged & set(tps) else "")
        lines.append(f"{cat} ({figures} plain decoding's tokens/s): {verdict}{caveat}.")
    return lines


def plots(res: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    methods = list(res["methods"])
    cats = list(next(iter(res["methods"].values()))["categories"]) + ["overall"]
    paths = []
    for key, title, fname in (("speedup", "Speedup over plain decoding", "speedup.png"),
                              ("tau", "tau (generated tokens / target steps)", "tau.png")):
        fig, ax = plt.subplots(figsize=(max(8, len(cats) * 0.9), 4.5))
        width = 0.8 / len(methods)
        x = np.arange(len(cats))
        for i, m in enumerate(methods):
            e = res["methods"][m]
            vals = [(e["categories"][c] if c != "overall" else e["overall"]).get(key, np.nan)
                    for c in cats]
            ax.bar(x + i * width - 0.4 + width / 2, vals, width, label=m)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xticks(x, cats, rotation=35, ha="right")
        ax.set_title(title)
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out_dir / fname
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    for m in methods:
        o = res["methods"][m]["overall"]
        ax.scatter(o["tau"], o["tokens_per_second"], s=40)
        ax.annotate(m, (o["tau"], o["tokens_per_second"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)
    ax.set_xlabel("tau")
    ax.set_ylabel("tokens/s (bs=1)")
    ax.set_title("tau against tokens/s")
    fig.tight_layout()
    p = out_dir / "tau_vs_tps.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


def write(res: dict, out_dir: Path, with_plots: bool = True) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    md = markdown(res)
    (out_dir / "results.md").write_text(md)
    (out_dir / "results.json").write_text(json.dumps(res, indent=1))
    if with_plots:
        res_paths = plots(res, out_dir)
        md += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in res_paths) + "\n"
        (out_dir / "results.md").write_text(md)
    return md


def write_docs(res: dict, out_dir: Path, docs_path: Path, command: str,
               commentary: str = "", raw_path: Path | None = None) -> None:
    """``docs/benchmarks.md``: the run's tables, the command that made them,
    and its plots copied next to it (``docs/img/bench_*.png``); the raw figures
    go to ``raw_path`` (default ``results/benchmarks.json`` beside the docs
    folder: docs hold prose, ``results/`` the raw data)."""
    import os
    import shutil

    if raw_path is None:
        raw_path = docs_path.parent.parent / "results" / "benchmarks.json"
    img_dir = docs_path.parent / "img"
    img_dir.mkdir(parents=True, exist_ok=True)
    images = []
    for name in ("speedup.png", "tau.png", "tau_vs_tps.png"):
        src = out_dir / name
        if src.exists():
            dst = img_dir / f"bench_{name}"
            shutil.copyfile(src, dst)
            images.append(f"![{name[:-4]}](img/{dst.name})")
    raw_link = Path(os.path.relpath(raw_path.resolve(), docs_path.parent.resolve())).as_posix()
    text = ["# Benchmarks", "",
            f"Generated by the harness (`specplug bench`); raw figures in "
            f"[{raw_path.name}]({raw_link}). Command:", "", "```bash", command, "```", ""]
    if commentary:
        text += [commentary.strip(), ""]
    text += [markdown(res), *images, ""]
    docs_path.write_text("\n".join(text))
    raw_path.parent.mkdir(parents=True, exist_ok=True)
    raw_path.write_text(json.dumps(res, indent=1))


# The README's methods table (`specplug bench --preset readme`): what each
# method drafts from (and what it needs), and the shape of its drafts.
METHOD_ROWS = {
    "sam": ("the request's own text, finished requests, optional static corpus (nothing)",
            "chain"),
    "token_recycling": ("the target's recycled top-k (nothing)", "tree"),
    "sam_tr": ("`sam`, else a Token Recycling tree (nothing)", "chain or tree"),
    "eagle2": ("an EAGLE-1 or EAGLE-3 **head** (`specplug train-eagle` trains one)", "tree"),
    "sam_eagle2": ("`sam`, else EAGLE-2 (a **head**)", "chain or tree"),
    "del": ("the target's first layers (nothing; pays only on a model trained for early "
            "exit)", "chain"),
    "ngram": ("vLLM's baseline: n-gram match in the request's text", "chain"),
    "suffix": ("vLLM's baseline: suffix tree of the request and earlier outputs "
               "(Arctic Inference)", "chain"),
    "plain": ("no speculation (the reference)", "-"),
}
README_BEGIN = ("<!-- methods-table: written by `specplug bench --preset readme`; "
                "edit the command, not the table -->")
README_END = "<!-- /methods-table -->"


def readme_table(res: dict, command: str, results_dir: str,
                 missing: dict[str, str] | None = None, prompt_note: str = "") -> str:
    """The README's methods table from one run: a row per method (ours first,
    then vLLM's baselines and plain decoding) with tau, tokens/s, the speedup
    over plain decoding and whether every output was token-identical to plain
    decoding; under it the run's settings, commit and the command that
    rewrites it. ``missing``: methods left out of the run, with the reason."""
    methods = res["methods"]
    if "plain" not in methods:
        raise ValueError("the README table needs plain decoding in the run (its reference)")
    flagged = check(res)
    if flagged:
        raise ValueError("implausible measurements (a busy machine?): "
                         + "; ".join(f.message for f in flagged))
    order = [m for m in METHOD_ROWS if m in methods] + [m for m in methods
                                                         if m not in METHOD_ROWS]
    plain_tps = methods["plain"]["overall"]["tokens_per_second"]
    lines = ["| method | drafts from (needs) | shape | tau | tokens/s | speedup | "
             "outputs identical to plain |", "|---|---|---|---|---|---|---|"]
    for m in order:
        o = methods[m]["overall"]
        src, shape = METHOD_ROWS.get(m, ("third-party method", "?"))
        name = f"vLLM `{m}`" if m in ("ngram", "suffix") else f"`{m}`"
        n_diff = methods[m]["outputs_differing_from_plain"]
        same = "reference" if m == "plain" else ("all" if n_diff == 0 else
                                                   f"**{n_diff} differ**")
        sp = 1.0 if m == "plain" else o["tokens_per_second"] / plain_tps
        lines.append(f"| {name} | {src} | {shape} | {_f(o['tau'])} | "
                     f"{_f(o['tokens_per_second'], 1)} | {sp:.2f}x | {same} |")
    for m, why in (missing or {}).items():
        src, shape = METHOD_ROWS.get(m, ("", ""))
        lines.append(f"| `{m}` | {src} | {shape} | not in this run: {why} | | | |")
    s, env = res["settings"], res["environment"]
    n_prompts = len(methods["plain"]["per_prompt"])
    when = (env.get("date") or "")[:10]
    lines += ["", f"One run, {when}, commit `{env.get('commit') or 'unknown'}`: "
              f"{n_prompts} {s.get('workload', 'spec_bench')} prompts{prompt_note}, "
              f"{s['max_tokens']} tokens each, temperature {s['temperature']}, batch size 1, "
              f"one engine per method; {env['cpu']} ({env['cores']} cores), vLLM "
              f"{env['vllm']}, torch {env['torch']}. Raw results: "
              f"[{results_dir}]({results_dir}). Rerun (about 12 minutes on 2 cores; the "
              f"table is rewritten only when no measurement is flagged as implausible):",
              "", "```bash", command, "```"]
    return "\n".join(lines)


def check_readme(text: str, path: Path) -> None:
    """Raise ValueError unless ``text`` holds exactly one methods-table block."""
    if text.count(README_BEGIN) != 1 or text.count(README_END) != 1:
        raise ValueError(f"{path}: expected one '{README_BEGIN}' ... '{README_END}' block")


def update_readme(path: Path, table: str) -> None:
    """Replace the block between README_BEGIN and README_END in ``path``."""
    text = path.read_text()
    check_readme(text, path)
    head, rest = text.split(README_BEGIN)
    _, tail = rest.split(README_END)
    path.write_text(f"{head}{README_BEGIN}\n{table}\n{README_END}{tail}")
