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
            #  hidden_states, ...) in vLLM 0.32
            sampled = args[0] if args else kwargs.get("sampled_token_ids")
            hidden = args[2] if len(args) > 2 else kwargs.get("hidden_states")
            drafter.begin_step(self.input_batch.req_ids, scheduler_output,
                               hidden_states=hidden, sampled_token_ids=sampled)
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
