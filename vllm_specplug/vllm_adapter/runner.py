"""Worker: give our drafter the runner's per-step context.

vLLM's ``custom_class`` call passes token arrays by batch row only. Our
drafter also needs each row's request id (per-request state) and, later,
the scheduler output; this wrapper hands them over just before vLLM calls
``drafter.propose``.
"""
from __future__ import annotations


def make_propose_draft_token_ids(original):
    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        from .drafter import SpecPlugDrafter

        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, SpecPlugDrafter):
            drafter.runner = self
            # (scheduler_output, sampled_token_ids, sampling_metadata,
            #  hidden_states, sample_hidden_states, aux_hidden_states, ...)
            # in vLLM 0.32
            sampled = args[0] if args else kwargs.get("sampled_token_ids")
            hidden = args[2] if len(args) > 2 else kwargs.get("hidden_states")
            aux = args[4] if len(args) > 4 else kwargs.get("aux_hidden_states")
            drafter.begin_step(self.input_batch.req_ids, scheduler_output,
                               hidden_states=hidden, sampled_token_ids=sampled,
                               aux_hidden_states=aux)
        return original(self, scheduler_output, *args, **kwargs)

    return propose_draft_token_ids


def make_on_request_state_removed(original):
    def _on_request_state_removed(self, req_id, req_state):
        from .drafter import SpecPlugDrafter

        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, SpecPlugDrafter):
            drafter.finish_request(req_id)
        return original(self, req_id, req_state)

    return _on_request_state_removed


def make_setup_aux_hidden_state_outputs(original):
    """vLLM's CPU and GPU runners call this right after ``drafter.load_model``.
    When our drafter's hook needs auxiliary hidden states (an EAGLE-3 head:
    ``target_hook.aux_layers``), the target model is told to return those
    layers' outputs with its final hidden states, as vLLM does for its own
    ``eagle3``; they reach the hook through ``begin_step``."""
    def _setup_eagle3_aux_hidden_state_outputs(self):
        from .drafter import SpecPlugDrafter

        drafter = getattr(self, "drafter", None)
        layers = getattr(getattr(drafter, "target_hook", None), "aux_layers", None)
        if isinstance(drafter, SpecPlugDrafter) and layers:
            from vllm.model_executor.models.interfaces import supports_eagle3

            from ..options import SpecPlugConfigError

            model = self.get_model()
            if not supports_eagle3(model):
                raise SpecPlugConfigError(
                    f"this EAGLE-3 head needs the target's intermediate hidden states, "
                    f"but vLLM's {type(model).__name__} cannot return them (no EAGLE-3 "
                    f"support in vLLM for this architecture); use an EAGLE-1 head")
            model.set_aux_hidden_state_layers(tuple(int(i) for i in layers))
            self.use_aux_hidden_state_outputs = True
            return None
        return original(self)

    return _setup_eagle3_aux_hidden_state_outputs
