"""Where a tree step's state lives (no engine): each drafter owns a StepTrees,
``bind_tree_layers`` binds that engine's attention layers to it and refuses a
decoder layer whose attention is not ours, before any request."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_specplug.vllm_adapter.v1.step_state import (StepTrees, TreeLayerImpl, TreeLayersMissing,
                                                   bind_tree_layers)

DECODER, ENCODER = "decoder", "encoder"


class _OurImpl(TreeLayerImpl):
    pass


class _TheirImpl:
    pass


def _layer(impl, attn_type=DECODER):
    return SimpleNamespace(impl=impl, attn_type=attn_type)


def test_binds_every_decoder_layer_to_its_own_engine_step():
    a_layers = {f"model.layers.{i}.self_attn.attn": _layer(_OurImpl()) for i in range(3)}
    b_layers = {f"model.layers.{i}.self_attn.attn": _layer(_OurImpl()) for i in range(2)}
    a_layers["model.mlp.experts"] = SimpleNamespace()   # not an attention layer
    a, b = StepTrees(), StepTrees()
    assert bind_tree_layers(a_layers, a, DECODER) == 3
    assert bind_tree_layers(b_layers, b, DECODER) == 2
    assert a.layers == 3 and b.layers == 2
    assert all(l.impl.tree_step is a for l in a_layers.values() if hasattr(l, "impl"))
    assert all(l.impl.tree_step is b for l in b_layers.values())
    # a step with tree rows in engine a is invisible to engine b's layers
    a.attended = True
    assert all(l.impl.tree_step_now() is a for l in a_layers.values() if hasattr(l, "impl"))
    assert all(l.impl.tree_step_now() is None for l in b_layers.values())
    a.clear()
    assert all(l.impl.tree_step_now() is None for l in a_layers.values() if hasattr(l, "impl"))


def test_encoder_layers_of_another_backend_and_non_tree_layers_are_left_alone():
    enc = _OurImpl()
    enc.tree_layer = False   # e.g. cross-attention built with our backend
    layers = {"dec": _layer(_OurImpl()), "enc": _layer(_TheirImpl(), ENCODER),
              "cross": _layer(enc, ENCODER)}
    step = StepTrees()
    assert bind_tree_layers(layers, step, DECODER) == 1
    assert enc.tree_step is None


def test_a_foreign_decoder_layer_is_refused_with_its_name():
    layers = {"model.layers.0.attn": _layer(_OurImpl()),
              "model.layers.1.attn": _layer(_TheirImpl())}
    with pytest.raises(TreeLayersMissing, match=r"model\.layers\.1\.attn \(_TheirImpl\)"):
        bind_tree_layers(layers, StepTrees(), DECODER)


def test_no_tree_layer_at_all_is_refused():
    with pytest.raises(TreeLayersMissing, match="no decoder attention layer"):
        bind_tree_layers({"x": SimpleNamespace()}, StepTrees(), DECODER)


def test_clear_keeps_counters_and_accepted_paths_until_taken():
    step = StepTrees()
    step.requests, step.attended = [object()], True
    step.stats["tree_steps"] += 2
    step.accepted_paths["r"] = [0, 2]
    step.clear()
    assert not step.requests and not step.attended and step.stats["tree_steps"] == 2
    assert step.take_accepted_paths() == {"r": [0, 2]}
    assert step.take_accepted_paths() == {}


def test_adapter_has_no_module_level_step_state():
    from vllm_specplug.vllm_adapter.v1 import sample, tree_runtime

    for module in (tree_runtime, sample):
        for name in ("STEP", "ACCEPTED_PATHS", "FLASH_TREE_LAYERS", "_RNG"):
            assert not hasattr(module, name), f"{module.__name__}.{name}"
