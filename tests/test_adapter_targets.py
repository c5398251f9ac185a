"""The adapter against the installed vLLM, without an engine: every patch
target, every argument the adapter binds by name and every vLLM attribute it
reads exists. A failure names the missing one (vLLM drifted: update the
adapter, then ``SUPPORTED_VLLM_VERSIONS``)."""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re
import types

import pytest

import vllm_specplug.vllm_adapter.v1 as adapter
from vllm_specplug.vllm_adapter import patching
from vllm_specplug.vllm_adapter.v1 import runner
from vllm_specplug.vllm_adapter.patching import BackendOverride, Patch, PatchTargetMissing

GPU_RUNNER = "vllm.v1.worker.gpu_model_runner"

#: (module, class, attribute) read by the adapter; the comment says where.
VLLM_ATTRIBUTES = [
    # drafter.py (configuration, step-cost cache key, tensor parallelism)
    ("vllm.config", "VllmConfig", "additional_config"),
    ("vllm.config", "VllmConfig", "speculative_config"),
    ("vllm.config", "VllmConfig", "model_config"),
    ("vllm.config", "VllmConfig", "parallel_config"),
    ("vllm.config", "ModelConfig", "model"),
    ("vllm.config", "ModelConfig", "dtype"),
    ("vllm.config", "ModelConfig", "tokenizer"),           # engine_args.py
    ("vllm.config", "ModelConfig", "hf_text_config"),      # eagle_runner.py
    ("vllm.config", "ParallelConfig", "tensor_parallel_size"),
    ("vllm.config", "ParallelConfig", "pipeline_parallel_size"),
    ("vllm.config", "SpeculativeConfig", "num_speculative_tokens"),
    ("vllm.distributed.parallel_state", "GroupCoordinator", "rank_in_group"),
    ("vllm.distributed.parallel_state", "GroupCoordinator", "broadcast_object"),
    # engine_args.py
    ("vllm.engine.arg_utils", "EngineArgs", "speculative_config"),
    ("vllm.engine.arg_utils", "EngineArgs", "additional_config"),
    ("vllm.engine.arg_utils", "EngineArgs", "spec_method"),
    ("vllm.engine.arg_utils", "EngineArgs", "spec_model"),
    ("vllm.engine.arg_utils", "EngineArgs", "spec_tokens"),
    # runner.py and the drafter's hooks (the runner's state)
    (GPU_RUNNER, "GPUModelRunner", "drafter"),
    (GPU_RUNNER, "GPUModelRunner", "input_batch"),
    (GPU_RUNNER, "GPUModelRunner", "get_model"),
    (GPU_RUNNER, "GPUModelRunner", "use_aux_hidden_state_outputs"),
    (GPU_RUNNER, "GPUModelRunner", "kv_caches"),            # early_exit_runner.py
    # drafter.py (max_tokens caps drafts) and tree_runtime.py (request options)
    (GPU_RUNNER, "GPUModelRunner", "requests"),
    ("vllm.v1.worker.gpu_input_batch", "CachedRequestState", "sampling_params"),
    ("vllm.v1.worker.gpu_input_batch", "CachedRequestState", "num_prompt_tokens"),
    ("vllm.sampling_params", "SamplingParams", "max_tokens"),
    # tenancy.py (cross-request memory kept apart by cache_salt and LoRA adapter)
    ("vllm.v1.request", "Request", "cache_salt"),
    ("vllm.v1.core.sched.output", "SchedulerOutput", "scheduled_new_reqs"),
    # queue_state.py (the waiting queue's length sent to the workers) and
    # drafter.py (finished requests, for the draining batch's valuation)
    ("vllm.v1.core.sched.scheduler", "Scheduler", "get_request_counts"),
    ("vllm.v1.core.sched.output", "SchedulerOutput", "finished_req_ids"),
    # drafter.py (malloc_trim only in a step that schedules nothing)
    ("vllm.v1.core.sched.output", "SchedulerOutput", "total_num_scheduled_tokens"),
    ("vllm.v1.core.sched.output", "NewRequestData", "req_id"),
    ("vllm.v1.worker.gpu_input_batch", "CachedRequestState", "lora_request"),
    ("vllm.lora.request", "LoRARequest", "lora_name"),
    ("vllm.lora.request", "LoRARequest", "lora_int_id"),
    ("vllm.lora.request", "LoRARequest", "lora_path"),
    ("vllm.sampling_params", "SamplingParams", "extra_args"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch", "req_ids"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch", "req_id_to_index"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch", "num_tokens_no_spec"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch", "token_ids_cpu"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch", "block_table"),
    ("vllm.v1.worker.block_table", "BlockTable", "block_size"),
    ("vllm.v1.worker.block_table", "BlockTable", "block_table"),
    ("vllm.model_executor.models.interfaces", "SupportsEagle3",
     "set_aux_hidden_state_layers"),
    # early_exit_runner.py (the target's layers, run by hand)
    ("vllm.model_executor.layers.attention.attention", "Attention", "sliding_window"),
    ("vllm.model_executor.models.llama", "LlamaModel", "start_layer"),
    ("vllm.model_executor.models.llama", "LlamaModel", "end_layer"),
    ("vllm.model_executor.models.qwen2", "Qwen2Model", "start_layer"),
    ("vllm.model_executor.models.qwen2", "Qwen2Model", "end_layer"),
    ("vllm.model_executor.models.llama", "LlamaForCausalLM", "lm_head"),
    ("vllm.model_executor.models.qwen2", "Qwen2ForCausalLM", "lm_head"),
    ("vllm.model_executor.models.qwen2", "Qwen2Attention", "qk_norm"),
    ("vllm.model_executor.layers.linear", "ColumnParallelLinear", "input_size_per_partition"),
    ("vllm.model_executor.layers.linear", "ColumnParallelLinear", "output_size_per_partition"),
    ("vllm.model_executor.layers.linear", "RowParallelLinear", "input_size_per_partition"),
    ("vllm.model_executor.layers.linear", "RowParallelLinear", "output_size_per_partition"),
    # patching.py (BackendOverride)
    (patching.BACKEND_REGISTRY_MODULE, "AttentionBackendEnum", "get_path"),
]

#: (module, function) the adapter imports and calls.
VLLM_FUNCTIONS = [
    ("vllm.distributed", "get_tp_group"),                              # drafter.py
    ("vllm.model_executor.models.interfaces", "supports_eagle3"),      # runner.py
    (patching.BACKEND_REGISTRY_MODULE, "register_backend"),            # patching.py
    ("vllm.config.speculative", "SpeculativeMethod"),                  # engine_args.py
]


@functools.lru_cache(maxsize=None)
def _source(cls: type) -> str:
    return "".join(inspect.getsource(c) for c in cls.__mro__
                   if c.__module__.startswith("vllm") and c is not object)


def has_attribute(cls: type, name: str) -> bool:
    """A dataclass field, a class attribute (method, property) or an instance
    attribute assigned in the class's (or a vLLM base's) source."""
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    if name in getattr(cls, "__annotations__", {}) or hasattr(cls, name):
        return True
    target = r"self\.\w+\s*,\s*"  # tuple targets: self.a, self.b = ...
    assigned = (rf"^\s*({target})*self\.{re.escape(name)}\s*(,\s*self\.\w+\s*)*"
                rf"(:[^=\n]+)?=[^=]")
    return re.search(assigned, _source(cls), re.MULTILINE) is not None


@pytest.mark.parametrize("patch", adapter.PATCHES, ids=lambda p: p.name)
def test_patch_target_exists(patch):
    patching.check_target(patch)  # raises PatchTargetMissing naming what is missing


def test_every_patch_is_checked_at_plugin_load():
    adapter.check_targets()
    assert len({p.name for p in adapter.PATCHES}) == len(adapter.PATCHES)


@pytest.mark.parametrize("patch", [p for p in adapter.PATCHES
                                   if isinstance(p, Patch) and p.args], ids=lambda p: p.name)
def test_bound_arguments_exist(patch):
    owner = importlib.import_module(patch.module)
    if patch.cls:
        owner = getattr(owner, patch.cls)
    params = inspect.signature(getattr(owner, patch.attr)).parameters
    missing = [a for a in patch.args if a not in params]
    assert not missing, f"{patch.name}: no parameter(s) {missing} in vLLM's signature"


def test_runner_binds_what_its_patches_declare():
    assert adapter.RUNNER_PATCH.args == runner.PROPOSE_ARGS
    assert adapter.REQUEST_REMOVED_PATCH.args == runner.REMOVED_ARGS


@pytest.mark.parametrize("module, cls, attr", VLLM_ATTRIBUTES,
                         ids=[f"{c}.{a}" for _, c, a in VLLM_ATTRIBUTES])
def test_vllm_attribute_exists(module, cls, attr):
    owner = getattr(importlib.import_module(module), cls)
    assert has_attribute(owner, attr), f"vLLM's {module}.{cls} has no attribute {attr!r}"


@pytest.mark.parametrize("module, name", VLLM_FUNCTIONS, ids=[n for _, n in VLLM_FUNCTIONS])
def test_vllm_function_exists(module, name):
    assert hasattr(importlib.import_module(module), name), f"vLLM's {module} has no {name}"


def test_vllm_calls_our_drafter_as_it_expects():
    """vLLM's ``custom_class`` call of ``drafter.propose`` (and the CPU
    runner's ``drafter.load_model``) match SpecPlugDrafter's signatures."""
    from vllm.v1.worker import cpu_model_runner, gpu_model_runner

    from vllm_specplug.vllm_adapter.v1.drafter import SpecPlugDrafter

    call = re.search(r'method == "custom_class":.*?\.propose\((.*?)\)\n',
                     inspect.getsource(gpu_model_runner.GPUModelRunner.propose_draft_token_ids),
                     re.DOTALL)
    assert call, "GPUModelRunner.propose_draft_token_ids no longer calls a custom_class drafter"
    args = [a.strip() for a in call.group(1).split(",") if a.strip()]
    assert args == ["sampled_token_ids", "self.input_batch.num_tokens_no_spec",
                    "self.input_batch.token_ids_cpu", "slot_mappings=slot_mappings"], args
    inspect.signature(SpecPlugDrafter.propose).bind(None, [], None, None, slot_mappings=None)
    assert "self.drafter.load_model(self.model)" in inspect.getsource(cpu_model_runner)
    inspect.signature(SpecPlugDrafter.load_model).bind(None, None)


def test_cpu_attention_sets_the_layers_isa():
    """early_exit_runner.py reads ``Attention.isa``, set by vLLM's CPU backend."""
    from vllm.v1.attention.backends import cpu_attn

    assert re.search(r"layer\.isa\s*=", inspect.getsource(cpu_attn)), \
        "vLLM's CPU attention backend no longer sets layer.isa"


def test_fake_vllm_config_mirrors_the_real_one():
    """The unit tests' fake config (tests/helpers.py) has only names vLLM's has."""
    from helpers import fake_vllm_config
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig

    fake = fake_vllm_config({}, 4)
    parts = {"speculative_config": SpeculativeConfig, "model_config": ModelConfig,
             "parallel_config": ParallelConfig}
    for name, value in vars(fake).items():
        assert has_attribute(VllmConfig, name), name
        if name in parts:
            for sub in vars(value):
                assert has_attribute(parts[name], sub), f"{name}.{sub}"


def test_has_attribute_can_fail():
    from vllm.config import VllmConfig

    assert not has_attribute(VllmConfig, "no_such_config")


# ------------------------------------------------------------- apply is loud
def _fake_module(monkeypatch, name="specplug_fake_vllm_module"):
    module = types.ModuleType(name)

    class Runner:
        def step(self, scheduler_output, sampled_token_ids=None):
            return "original"

    module.Runner = Runner
    monkeypatch.setitem(__import__("sys").modules, name, module)
    return module


def _patch(attr="step", cls="Runner", module="specplug_fake_vllm_module", args=()):
    return Patch(name=f"{cls}.{attr}", module=module, cls=cls, attr=attr,
                 make=lambda original: (lambda self, *a, **k: "patched"),
                 why="a test", args=args)


@pytest.mark.parametrize("kw, missing", [
    ({"attr": "renamed_step"}, "specplug_fake_vllm_module.Runner.renamed_step does not exist"),
    ({"cls": "RenamedRunner"}, "class specplug_fake_vllm_module.RenamedRunner does not exist"),
    ({"module": "specplug_no_such_module"}, "module specplug_no_such_module cannot be imported"),
    ({"args": ("scheduler_output", "hidden_states")}, "no parameter 'hidden_states'"),
])
def test_apply_raises_on_a_missing_target(monkeypatch, kw, missing):
    module = _fake_module(monkeypatch)
    monkeypatch.setattr(patching, "APPLIED", {})
    patch = _patch(**kw)
    for call in (patching.apply, patching.check_target,
                 lambda p: patching.check_targets([p])):
        with pytest.raises(PatchTargetMissing) as e:
            call(patch)
        msg = str(e.value)
        assert missing in msg and repr(patch.name) in msg, msg
        assert "supports vLLM " + ", ".join(adapter.SUPPORTED_VLLM_VERSIONS) in msg, msg
    assert not patching.APPLIED and module.Runner().step(None) == "original"


def test_apply_patches_an_existing_target(monkeypatch):
    module = _fake_module(monkeypatch)
    monkeypatch.setattr(patching, "APPLIED", {})
    patch = _patch(args=("scheduler_output", "sampled_token_ids"))
    patching.apply(patch)
    assert module.Runner().step(None) == "patched"
    assert patching.APPLIED[patch.name][1](module.Runner(), None) == "original"


def test_missing_backend_raises(monkeypatch):
    monkeypatch.setattr(patching, "APPLIED", {})
    patch = BackendOverride(name="AttentionBackendEnum.NO_SUCH", backend="NO_SUCH",
                            class_path="x.Y", why="a test")
    with pytest.raises(PatchTargetMissing, match="AttentionBackendEnum.NO_SUCH does not exist"):
        patching.apply(patch)


def test_bind_reads_arguments_by_name():
    def original(self, scheduler_output, sampled_token_ids, hidden_states=None):
        pass

    arguments = patching.bind(original, ("scheduler_output", "hidden_states"))
    assert arguments("s", 1, 2) == {"scheduler_output": 1, "hidden_states": None}
    assert arguments("s", 1, 2, 3) == {"scheduler_output": 1, "hidden_states": 3}
    assert arguments("s", hidden_states=3, sampled_token_ids=2, scheduler_output=1) == {
        "scheduler_output": 1, "hidden_states": 3}
    with pytest.raises(PatchTargetMissing, match="no parameter 'aux_hidden_states'"):
        patching.bind(original, ("aux_hidden_states",))


# ------------------------------------- every supported release, from its sources
# The checks above run against the installed vLLM. These read the Python
# sources of every release in ``version.ADAPTERS`` (their wheels' .py files,
# cached by scripts/vllm_sources.py) with ``ast``, nothing imported: the V1
# adapter's PATCHES and attribute rows against each V1-runner release, the
# MRV2 adapter's REGISTRATIONS and READS against each MRV2 release.
import importlib.util  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

from vllm_specplug.vllm_adapter import mrv2  # noqa: E402
from vllm_specplug.vllm_adapter.version import ADAPTERS  # noqa: E402

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "vllm_sources.py"
_spec = importlib.util.spec_from_file_location("vllm_sources", _SCRIPT)
vllm_sources = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vllm_sources)

V1_RELEASES = [v for v, a in ADAPTERS.items() if a == "v1"]
MRV2_RELEASES = [v for v, a in ADAPTERS.items() if a == "mrv2"]


@functools.lru_cache(maxsize=None)
def _sources(version: str):
    """The release's cached sources; fetched once (pip download) when absent,
    unless SPECPLUG_NO_DOWNLOAD=1; a skip naming the command when neither works."""
    root = vllm_sources.source_dir(version)
    if root is None and os.environ.get("SPECPLUG_NO_DOWNLOAD") != "1":
        try:
            root = vllm_sources.fetch(version)
        except Exception as e:  # noqa: BLE001 - no network: skipped, with the reason
            return f"{type(e).__name__}: {e}"
    if root is None:
        return "SPECPLUG_NO_DOWNLOAD=1"
    return vllm_sources.StaticSource(root)


def static_source(version: str):
    src = _sources(version)
    if isinstance(src, str):
        pytest.skip(f"vLLM {version}'s sources are not cached and could not be fetched "
                    f"({src[:200]}); run `python scripts/vllm_sources.py {version}` "
                    f"(caches its wheel's .py files in {vllm_sources.cache_root()})")
    return src


def static_problems(src, module: str, cls: str | None, attr: str,
                    args: tuple[str, ...] = ()) -> list[str]:
    """What of ``module[.cls].attr(args)`` is missing from ``src`` (empty: all there)."""
    if src.module_path(module) is None:
        return [f"module {module} does not exist"]
    if cls is not None:
        if src.class_def(module, cls) is None:
            return [f"class {module}.{cls} does not exist"]
        if not src.has_attribute(module, cls, attr):
            return [f"{module}.{cls}.{attr} does not exist"]
    elif not src.has_name(module, attr):
        return [f"{module}.{attr} does not exist"]
    if args:
        params = src.parameters(module, cls, attr)
        if params is None:
            return [f"{module}.{cls + '.' if cls else ''}{attr} is not a function"]
        gone = [a for a in args if a not in params]
        if gone:
            return [f"{module}.{cls + '.' if cls else ''}{attr} has no parameter "
                    f"{', '.join(gone)} (its parameters: {', '.join(params)})"]
    return []


def static_patch_problems(src, patch) -> list[str]:
    if isinstance(patch, BackendOverride):
        out = [p for name in ("register_backend",)
               for p in static_problems(src, patch.module, None, name)]
        return out + static_problems(src, patch.module, "AttentionBackendEnum", patch.backend)
    return static_problems(src, patch.module, patch.cls, patch.attr, patch.args)


@pytest.mark.parametrize("version", V1_RELEASES)
@pytest.mark.parametrize("patch", adapter.PATCHES, ids=lambda p: p.name)
def test_patch_target_in_every_v1_release(version, patch):
    problems = static_patch_problems(static_source(version), patch)
    assert not problems, f"vLLM {version}, patch {patch.name}: {problems}"


@pytest.mark.parametrize("version", V1_RELEASES)
@pytest.mark.parametrize("module, cls, attr", VLLM_ATTRIBUTES,
                         ids=[f"{c}.{a}" for _, c, a in VLLM_ATTRIBUTES])
def test_vllm_attribute_in_every_v1_release(version, module, cls, attr):
    problems = static_problems(static_source(version), module, cls, attr)
    assert not problems, f"vLLM {version}: {problems}"


@pytest.mark.parametrize("version", V1_RELEASES)
@pytest.mark.parametrize("module, name", VLLM_FUNCTIONS, ids=[n for _, n in VLLM_FUNCTIONS])
def test_vllm_function_in_every_v1_release(version, module, name):
    problems = static_problems(static_source(version), module, None, name)
    assert not problems, f"vLLM {version}: {problems}"


@pytest.mark.parametrize("version", MRV2_RELEASES)
@pytest.mark.parametrize("reg", mrv2.REGISTRATIONS + mrv2.READS, ids=lambda r: r.name)
def test_mrv2_target_in_every_mrv2_release(version, reg):
    problems = static_problems(static_source(version), reg.module, reg.cls, reg.attr, reg.args)
    assert not problems, f"vLLM {version}, {reg.name}: {problems}"


@pytest.mark.parametrize("version", MRV2_RELEASES)
def test_mrv2_propose_overrides_vllms_signature_exactly(version):
    """vLLM calls ``propose`` positionally: our parameters are vLLM's, in order."""
    src = static_source(version)
    assert tuple(src.parameters(mrv2.SPECULATOR_MODULE, "BaseSpeculator", "propose")) == \
        mrv2.PROPOSE_ARGS


def test_static_checks_can_fail():
    """The static reader finds what is there and misses what is not (0.34
    deleted Model Runner V1: the V1 adapter's runner patch has no target)."""
    old, new = static_source(V1_RELEASES[0]), static_source(MRV2_RELEASES[0])
    assert not static_patch_problems(old, adapter.RUNNER_PATCH)
    assert static_patch_problems(new, adapter.RUNNER_PATCH) == [
        "module vllm.v1.worker.gpu_model_runner does not exist"]
    assert static_patch_problems(old, adapter.SAMPLE_PATCH) == []
    renamed = Patch(name="x", module=GPU_RUNNER, cls="GPUModelRunner", attr="_sample",
                    make=None, why="", args=("logits", "no_such_argument"))
    assert "no parameter no_such_argument" in static_patch_problems(old, renamed)[0]
    assert static_problems(old, "vllm.config", "VllmConfig", "no_such_config") == [
        "vllm.config.VllmConfig.no_such_config does not exist"]
    assert static_problems(new, "vllm.config", "VllmConfig", "speculative_config") == []
    assert static_problems(new, mrv2.STATES_MODULE, "RequestState", "no_such_state")
