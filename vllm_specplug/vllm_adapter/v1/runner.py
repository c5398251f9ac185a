"""Worker: give our drafter the runner's per-step context.

vLLM's ``custom_class`` call passes token arrays by batch row only. Our
drafter also needs each row's request id (per-request state) and, later,
the scheduler output; this wrapper hands them over just before vLLM calls
``drafter.propose``. vLLM's arguments are bound by name against the
original's signature (``patching.bind``; the names are checked at plugin load
through ``Patch.args``), so a renamed or moved parameter fails loudly.
"""
from __future__ import annotations

from .drafter_state import DrafterState
from ..patching import bind

#: The arguments of ``GPUModelRunner.propose_draft_token_ids`` the wrapper reads.
PROPOSE_ARGS = ("scheduler_output", "sampled_token_ids", "hidden_states",
                "aux_hidden_states")
#: The arguments of ``GPUModelRunner._on_request_state_removed`` the wrapper reads.
REMOVED_ARGS = ("req_id",)


def our_drafter(runner) -> DrafterState | None:
    """The runner's drafter when it is ours, else None: the one place the
    adapter reads ``runner.drafter``. vLLM sets that attribute only with a
    speculative config on the last pipeline stage, so a runner without it
    has nothing for us to do; the name is checked against the installed vLLM
    (``GPUModelRunner.drafter`` in tests/test_adapter_targets.py)."""
    drafter = getattr(runner, "drafter", None)
    return drafter if isinstance(drafter, DrafterState) else None


def make_propose_draft_token_ids(original):
    arguments = bind(original, PROPOSE_ARGS)

    def propose_draft_token_ids(self, *args, **kwargs):
        drafter = our_drafter(self)
        if drafter is not None:
            a = arguments(self, *args, **kwargs)
            drafter.runner = self
            drafter.begin_step(self.input_batch.req_ids, a["scheduler_output"],
                               hidden_states=a["hidden_states"],
                               sampled_token_ids=a["sampled_token_ids"],
                               aux_hidden_states=a["aux_hidden_states"])
        return original(self, *args, **kwargs)

    return propose_draft_token_ids


def make_on_request_state_removed(original):
    arguments = bind(original, REMOVED_ARGS)

    def _on_request_state_removed(self, *args, **kwargs):
        drafter = our_drafter(self)
        if drafter is not None:
            drafter.finish_request(arguments(self, *args, **kwargs)["req_id"])
        return original(self, *args, **kwargs)

    return _on_request_state_removed


def make_setup_aux_hidden_state_outputs(original):
    """vLLM's CPU and GPU runners call this right after ``drafter.load_model``.
    When our drafter's hook needs auxiliary hidden states (an EAGLE-3 head:
    ``TargetHook.aux_layers``), the target model is told to return those
    layers' outputs with its final hidden states, as vLLM does for its own
    ``eagle3``; they reach the hook through ``begin_step``."""
    def _setup_eagle3_aux_hidden_state_outputs(self):
        drafter = our_drafter(self)
        hook = drafter.target_hook if drafter is not None else None
        if hook is not None and hook.aux_layers:
            from vllm.model_executor.models.interfaces import supports_eagle3

            from ...options import SpecPlugConfigError

            model = self.get_model()
            if not supports_eagle3(model):
                raise SpecPlugConfigError(
                    f"this EAGLE-3 head needs the target's intermediate hidden states, "
                    f"but vLLM's {type(model).__name__} cannot return them (no EAGLE-3 "
                    f"support in vLLM for this architecture); use an EAGLE-1 head")
            model.set_aux_hidden_state_layers(tuple(int(i) for i in hook.aux_layers))
            self.use_aux_hidden_state_outputs = True
            return None
        return original(self)

    return _setup_eagle3_aux_hidden_state_outputs
