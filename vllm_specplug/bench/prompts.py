"""Prompt sets: the vendored Spec-Bench questions, or any JSONL with
``turns`` (first turn used) or ``prompt``."""
from __future__ import annotations

import json
from collections import defaultdict
from importlib import resources
from pathlib import Path
from typing import Iterable

SPEC_BENCH_CATEGORIES = (
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
    "translation", "summarization", "qa", "math_reasoning", "rag")


def spec_bench_path() -> Path:
    return Path(str(resources.files("vllm_specplug") / "data" / "spec_bench_question.jsonl"))


HALVES = ("even", "odd")


def load_prompts(path: str | Path | None = None, per_category: int | None = None,
                 categories: Iterable[str] | None = None, half: str | None = None) -> list[dict]:
    """Rows of ``{"id", "category", "prompt"}`` in file order, ``per_category``
    first prompts of each category (all if None).

    ``half`` keeps the prompts at even (or odd) positions within their
    category: the two halves are disjoint, so one can be benchmarked while
    the model's answers to the other build a static corpus (``specplug answers``)."""
    if half is not None and half not in HALVES:
        raise ValueError(f"half must be one of {HALVES}, not {half!r}")
    path = Path(path) if path else spec_bench_path()
    if not path.exists():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    wanted = set(categories) if categories else None
    counts: dict[str, int] = defaultdict(int)
    positions: dict[str, int] = defaultdict(int)
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e})") from e
            if "turns" in obj and obj["turns"]:
                text = obj["turns"][0]
            elif "prompt" in obj:
                text = obj["prompt"]
            else:
                raise ValueError(f"{path}:{lineno}: a row needs 'turns' or 'prompt'")
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: the prompt must be a string")
            cat = str(obj.get("category", "all"))
            if wanted is not None and cat not in wanted:
                continue
            position = positions[cat]
            positions[cat] += 1
            if half is not None and position % 2 != HALVES.index(half):
                continue
            if per_category is not None and counts[cat] >= per_category:
                continue
            counts[cat] += 1
            rows.append({"id": obj.get("question_id", lineno), "category": cat, "prompt": text})
    if not rows:
        raise ValueError(f"no prompts selected from {path}")
    return rows
