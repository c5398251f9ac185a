"""EAGLE draft vocabulary (FR-Spec): the file, its validation, the choice
rules, the config check before the engine starts, and the head runner's
top-k over the restricted LM head (against brute force). No engine."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_specplug.eagle.draft_vocab import (FILE, DraftVocabError, choose_draft_vocab,
                                             count_tokens, load_draft_vocab, main,
                                             write_draft_vocab)
from helpers import random_head, small_config


def test_count_write_load_round_trip(tmp_path):
    counts = count_tokens([[3, 3, 1], [3, 7, 1, 9], []], 10)
    assert counts.tolist() == [0, 2, 0, 3, 0, 0, 0, 1, 0, 1]
    write_draft_vocab(tmp_path, counts, "test")
    d = json.loads((tmp_path / FILE).read_text())
    # most frequent first, ties by id; unseen tokens left out
    assert d["token_ids"] == [3, 1, 7, 9] and d["counts"] == [3, 2, 1, 1]
    assert load_draft_vocab(tmp_path, 10).tolist() == [3, 1, 7, 9]
    assert load_draft_vocab(tmp_path / "nothing_here") is None


def test_count_rejects_ids_outside_the_vocabulary():
    with pytest.raises(DraftVocabError, match="outside the vocabulary of 10"):
        count_tokens([[1, 10]], 10)
    with pytest.raises(DraftVocabError, match="no token"):
        write_draft_vocab("/nonexistent", np.zeros(5, dtype=np.int64), "x")


def test_choice_rules(tmp_path):
    write_draft_vocab(tmp_path, count_tokens([[5, 5, 5, 2, 2, 8]], 10), "t")
    assert choose_draft_vocab(tmp_path, 0, 10).tolist() == [2, 5, 8]   # all, sorted
    assert choose_draft_vocab(tmp_path, 2, 10).tolist() == [2, 5]      # the 2 most frequent
    assert choose_draft_vocab(tmp_path, -1, 10) is None                # whole vocabulary
    every = tmp_path / "every"
    every.mkdir()
    write_draft_vocab(every, count_tokens([[0, 1, 2, 2]], 3), "t")
    assert choose_draft_vocab(every, 0, 3) is None   # covers the whole vocabulary
    assert choose_draft_vocab(every, 1, 3).tolist() == [2]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert choose_draft_vocab(empty, 0, 10) is None
    with pytest.raises(DraftVocabError, match="lacks"):
        choose_draft_vocab(empty, 100, 10)
    with pytest.raises(DraftVocabError, match="another model"):
        choose_draft_vocab(tmp_path, 0, 11)


@pytest.mark.parametrize("change,match", [
    (lambda d: "not json{", "not readable JSON"),
    (lambda d: {**d, "format": "other"}, "not a draft vocabulary file"),
    (lambda d: {**d, "vocab_size": -3}, "positive integer"),
    (lambda d: {**d, "token_ids": d["token_ids"][:-1]}, "same length"),
    (lambda d: {**d, "token_ids": [2, 2, 8]}, "duplicates"),
    (lambda d: {**d, "token_ids": [2, 5, 10]}, "outside"),
    (lambda d: {**d, "counts": [1, 2, 1]}, "non-increasing"),
    (lambda d: {**d, "counts": [3, 2, 0]}, "positive"),
    (lambda d: {**d, "token_ids": [5, "2", 8]}, "integers"),
])
def test_bad_files_fail_with_a_message(tmp_path, change, match):
    write_draft_vocab(tmp_path, count_tokens([[5, 5, 5, 2, 2, 8]], 10), "t")
    path = tmp_path / FILE
    new = change(json.loads(path.read_text()))
    path.write_text(new if isinstance(new, str) else json.dumps(new))
    with pytest.raises(DraftVocabError, match=match):
        load_draft_vocab(tmp_path, 10)


def test_cli_builds_the_file_from_trainer_data(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 20}))
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": "p", "prompt_ids": [1, 2],
                                          "output_ids": ids}) for ids in ([4, 4, 9], [9, 4])))
    assert main([str(tmp_path), str(data)]) == 0
    assert load_draft_vocab(tmp_path, 20).tolist() == [4, 9]   # prompt ids not counted
    assert "2 of 20 tokens" in capsys.readouterr().out


def test_config_refuses_a_count_without_a_file_before_the_engine(tmp_path):
    from vllm_specplug.eagle import save_head
    from vllm_specplug.options import SpecPlugConfigError
    from vllm_specplug.proposers.eagle2 import Eagle2Proposer
    from vllm_specplug.proposers.hybrid import SamEagle2Proposer

    cfg = small_config()
    save_head(random_head(cfg), cfg, tmp_path / "head")
    for cls in (Eagle2Proposer, SamEagle2Proposer):
        opts = {"model": str(tmp_path / "head"), "draft_vocab": 64}
        with pytest.raises(SpecPlugConfigError, match=f"draft_vocab.*{cls.name}.*lacks"):
            cls.check_options(8, opts)
        cls.check_options(8, {"model": str(tmp_path / "head"), "draft_vocab": 0})
    (tmp_path / "head" / FILE).write_text("{}")
    with pytest.raises(SpecPlugConfigError, match="not a draft vocabulary file"):
        Eagle2Proposer.check_options(8, {"model": str(tmp_path / "head"), "draft_vocab": 0})


def _runner(head_dir, cfg, draft_vocab: int, tied: bool):
    from vllm_specplug.vllm_adapter.v1.eagle_runner import EagleRunner

    torch.manual_seed(3)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    lm = embed if tied else torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    model = SimpleNamespace(model=SimpleNamespace(embed_tokens=embed), lm_head=lm)
    hf = SimpleNamespace(vocab_size=cfg.vocab_size, num_hidden_layers=4)
    drafter = SimpleNamespace(
        plugin={"options": {"model": str(head_dir), "draft_vocab": draft_vocab}},
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(hf_text_config=hf)))
    return EagleRunner(drafter, model, str(head_dir)), lm.weight.detach()


@pytest.mark.parametrize("tied", [True, False])
def test_runner_topk_is_over_the_draft_vocabulary(tmp_path, tied):
    from vllm_specplug.eagle import save_head

    cfg = small_config()
    head_dir = tmp_path / "head"
    save_head(random_head(cfg), cfg, head_dir)
    rng = np.random.default_rng(0)
    write_draft_vocab(head_dir, count_tokens([rng.integers(0, 50, 40).tolist()], 50), "t")
    vocab = load_draft_vocab(head_dir, 50)
    hidden = torch.randn(5, cfg.hidden_size)
    for setting, allowed in ((0, np.sort(vocab)), (7, np.sort(vocab[:7])),
                             (-1, np.arange(50))):
        runner, w = _runner(head_dir, cfg, setting, tied)
        ids, lps = runner._topk(hidden, 4)
        # brute force: log-softmax over the allowed rows only
        lp = torch.log_softmax(hidden @ w[torch.as_tensor(allowed)].T, dim=-1)
        v, i = torch.topk(lp, 4, dim=-1)
        assert np.isin(ids, allowed).all()
        np.testing.assert_array_equal(ids, allowed[i.numpy()])
        np.testing.assert_allclose(lps, v.numpy(), atol=1e-5)
