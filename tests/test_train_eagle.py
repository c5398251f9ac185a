"""``specplug train-eagle`` end to end on a tiny run (8 prompts x 16 tokens),
and vLLM compatibility: a head saved by ``save_head`` runs in vLLM's own
``"method": "eagle"`` on this CPU build, and vLLM's first-step chain draft
equals the chain ``EagleHead`` computes greedily from transformers' target
features (vLLM's drafts captured by tests/capture_vllm_drafts.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from capture_vllm_drafts import head_chain, vllm_first_drafts

from vllm_specplug.eagle import load_head
from vllm_specplug.eagle.train import FeatureStore, TrainArgs, evaluate, init_head, load_target, \
    run, target_head_config

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_path):
    """A 2-epoch run interrupted after epoch 1 and resumed, and the same run
    uninterrupted (both on the same cached answers)."""
    out = tmp_path_factory.mktemp("eagle_train")
    common = dict(target=model_path, num_prompts=8, max_tokens=16, epochs=2, batch_size=2,
                  lr=1e-3, progress=False, max_model_len=512)
    first = run(TrainArgs(out=str(out / "a"), stop_after=1, **common))
    resumed = run(TrainArgs(out=str(out / "a"), resume=True, **common))
    # the uninterrupted run reuses run a's answers (no second engine)
    (out / "b").mkdir()
    for name in ("data.jsonl", "data.meta.json"):
        (out / "b" / name).write_bytes((out / "a" / name).read_bytes())
    straight = run(TrainArgs(out=str(out / "b"), **common))
    return out, first, resumed, straight


def test_stages_cached_and_resumed(tiny):
    out, first, resumed, straight = tiny
    assert first["generate"]["skipped"] is False and first["generate"]["output_tokens"] > 8
    assert resumed["generate"]["skipped"] and resumed["features"]["skipped"]
    assert straight["generate"]["skipped"] and not straight["features"]["skipped"]
    assert [h["epoch"] for h in first["train"]["history"]] == [1]
    assert resumed["train"]["resumed"]
    assert [h["epoch"] for h in resumed["train"]["history"]] == [1, 2]
    assert resumed["train"]["history"][0] == first["train"]["history"][0]
    rows = [json.loads(line) for line in open(out / "a" / "data.jsonl")]
    assert len(rows) == 8 and all(1 <= len(r["output_ids"]) <= 16 for r in rows)


def test_loss_decreases(tiny, model_path):
    """The training objective (no noise) over the training sequences: the
    trained head against the same head at init (per-epoch means over 4 steps
    are too noisy to compare; measured 1.98 -> 1.81, top-1 0 -> 0.25)."""
    out = tiny[0] / "a"
    model = load_target(model_path)
    store = FeatureStore(out)
    embed = model.get_input_embeddings().weight
    lm = model.get_output_embeddings().weight
    train_ids = list(range(len(store) - 1))
    before = evaluate(init_head(model, target_head_config(model), "random", 0), store,
                      train_ids, embed, lm)
    after = evaluate(load_head(out / "head")[0], store, train_ids, embed, lm)
    assert after["vloss"] + 0.1 * after["ce"] < before["vloss"] + 0.1 * before["ce"]
    assert after["top1"] > before["top1"]


def test_resume_equals_uninterrupted_run(tiny):
    out, _, resumed, straight = tiny
    a, _ = load_head(out / "a" / "head")
    b, _ = load_head(out / "b" / "head")
    for k, v in a.state_dict().items():
        torch.testing.assert_close(v, b.state_dict()[k], atol=1e-6, rtol=1e-5)
    ha, hb = resumed["train"]["history"], straight["train"]["history"]
    assert abs(ha[1]["train_loss"] - hb[1]["train_loss"]) < 1e-4 * abs(hb[1]["train_loss"])


def test_saved_head_loads(tiny, model_path):
    out, _, resumed, _ = tiny
    cfg_t = json.loads((Path(model_path) / "config.json").read_text())
    head, cfg = load_head(out / "a" / "head", hidden_size=cfg_t["hidden_size"],
                          vocab_size=cfg_t["vocab_size"])
    assert cfg.hidden_size == 576 and cfg.num_key_value_heads == 3
    assert resumed["train"]["heldout_sequences"] == 1
    assert 0.0 <= resumed["train"]["heldout_top1"] <= 1.0
    report = json.loads((out / "a" / "report.json").read_text())
    assert report["head"] == str((out / "a" / "head").resolve())


@pytest.mark.slow
def test_vllm_eagle_first_draft_equals_eagle_head(tiny, model_path, tmp_path):
    out, _, _, _ = tiny
    head_dir = out / "a" / "head"
    rows = vllm_first_drafts(str(head_dir), tmp_path)
    head, _ = load_head(head_dir)
    model = load_target(model_path)
    for row in rows:
        chain, ties = head_chain(head, model, row["prompt_ids"], row["output_ids"][0],
                                 row["first_draft"])
        assert chain == row["first_draft"], (row, chain, ties)
