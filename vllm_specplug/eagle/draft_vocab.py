"""The draft vocabulary of an EAGLE head: the tokens its drafts may use.

An EAGLE-1 head shares the target's LM head, a ``[vocab, hidden]`` matmul
per drafted row. On this CPU that matmul is most of a head call (SmolLM2:
28M of the head's ~32M weights per row), so drafting over the whole
vocabulary costs about half a target step per EAGLE-2 step. FR-Spec
(arXiv 2502.14856) restricts the *draft* LM head to the most frequent
tokens; verification still uses the full vocabulary, so output does not
change (greedy stays token-identical; sampling stays lossless, the drafts
are only proposals). A token outside the draft vocabulary is never drafted.

The frequencies come from the target's own answers on the training prompts
(``specplug train-eagle`` writes them next to the head). The file:

``draft_vocab.json`` = ``{"format": "vllm-specplug-draft-vocab", "version": 1,
"vocab_size": V, "source": "...", "token_ids": [...], "counts": [...]}``,
token ids most frequent first, counts non-increasing, all counts > 0.

It is plain JSON (no pickle), validated on load. vLLM's own ``eagle``
ignores it (it loads ``*.safetensors`` and ``config.json`` only).

Build it for an existing head from the trainer's ``data.jsonl``::

    python -m vllm_specplug.eagle.draft_vocab HEAD_DIR WORK_DIR/data.jsonl
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np

FILE = "draft_vocab.json"
FORMAT = "vllm-specplug-draft-vocab"


class DraftVocabError(ValueError):
    """A bad draft vocabulary file or choice (the message says what to change)."""


def count_tokens(sequences: Iterable[Iterable[int]], vocab_size: int) -> np.ndarray:
    """Occurrences of each token id in ``sequences`` (ids outside the
    vocabulary are an error)."""
    counts = np.zeros(int(vocab_size), dtype=np.int64)
    for seq in sequences:
        ids = np.asarray(list(seq), dtype=np.int64)
        if ids.size == 0:
            continue
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise DraftVocabError(
                f"token id {int(ids.max() if ids.max() >= vocab_size else ids.min())} is "
                f"outside the vocabulary of {vocab_size}")
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def write_draft_vocab(head_dir: str | os.PathLike, counts: np.ndarray, source: str) -> Path:
    """Write ``draft_vocab.json`` into ``head_dir`` from per-token counts."""
    counts = np.asarray(counts, dtype=np.int64)
    seen = np.flatnonzero(counts > 0)
    if seen.size == 0:
        raise DraftVocabError("no token was counted: cannot build a draft vocabulary")
    order = seen[np.lexsort((seen, -counts[seen]))]  # most frequent first, ties by id
    path = Path(head_dir) / FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({
        "format": FORMAT, "version": 1, "vocab_size": int(counts.size), "source": source,
        "token_ids": order.tolist(), "counts": counts[order].tolist()}) + "\n")
    tmp.replace(path)
    return path


def load_draft_vocab(head_dir: str | os.PathLike, vocab_size: int | None = None
                     ) -> np.ndarray | None:
    """The head folder's draft vocabulary (token ids, most frequent first),
    validated; None when the folder has no ``draft_vocab.json``."""
    path = Path(head_dir) / FILE
    if not path.is_file():
        return None
    where = f"{path}"
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DraftVocabError(f"{where}: not readable JSON ({e}); delete it or rebuild it "
                              f"with `python -m vllm_specplug.eagle.draft_vocab`") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("version") != 1:
        raise DraftVocabError(f"{where}: not a draft vocabulary file (format {FORMAT!r}, "
                              f"version 1 expected)")
    v = d.get("vocab_size")
    ids, counts = d.get("token_ids"), d.get("counts")
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise DraftVocabError(f"{where}: 'vocab_size' must be a positive integer, got {v!r}")
    if vocab_size is not None and v != vocab_size:
        raise DraftVocabError(
            f"{where}: made for a vocabulary of {v} tokens, but the target has {vocab_size}: "
            f"it belongs to another model; rebuild it")
    if not isinstance(ids, list) or not isinstance(counts, list) or len(ids) != len(counts) \
            or not ids:
        raise DraftVocabError(f"{where}: 'token_ids' and 'counts' must be non-empty lists of "
                              f"the same length")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in ids + counts):
        raise DraftVocabError(f"{where}: 'token_ids' and 'counts' must hold integers")
    arr = np.asarray(ids, dtype=np.int64)
    c = np.asarray(counts, dtype=np.int64)
    if arr.min() < 0 or arr.max() >= v:
        raise DraftVocabError(f"{where}: a token id is outside [0, {v})")
    if np.unique(arr).size != arr.size:
        raise DraftVocabError(f"{where}: 'token_ids' has duplicates")
    if c.min() <= 0 or np.any(np.diff(c) > 0):
        raise DraftVocabError(f"{where}: 'counts' must be positive and non-increasing "
                              f"(most frequent token first)")
    return arr


def choose_draft_vocab(head_dir: str | os.PathLike, setting: int, vocab_size: int | None
                       ) -> np.ndarray | None:
    """The token ids the head drafts over, sorted; None: the whole vocabulary.

    ``setting`` is ``speculative_config['draft_vocab']``: -1 the whole
    vocabulary; 0 the folder's file when there is one (every token in it),
    else the whole vocabulary; N > 0 the N most frequent tokens of the file
    (which must exist)."""
    if setting < -1:
        raise DraftVocabError(f"draft_vocab must be -1, 0 or a positive count, got {setting}")
    if setting == -1:
        return None
    ids = load_draft_vocab(head_dir, vocab_size)
    if ids is None:
        if setting > 0:
            raise DraftVocabError(
                f"draft_vocab {setting} needs {Path(head_dir) / FILE} (token frequencies), "
                f"which this head folder lacks; `specplug train-eagle` writes it, or build it "
                f"with `python -m vllm_specplug.eagle.draft_vocab HEAD_DIR DATA.jsonl`, or "
                f"use draft_vocab -1 (the whole vocabulary)")
        return None
    if setting > 0:
        ids = ids[:setting]
    if vocab_size is not None and ids.size >= vocab_size:
        return None
    return np.sort(ids)


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_specplug.eagle.draft_vocab HEAD_DIR DATA.jsonl``: count
    the target's answer tokens (``output_ids`` of the trainer's data file)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(main.__doc__, file=sys.stderr)
        return 2
    head_dir, data = argv
    cfg = json.loads((Path(head_dir) / "config.json").read_text())
    vocab = int(cfg.get("text_config", cfg)["vocab_size"])
    with open(data) as f:
        rows = [json.loads(line)["output_ids"] for line in f if line.strip()]
    path = write_draft_vocab(head_dir, count_tokens(rows, vocab),
                             f"target answers in {os.path.basename(data)} ({len(rows)} rows)")
    n = len(load_draft_vocab(head_dir, vocab))
    print(f"wrote {path}: {n} of {vocab} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
