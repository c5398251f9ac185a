"""Static corpus automaton: file format, matching against brute force, error
messages, the ``sam`` integration and ``specplug build-sam``. No vLLM."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_specplug.config import build_proposer, translate
from vllm_specplug.corpus_files import document_texts, split_for_tokenizing, tokenize_documents
from vllm_specplug.options import SpecPlugConfigError
from vllm_specplug.proposers import corpus_automaton
from vllm_specplug.proposers.corpus_automaton import (ARRAY_DTYPES, MAGIC, CorpusAutomaton,
                                                      _build_arrays, _collect,
                                                      build_corpus_automaton,
                                                      tokenizer_identity,
                                                      write_automaton_file)
from vllm_specplug.proposers.hybrid import SamTokenRecyclingProposer
from vllm_specplug.proposers.sam import SamProposer

EOS = 0
IDENTITY = {"name": "toy", "vocab_sha256": "0" * 64}
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

documents_st = st.lists(st.lists(st.integers(0, 3), max_size=14), max_size=6)
context_st = st.lists(st.integers(0, 4), max_size=30)


def build(tmp: str | Path, docs, identity=IDENTITY) -> CorpusAutomaton:
    path = Path(tmp) / "c.sam"
    build_corpus_automaton(docs, EOS, identity, path, progress=False)
    return CorpusAutomaton.load(path)


def occurs(needle, hay) -> bool:
    n = len(needle)
    return any(hay[i:i + n] == needle for i in range(len(hay) - n + 1))


def brute_match_len(context, docs) -> int:
    """Longest suffix of context that is a substring of some document."""
    for n in range(len(context), 0, -1):
        if any(occurs(context[-n:], d) for d in docs):
            return n
    return 0


def brute_continuation(needle, docs, k) -> list[int]:
    """Corpus tokens after needle's first occurrence (corpus = documents each
    followed by EOS), stopping before an EOS."""
    corpus = [t for d in docs for t in d + [EOS]]
    start = 0
    for d in docs:
        for i in range(len(d) - len(needle) + 1):
            if d[i:i + len(needle)] == needle:
                after = corpus[start + i + len(needle):][:k]
                return after[:after.index(EOS)] if EOS in after else after
        start += len(d) + 1
    raise AssertionError("needle does not occur")


# ------------------------------------------------------------ properties
@SETTINGS
@given(documents_st, context_st, st.integers(1, 8))
def test_matches_and_continuations_equal_brute_force(docs, context, k):
    with tempfile.TemporaryDirectory() as tmp:
        sa = build(tmp, docs)
        state, length = 0, 0
        for i, t in enumerate(context):
            state, length = sa.advance(state, length, t)
            ctx = context[:i + 1]
            assert length == brute_match_len(ctx, docs)
            expected = brute_continuation(ctx[-length:], docs, k) if length else []
            assert sa.continuation(state, length, k).tolist() == expected
        assert sa.advance_many(0, 0, context) == (state, length)


@SETTINGS
@given(documents_st)
def test_save_load_round_trip(docs):
    corpus, bounds = _collect(docs, EOS, progress=False)
    arrays = _build_arrays(corpus, bounds, progress=False)
    header = {"format_version": 1, "tokenizer": IDENTITY, "eos_id": EOS,
              "num_documents": len(docs), "num_tokens": int(corpus.size),
              "num_states": int(arrays["state_len"].size),
              "num_edges": int(arrays["edge_tokens"].size)}
    with tempfile.TemporaryDirectory() as tmp:
        write_automaton_file(Path(tmp) / "c.sam", arrays, header)
        sa = CorpusAutomaton.load(Path(tmp) / "c.sam")
        for name, dtype in ARRAY_DTYPES.items():
            loaded = getattr(sa, name)
            assert loaded.dtype == dtype and not loaded.flags.writeable
            np.testing.assert_array_equal(loaded, arrays[name])
        assert {k: sa.header[k] for k in header} == header
        assert sa.corpus.tolist() == [t for d in docs for t in d + [EOS]]


@settings(max_examples=40, deadline=None)
@given(documents_st, st.integers(1, 5))
def test_building_in_chunks_changes_nothing(docs, chunk):
    corpus, bounds = _collect(docs, EOS, progress=False)
    whole = _build_arrays(corpus, bounds, progress=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(corpus_automaton, "BUILD_CHUNK_TOKENS", chunk)
        pieces = _build_arrays(corpus, bounds, progress=False)
    for name in ARRAY_DTYPES:
        np.testing.assert_array_equal(pieces[name], whole[name])


def test_state_and_edge_counts_stay_within_the_bounds():
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 4, size=int(n)).tolist() for n in rng.integers(0, 200, size=50)]
    with tempfile.TemporaryDirectory() as tmp:
        sa = build(tmp, docs)
    n = sum(map(len, docs))
    assert sa.num_states <= 2 * n and sa.edge_tokens.size <= 3 * n


# ---------------------------------------------------------------- errors
@pytest.fixture
def sam_file(tmp_path) -> Path:
    path = tmp_path / "c.sam"
    build_corpus_automaton([[1, 2, 3, 1, 2], [2, 3, 4]], EOS, IDENTITY, path, progress=False)
    return path


def _load_error(path) -> str:
    with pytest.raises(ValueError) as info:
        CorpusAutomaton.load(path)
    assert str(path) in str(info.value)
    return str(info.value)


def test_missing_short_and_foreign_files(tmp_path, sam_file):
    assert "no such file" in _load_error(tmp_path / "none.sam")
    (tmp_path / "short").write_bytes(b"abc")
    assert "truncated" in _load_error(tmp_path / "short")
    (tmp_path / "foreign").write_bytes(b"\x93NUMPY" + bytes(100))
    assert "not a corpus automaton file" in _load_error(tmp_path / "foreign")


def test_truncated_file(tmp_path, sam_file):
    data = sam_file.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 20):
        p = tmp_path / f"cut{cut}"
        p.write_bytes(data[:cut])
        assert "truncated" in _load_error(p)


def _rewrite_header(src: Path, dst: Path, edit) -> None:
    data = bytearray(src.read_bytes())
    hlen = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16:16 + hlen])
    edit(header)
    blob = json.dumps(header).encode()
    assert len(blob) <= hlen + 200  # still before the first array
    data[8:16] = len(blob).to_bytes(8, "little")
    data[16:16 + len(blob)] = blob
    dst.write_bytes(bytes(data))


@pytest.mark.parametrize("edit, message", [
    (lambda h: h.update(format_version=99), "format version 99"),
    (lambda h: h.update(num_states=h["num_states"] + 1), "array 'state_len' has"),
    (lambda h: h["arrays"]["edge_tokens"].__setitem__(0, 3), "bad offset"),
    (lambda h: h["arrays"]["corpus"].__setitem__(0, 10 ** 9), "truncated"),
    (lambda h: h.pop("tokenizer"), "no tokenizer identity"),
])
def test_corrupt_header(tmp_path, sam_file, edit, message):
    _rewrite_header(sam_file, tmp_path / "bad", edit)
    assert message in _load_error(tmp_path / "bad")


def test_header_that_is_not_json(tmp_path, sam_file):
    data = bytearray(sam_file.read_bytes())
    data[16] = ord("#")
    (tmp_path / "bad").write_bytes(bytes(data))
    assert "corrupt header" in _load_error(tmp_path / "bad")


def test_corrupt_arrays(tmp_path, sam_file):
    sa = CorpusAutomaton.load(sam_file)
    link_at = sa.header["arrays"]["suffix_link"][0]
    data = bytearray(sam_file.read_bytes())
    data[link_at + 4:link_at + 8] = (10 ** 6).to_bytes(4, "little")
    (tmp_path / "bad").write_bytes(bytes(data))
    assert "suffix link" in _load_error(tmp_path / "bad")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_corruption_is_refused_or_harmless(data):
    """Any byte flips: a ValueError, or an automaton whose lookups stay in bounds."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.sam"
        build_corpus_automaton([[1, 2, 3, 1, 2, 3, 4], [2, 3, 4, 5]], EOS, IDENTITY, path,
                               progress=False)
        raw = bytearray(path.read_bytes())
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
        path.write_bytes(bytes(raw))
        try:
            sa = CorpusAutomaton.load(path)
        except ValueError:
            return
        state, length = sa.advance_many(0, 0, data.draw(st.lists(st.integers(0, 6))))
        sa.continuation(state, length, 8)


# ------------------------------------------------------------------ sam
DOC = list(range(10, 40))


def test_sam_drafts_the_corpus_continuation_for_a_novel_prompt(tmp_path):
    path = tmp_path / "c.sam"
    build_corpus_automaton([[5, 6, 7], DOC], EOS, IDENTITY, path, progress=False)
    prop = SamProposer(8, sam_corpus=str(path), sam_min_accept_prob=0.0, sam_corpus_bias=5,
                       sam_global_tokens=0)
    prompt = [50, 51] + DOC[:7]                   # novel text, 7 tokens of DOC
    prop.start("r", prompt)
    assert prop._automata["r"].match_len == 0
    assert prop.match_len("r") == 7 - 5           # static length minus the bias
    assert prop.propose("r", 8).tokens.tolist() == DOC[7:15]
    prop.observe("r", DOC[7:11] + [99])           # 4 accepted, then a bonus off the corpus
    assert prop.debug_stats() == {"dynamic_drafts": 0, "dynamic_tokens": 0,
                                  "dynamic_accepted": 0, "static_drafts": 1,
                                  "static_tokens": 8, "static_accepted": 4}
    assert prop.match_len("r") == 0 and len(prop.propose("r", 8)) == 0
    prop.finish("r")
    assert prop.active_requests() == 0 and not prop._corpus_matches


def test_sam_prefers_its_own_match_unless_the_corpus_one_is_longer_by_the_bias(tmp_path):
    path = tmp_path / "c.sam"
    build_corpus_automaton([DOC], EOS, IDENTITY, path, progress=False)
    # own match [12, 13, 14] (3 tokens, followed by 77); corpus match 5 tokens
    prompt = [12, 13, 14, 77, 10, 11, 12, 13, 14]
    for bias, expected in ((1, DOC[5:9]), (2, [77, 10, 11, 12])):
        prop = SamProposer(4, sam_corpus=str(path), sam_corpus_bias=bias,
                           sam_continuation="first", sam_min_accept_prob=0.0)
        prop.start("r", prompt)
        assert prop.propose("r", 4).tokens.tolist() == expected


def test_sam_tr_threshold_uses_the_effective_length(tmp_path):
    path = tmp_path / "c.sam"
    build_corpus_automaton([DOC], EOS, IDENTITY, path, progress=False)
    p = SamTokenRecyclingProposer(8, sam_tr_threshold=3, sam_corpus=str(path),
                                  sam_corpus_bias=5, sam_min_accept_prob=0.0,
                                  tr_prompt_bigrams=False)
    p.start("a", [50] + DOC[:8])                  # static 8 - bias 5 = 3
    assert p.match_len("a") == 3
    d = p.propose("a", 8)
    assert d.is_chain and d.tokens.tolist() == DOC[8:16]
    assert p.debug_stats()["sam"]["static_drafts"] == 1


def test_config_refuses_missing_and_corrupt_corpus_files(tmp_path, sam_file):
    with pytest.raises(SpecPlugConfigError, match="sam_corpus.*no such file.*build-sam"):
        translate({"method": "sam", "sam_corpus": str(tmp_path / "none.sam")})
    (tmp_path / "bad.sam").write_bytes(MAGIC + bytes(8))
    with pytest.raises(SpecPlugConfigError, match="sam_corpus.*bad.sam"):
        translate({"method": "sam_tr", "sam_corpus": f"{sam_file},{tmp_path / 'bad.sam'}"})
    _, plugin = translate({"method": "sam", "sam_corpus": f" {sam_file} , {sam_file}"})
    assert len(build_proposer(plugin).corpora) == 2


# ------------------------------------------------- real tokenizer, CLI
@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from vllm_specplug.models import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


def test_tokenizer_mismatch_is_refused_before_the_engine(tmp_path, sam_file, tokenizer):
    from vllm_specplug.models import default_model_path

    model = default_model_path()
    for method in ("sam", "sam_tr"):
        with pytest.raises(SpecPlugConfigError, match="built with tokenizer 'toy'.*rebuild it"):
            translate({"method": method, "sam_corpus": str(sam_file)}, tokenizer=model)
    ok = tmp_path / "ok.sam"
    build_corpus_automaton([[1, 2]], EOS, tokenizer_identity(tokenizer), ok, progress=False)
    translate({"method": "sam", "sam_corpus": str(ok)}, tokenizer=model)
    translate({"method": "sam", "sam_corpus": str(sam_file)})  # no model given: not checked


def test_long_texts_are_tokenized_in_pieces_as_a_whole(tokenizer):
    text = "".join(f"Line {i}:  value = {i * 37 % 101}\n\n  indented {i}\nword. "
                   f"Some prose, with   spaces and  Ünïcödé words 漢字 {i}.\n"
                   f"def f(x):\n    return x**{i}  # comment\n\n" for i in range(40))
    pieces = split_for_tokenizing(text, max_chars=50)
    assert "".join(pieces) == text and len(pieces) > 40
    assert max(map(len, pieces)) <= 50
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    [tokens] = tokenize_documents([text], tokenizer, batch_chars=120)
    assert tokens.tolist() == whole


def test_build_sam_cli(tmp_path, tokenizer):
    from vllm_specplug.cli import main

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("The quick brown fox jumps over the lazy dog.\n")
    (tmp_path / "docs" / ".hidden").write_text("skipped")
    rows = [{"text": "Hello world."}, {"turns": ["Hi", "there"]}, {"other": 1},
            {"prompt": "P", "output": "O"}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "c.sam"
    assert main(["build-sam", "--quiet", str(tmp_path / "docs"), str(tmp_path / "c.jsonl"),
                 "-o", str(out)]) == 0
    sa = CorpusAutomaton.load(out)
    texts = ["The quick brown fox jumps over the lazy dog.\n", "Hello world.", "Hi\nthere",
             "P\nO"]
    assert list(document_texts([tmp_path / "docs", tmp_path / "c.jsonl"])) == texts
    eos = tokenizer.eos_token_id
    expected = [t for s in texts for t in tokenizer.encode(s, add_special_tokens=False) + [eos]]
    assert sa.corpus.tolist() == expected and sa.eos_id == eos
    assert sa.header["num_documents"] == 4
    assert sa.tokenizer == tokenizer_identity(tokenizer)
    fox = tokenizer.encode("The quick brown", add_special_tokens=False)
    state, length = sa.advance_many(0, 0, fox)
    assert length == len(fox)
    assert sa.continuation(state, length, 3).tolist() == tokenizer.encode(
        " fox jumps over", add_special_tokens=False)[:3]
    # --field picks one field; no document at all is an error
    assert list(document_texts([tmp_path / "c.jsonl"], "output")) == ["O"]
    with pytest.raises(SystemExit, match="no documents"):
        main(["build-sam", "--quiet", str(tmp_path / "c.jsonl"), "--field", "none",
              "-o", str(tmp_path / "empty.sam")])
    with pytest.raises(SystemExit, match="no such file"):
        main(["build-sam", "--quiet", str(tmp_path / "missing.txt"), "-o", str(out)])
    assert os.path.exists(out)
