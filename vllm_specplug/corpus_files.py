"""Text corpora for ``specplug build-sam``: which files, which documents, tokens.

A corpus argument is

* a ``.jsonl`` file: one document per line (a JSON object). Its text is the
  ``field`` given, else ``"text"``, else whichever of ``"turns"``,
  ``"prompt"``, ``"output"`` the record has, joined by newlines (a list, such
  as Spec-Bench's ``turns``, is joined by newlines too). Records with none of
  them are skipped and counted;
* any other file: one document, its whole UTF-8 text;
* a directory: every file below it, in path order, read as above (names
  starting with ``.`` are skipped).

Long documents are tokenized in pieces of at most 64K characters, cut after
a newline between two non-space characters, or else before a single space
between a non-space character and a letter. GPT-2 style byte-level BPE
tokenizers (as SmolLM2's) start a token there either way, so the pieces'
tokens equal those of the whole text (a run of whitespace is different: at
the end of a piece it is one pre-token, inside the text all but its last
character); for other tokenizers a boundary token may differ.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

DEFAULT_FIELDS = ("turns", "prompt", "output")
PIECE_CHARS = 1 << 16      # longest piece of text handed to the tokenizer
BATCH_CHARS = 1 << 20      # characters per tokenizer call (its memory is ~200 B a token)


class CorpusReadError(ValueError):
    pass


def corpus_files(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """The files the corpus arguments name, in order."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(f for f in p.rglob("*") if f.is_file() and not any(
                part.startswith(".") for part in f.relative_to(p).parts)))
        elif p.is_file():
            out.append(p)
        else:
            raise CorpusReadError(f"corpus {str(p)!r}: no such file or directory")
    return out


def record_text(record: dict, field: str | None) -> str | None:
    """A JSONL record's document text (see the module docstring), or None."""
    if field is not None:
        names: Sequence[str] = (field,)
    elif "text" in record:
        names = ("text",)
    else:
        names = DEFAULT_FIELDS
    parts = []
    for name in names:
        value = record.get(name)
        if isinstance(value, str):
            parts.append(value)
        elif isinstance(value, list):
            parts.extend(str(v) for v in value)
    return "\n".join(parts) if parts else None


def jsonl_records(path: str | os.PathLike) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON) of each non-blank line of a JSONL file."""
    with open(path, encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, 1):
            if line.strip():
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    raise CorpusReadError(f"{path}:{lineno}: not JSON ({e})") from None


def document_texts(paths: Sequence[str | os.PathLike], field: str | None = None,
                   skipped: dict | None = None) -> Iterator[str]:
    """Each document's text; ``skipped[path]`` counts JSONL records without text."""
    for f in corpus_files(paths):
        if f.suffix == ".jsonl":
            for _, record in jsonl_records(f):
                text = record_text(record, field) if isinstance(record, dict) else None
                if text:
                    yield text
                elif skipped is not None:
                    skipped[str(f)] = skipped.get(str(f), 0) + 1
        else:
            try:
                text = f.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise CorpusReadError(f"{f}: not UTF-8 text ({e})") from None
            if text:
                yield text


# Safe places to cut text for a GPT-2 style byte-level BPE tokenizer: after a
# newline between two non-space characters, or before a single space that
# follows a non-space character and precedes a letter.
_NEWLINE_CUT = re.compile(r"(?<=\S)\n(?=\S)")
_SPACE_CUT = re.compile(r"(?<=\S) (?=[^\W\d_])")


def _last_cut(text: str, start: int, end: int) -> int:
    """The last safe cut in text[start+1:end], else end."""
    for pattern, after in ((_NEWLINE_CUT, True), (_SPACE_CUT, False)):
        last = None
        for last in pattern.finditer(text, start + 1, end):
            pass
        if last is not None:
            return last.end() if after else last.start()
    return end


def split_for_tokenizing(text: str, max_chars: int = PIECE_CHARS) -> list[str]:
    """``text`` in pieces of at most ``max_chars``, cut where the tokenizer
    splits anyway (see the module docstring; hard, if there is no such place)."""
    pieces = []
    start = 0
    while len(text) - start > max_chars:
        end = _last_cut(text, start, start + max_chars)
        pieces.append(text[start:end])
        start = end
    pieces.append(text[start:])
    return pieces


def tokenize_documents(texts: Iterable[str], tokenizer,
                       batch_chars: int = BATCH_CHARS) -> Iterator[np.ndarray]:
    """Token ids (no special tokens) of each text, tokenized in batches."""
    batch: list[tuple[str, bool]] = []  # (piece, whether it ends its document)
    current: list[np.ndarray] = []

    def flush() -> Iterator[np.ndarray]:
        ids = tokenizer([p for p, _ in batch], add_special_tokens=False)["input_ids"]
        for (_, ends), piece_ids in zip(batch, ids):
            current.append(np.asarray(piece_ids, dtype=np.int32))
            if ends:
                yield np.concatenate(current)
                current.clear()
        batch.clear()

    size = 0
    for text in texts:
        pieces = split_for_tokenizing(text)
        for i, piece in enumerate(pieces):
            batch.append((piece, i == len(pieces) - 1))
            size += len(piece)
            if size >= batch_chars:
                yield from flush()
                size = 0
    if batch:
        yield from flush()
