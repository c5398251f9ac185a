"""Where a tree step's state lives: owned by the drafter, bound to its layers.

Each engine's drafter (:class:`~.drafter.SpecPlugDrafter`) owns one
:class:`StepTrees`: the tree requests of the step being executed, their
attention arguments, the paths accepted last step and the tree counters. Three
readers reach it without any module-level state:

* the ``_prepare_inputs`` and ``_sample`` patches, through the runner's
  drafter (``runner.drafter.step``);
* our attention implementations (``TreeCPUAttentionImpl``,
  ``TreeFlashAttentionImpl``), through ``impl.tree_step``, set once at model
  load by :func:`bind_tree_layers` for every layer of that engine's model;
* the EAGLE-2 hook, through its drafter.

Two engines in one process (two ``LLM`` objects, tests) therefore never share
a step, and a reader sees where a step's state comes from. A decoder layer
whose attention is not ours (the override was not applied, or vLLM built it
with another backend) would verify trees with causal attention, so binding
refuses it when the model loads, before any request.

No vLLM import here (vLLM objects are passed in).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np


def _zero_stats() -> dict:
    return {"tree_steps": 0, "tree_nodes": 0, "tree_accepted": 0, "compacted": 0,
            "fallbacks": 0}


@dataclass
class StepTrees:
    """One engine's tree verification state (owned by its drafter). The
    element types are ``tree_runtime``'s (which imports this module)."""
    requests: list = field(default_factory=list)   # [TreeRequest] of this step
    groups: list = field(default_factory=list)     # [AttentionGroup] (CPU path)
    flash: Any = None                              # FlashTreeArgs (CUDA path)
    attended: bool = False   # some request is a real tree (its rows are recomputed)
    #: counters over the engine's life (the drafter's ``stats()["tree"]``)
    stats: dict = field(default_factory=_zero_stats)
    #: req_id -> accepted tree path (node indices) of the step just verified,
    #: for hooks that read the target's features at accepted nodes (eagle2);
    #: kept across ``clear`` until taken
    accepted_paths: dict[str, list[int]] = field(default_factory=dict)
    #: randomness of tree acceptance for requests without their own seed
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    #: decoder attention layers bound to this step (``bind_tree_layers``)
    layers: int = 0
    #: the first exception a layer's tree attention raised this step (None:
    #: none); the step's real trees then verify no drafts (``fail_attention``)
    attention_error: BaseException | None = None
    #: req_id -> (site, exception): a fault met before acceptance (copying the
    #: request's logits rows); acceptance contains it (``tree_runtime.accept_trees``)
    row_faults: dict = field(default_factory=dict)

    def clear(self) -> None:
        """Forget the step just executed (counters and accepted paths stay)."""
        self.requests = []
        self.groups = []
        self.flash = None
        self.attended = False
        self.attention_error = None
        self.row_faults = {}

    def fail_attention(self, error: BaseException) -> None:
        """A layer's tree attention raised: kept (the first one) for the
        ``_sample`` patch, and no later layer of this forward recomputes tree
        rows. The roots' rows never depend on it (vLLM's causal kernel
        computes them, the draft nodes come after them), so each tree request
        still gets plain decoding's next token, with no draft accepted."""
        if self.attention_error is None:
            self.attention_error = error
        self.attended = False

    def take_accepted_paths(self) -> dict[str, list[int]]:
        """The accepted paths of the last verified step (and forget them)."""
        out, self.accepted_paths = self.accepted_paths, {}
        return out


class TreeLayerImpl:
    """Mixin of our attention implementations: the step their forward reads.

    ``tree_step`` stays None until :func:`bind_tree_layers` binds the layer to
    its engine's drafter; ``tree_layer`` is False for layers that never see
    tree rows (encoder or cross attention)."""
    tree_step: StepTrees | None = None
    tree_layer: bool = True

    def tree_step_now(self) -> StepTrees | None:
        """The bound step when it has tree rows to recompute, else None."""
        step = self.tree_step
        return step if step is not None and step.attended else None


class TreeLayersMissing(RuntimeError):
    """A decoder attention layer of the model is not ours: trees would be
    verified with causal attention there."""


def bind_tree_layers(forward_context: Mapping[str, Any], step: StepTrees,
                     decoder_type: Any) -> int:
    """Bind every decoder attention layer of one engine's model to ``step``.

    ``forward_context`` is vLLM's ``compilation_config.static_forward_context``
    (layer name -> layer) of that engine, filled when the model was built;
    ``decoder_type`` is vLLM's ``AttentionType.DECODER``. Raises
    :class:`TreeLayersMissing` naming the layers whose implementation is not
    ours, or when the model has no decoder attention layer at all. Returns
    the number of layers bound."""
    bound, foreign = 0, []
    for name, layer in forward_context.items():
        if not hasattr(layer, "impl"):   # not an attention layer (e.g. Mamba, MoE)
            continue
        impl = layer.impl
        if isinstance(impl, TreeLayerImpl):
            if impl.tree_layer:
                impl.tree_step = step
                bound += 1
        elif layer.attn_type == decoder_type:
            foreign.append(f"{name} ({type(impl).__name__})")
    if foreign:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4
                                          else "")
        raise TreeLayersMissing(
            f"vllm_specplug tree verification: these decoder attention layers do not use our "
            f"tree attention, so draft trees would be verified with causal attention: {shown}. "
            f"Do not force another attention backend (VLLM_ATTENTION_BACKEND or "
            f"attention_config), or use a chain method (e.g. sam)")
    if not bound:
        raise TreeLayersMissing(
            "vllm_specplug tree verification: the model has no decoder attention layer built "
            "with our tree attention backend (the attention override was not applied); use a "
            "chain method (e.g. sam)")
    step.layers = bound
    return bound
