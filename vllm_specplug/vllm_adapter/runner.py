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
            drafter.begin_step(self.input_batch.req_ids, scheduler_output)
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
