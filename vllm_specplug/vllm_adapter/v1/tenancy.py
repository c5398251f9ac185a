"""Which cross-request memory a request may use (docs/security.md).

``sam``'s global store and Token Recycling's adjacency draft one request from
other requests' text; acceptance (so latency) then tells a request whether
someone else recently produced the text it is producing. The proposers keep
that memory apart by ``RequestInfo.tenant``; this module makes the key:

* ``isolation`` "salt" (default): the request's ``cache_salt`` and LoRA
  adapter (its name, id and path: ``lora_key``); requests with neither share
  the key ``()``; a request whose salt was not recorded (a patch that did not
  run) gets no cross-request memory (fails closed, logged as its fault);
* ``isolation`` "none": ``()`` for every request (one shared memory);
* ``isolation`` "request": None for every request (no cross-request memory);
* a request with ``SamplingParams.extra_args = {"specplug_share": False}``
  (through the OpenAI server: ``"vllm_xargs": {"specplug_share": 0}``, whose
  values cannot be objects or booleans) gets None whatever the mode: it
  neither reads nor feeds shared memory.

The same ``extra_args`` carry a request's own draft limits (``draft_cap``):
``"specplug_draft": False`` (or 0) decodes it without drafts,
``"specplug_max_draft": n`` drafts at most n tokens a step.

vLLM 0.32 does not send ``cache_salt`` to the workers (the scheduler hashes
it into block hashes only), so ``make_from_request`` (a patch of
``NewRequestData.from_request``, applied in every process) copies it onto
the ``NewRequestData`` the worker receives as ``specplug_cache_salt``;
``new_request_salts`` (read by the drafter from a patch of the runner's
``_update_states``, which sees every step's new requests, also in steps where
vLLM skips the drafter) gives it to the request's record, kept until the
runner removes the request's state. ``make_verify_extra_args`` (a patch of
``SamplingParams._verify_extra_args``) refuses a malformed
``"specplug_share"`` (or any other ``specplug`` key) where vLLM validates the
request, so it fails before it is served.
"""
from __future__ import annotations

from typing import Any, Hashable

from ...config import ISOLATION_MODES
from ...proposers.base import RequestInfo

#: Prefix of this plugin's ``SamplingParams.extra_args`` keys.
REQUEST_PREFIX = "specplug"
#: ``extra_args["specplug_share"]``: False (or 0): no cross-request memory.
SHARE_KEY = "specplug_share"
#: The values it takes (0 and 1: the OpenAI server's ``vllm_xargs`` turns
#: JSON booleans into integers).
SHARE_VALUES = (True, False, 1, 0)
#: The attribute ``make_from_request`` adds to ``NewRequestData``.
SALT_ATTR = "specplug_cache_salt"
#: A request whose salt was not recorded: its scheduler output unseen, or
#: its ``NewRequestData`` without our attribute.
NOT_RECORDED = object()


#: ``extra_args["specplug_draft"]``: False (or 0): no drafts for this request.
DRAFT_KEY = "specplug_draft"
#: ``extra_args["specplug_max_draft"]``: at most this many draft tokens a step.
MAX_DRAFT_KEY = "specplug_max_draft"
#: The request keys and what each does (for error messages).
REQUEST_KEYS = {
    SHARE_KEY: "true or false (1 or 0); false: this request neither reads nor feeds "
               "cross-request memory",
    DRAFT_KEY: "true or false (1 or 0); false: this request is decoded without drafts",
    MAX_DRAFT_KEY: "an integer >= 0: at most this many draft tokens a step for this request",
}


def _valid_share(value: Any) -> bool:
    return type(value) in (bool, int) and value in SHARE_VALUES


def _valid_max_draft(value: Any) -> bool:
    return type(value) is int and value >= 0


def check_extra_args(extra_args: Any) -> None:
    """Raise ``ValueError`` naming what to change when the request's
    ``extra_args`` has a ``specplug`` key that is not one of ``REQUEST_KEYS``,
    or one of them with a value it does not take."""
    if not isinstance(extra_args, dict):
        return
    how = (f'e.g. SamplingParams(extra_args={{"{SHARE_KEY}": False}}), or through the '
           f'OpenAI server "vllm_xargs": {{"{SHARE_KEY}": 0}}')
    unknown = sorted(k for k in extra_args
                     if isinstance(k, str) and k.startswith(REQUEST_PREFIX)
                     and k not in REQUEST_KEYS)
    if unknown:
        keys = "; ".join(f"{k!r}: {what}" for k, what in REQUEST_KEYS.items())
        raise ValueError(f"extra_args has unknown vllm_specplug keys {unknown}; the keys are "
                         f"{keys}; {how}")
    for key, valid in ((SHARE_KEY, _valid_share), (DRAFT_KEY, _valid_share),
                       (MAX_DRAFT_KEY, _valid_max_draft)):
        if key in extra_args and not valid(extra_args[key]):
            raise ValueError(f"extra_args[{key!r}] must be {REQUEST_KEYS[key]}, got "
                             f"{extra_args[key]!r}; {how}")


def draft_cap(runner: Any, req_id: str) -> int | None:
    """The request's own limit on draft tokens a step, from its
    ``extra_args`` (``specplug_draft`` false: 0; ``specplug_max_draft``);
    None without one. Values vLLM's validation (with our patch) refused
    never get here; an invalid one counts as no drafts, the safe side."""
    if runner is None:   # a drafter driven without vLLM's runner (unit tests)
        return None
    params = runner.requests[req_id].sampling_params
    extra = None if params is None else params.extra_args
    if not extra:
        return None
    cap = None
    if DRAFT_KEY in extra:
        value = extra[DRAFT_KEY]
        if not (_valid_share(value) and bool(value)):
            return 0
    if MAX_DRAFT_KEY in extra:
        value = extra[MAX_DRAFT_KEY]
        cap = value if _valid_max_draft(value) else 0
    return cap


def shares(sampling_params: Any) -> bool:
    """False when the request opted out (``specplug_share`` false or 0; a
    value that is not one of ``SHARE_VALUES``, refused by vLLM's validation
    with our patch, counts as opted out too: the safe side)."""
    if sampling_params is None:
        return True
    extra = sampling_params.extra_args
    if not extra or SHARE_KEY not in extra:
        return True
    value = extra[SHARE_KEY]
    return _valid_share(value) and bool(value)


def tenant_key(mode: str, salt: str | None, lora: tuple | None, share: bool) -> Hashable | None:
    """``RequestInfo.tenant`` for an ``isolation`` mode (module doc)."""
    if mode not in ISOLATION_MODES:
        raise ValueError(f"isolation must be one of {ISOLATION_MODES}, got {mode!r}")
    if mode == "request" or not share:
        return None
    if mode == "none" or (salt is None and lora is None):
        return ()
    return (salt, lora)


def lora_key(lora_request: Any) -> tuple | None:
    """The LoRA part of a tenant key: the adapter's name, id and path (None
    without an adapter). A name re-pointed to another adapter (another path
    or id) is another tenant, so it never drafts from the previous adapter's
    outputs. An adapter reloaded in place (``load_inplace``: same name, id
    and path, new weights) keeps its key: vLLM's own prefix cache does not
    tell those apart either."""
    if lora_request is None:
        return None
    return (lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path)


def new_request_salts(scheduler_output: Any) -> list[tuple[str, Any]]:
    """(req_id, ``cache_salt``) of this step's new requests (``NOT_RECORDED``
    for one whose ``NewRequestData`` lacks our attribute: it then fails
    closed in ``request_info_of``). The attribute is ours, set by
    ``make_from_request``, not vLLM's."""
    return [(new.req_id, getattr(new, SALT_ATTR, NOT_RECORDED))
            for new in scheduler_output.scheduled_new_reqs]


def request_info_of(runner: Any, req_id: str, mode: str, scheduled: bool,
                    salt: Any = NOT_RECORDED) -> RequestInfo:
    """What ``Proposer.start`` learns of a request: its tenant key and prompt
    length, from the runner's request state (``CachedRequestState``).
    ``scheduled``: a scheduler output was seen; ``salt``: the request's
    recorded ``cache_salt`` (``NOT_RECORDED``: none)."""
    if runner is None:   # a drafter driven without vLLM's runner (unit tests)
        return RequestInfo(tenant=tenant_key(mode, None, None, True))
    state = runner.requests[req_id]
    if mode == "salt":
        # Fail closed: with a real runner, a request whose salt was not
        # recorded (no scheduler output seen at all, or its NewRequestData
        # without our attribute) never joins the no-salt tenant.
        if not scheduled:
            raise RuntimeError(
                f"vllm_specplug: no scheduler output was recorded before request {req_id} "
                f"(the patch of the runner's _update_states did not run); it drafts without "
                f"cross-request memory")
        if salt is NOT_RECORDED:
            raise RuntimeError(
                f"vllm_specplug: no cache_salt was recorded for request {req_id} (the patch "
                f"of NewRequestData.from_request did not run in the scheduler's process); "
                f"it drafts without cross-request memory")
    else:
        salt = None
    lora = lora_key(state.lora_request)
    return RequestInfo(tenant=tenant_key(mode, salt, lora, shares(state.sampling_params)),
                       num_prompt_tokens=int(state.num_prompt_tokens))


# ------------------------------------------------------------------ patches
#: The arguments of ``GPUModelRunner._update_states`` the wrapper reads.
UPDATE_STATES_ARGS = ("scheduler_output",)


def make_update_states(original):
    """``GPUModelRunner._update_states`` that first hands the step's scheduler
    output to our drafter (the salts of its new requests; whether the step
    schedules anything), and afterwards lets it use a step that schedules
    nothing (``SpecPlugDrafter.after_update_states``)."""
    from ..patching import bind
    from .runner import our_drafter

    arguments = bind(original, UPDATE_STATES_ARGS)

    def _update_states(self, *args, **kwargs):
        drafter = our_drafter(self)
        if drafter is not None:
            drafter.note_scheduler_output(arguments(self, *args, **kwargs)["scheduler_output"])
        out = original(self, *args, **kwargs)
        if drafter is not None:
            drafter.after_update_states()   # an idle step: malloc_trim
        return out

    return _update_states


def make_from_request(original):
    """``NewRequestData.from_request`` (a classmethod) that also copies the
    request's ``cache_salt`` (``Request.cache_salt``) to the worker."""
    func = original.__func__

    def from_request(cls, request, *args, **kwargs):
        new = func(cls, request, *args, **kwargs)
        setattr(new, SALT_ATTR, request.cache_salt)
        return new

    return classmethod(from_request)


def make_verify_extra_args(original):
    """``SamplingParams._verify_extra_args`` that also refuses a malformed
    ``extra_args["specplug_share"]`` (vLLM answers a ValueError with a 400)."""
    def _verify_extra_args(self) -> None:
        original(self)
        check_extra_args(self.extra_args)

    return _verify_extra_args
