"""Process 0: turn our method names into vLLM's ``custom_class`` hook.

See ``vllm_specplug.config`` for the wiring. Runs before the engine starts,
so every bad key fails there with a message naming it.
"""
from __future__ import annotations

import typing
from typing import Any, Mapping

from ... import config as plugin_config


def vllm_method_names() -> list[str]:
    from vllm.config.speculative import SpeculativeMethod

    return list(typing.get_args(SpeculativeMethod))


def pipeline_parallel_problem(plugin: dict[str, Any]) -> str | None:
    """Why the configured method cannot run with pipeline parallelism (None: it can).

    vLLM builds a ``custom_class`` drafter on the last pipeline stage only, so
    only that stage's workers install our patches. Tree verification needs
    them in every stage (draft positions and ancestor-masked attention in
    every layer, KV compaction in every layer's cache); DEL drafts with the
    target's first layers, which live on another stage. A chain method with
    vLLM's own rejection sampler needs nothing outside the last stage."""
    from ...registry import get_proposer_class

    method = plugin["method"]
    cls = get_proposer_class(method)
    if cls.target_hook:
        return (f"method {method!r} drafts with the target's first layers, which pipeline "
                f"parallelism puts in another stage's worker")
    if cls.drafts_trees:
        return (f"method {method!r} drafts trees, and tree verification needs our attention "
                f"and position patches in every pipeline stage, while vLLM builds the drafter "
                f"(which installs them) on the last stage only")
    if plugin.get("acceptance"):
        return (f"speculative_config['acceptance'] routes chains through our tree "
                f"verification, which needs our patches in every pipeline stage, while vLLM "
                f"builds the drafter (which installs them) on the last stage only")
    return None


def check_pipeline_parallel(plugin: dict[str, Any], pipeline_parallel_size: int,
                            on_cpu: bool | None = None) -> None:
    """Refuse, before the engine starts, a method that cannot run with
    ``pipeline_parallel_size`` > 1 (see ``pipeline_parallel_problem``), and
    any method on vLLM's CPU runner (``on_cpu``: default, the platform's)."""
    if int(pipeline_parallel_size or 1) <= 1:
        return
    if on_cpu is None:
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
    if on_cpu:
        raise plugin_config.SpecPlugConfigError(
            f"pipeline parallelism (pipeline_parallel_size={pipeline_parallel_size}) with "
            f"speculative decoding does not start on vLLM 0.32's CPU runner, whatever the "
            f"method: the runners of the stages before the last have no drafter, and vLLM's "
            f"own initialize_kv_cache_tensors reads it (AttributeError: 'CPUModelRunner' "
            f"object has no attribute 'drafter'). Use tensor parallelism instead "
            f"(tensor_parallel_size), or drop the speculative config")
    why = pipeline_parallel_problem(plugin)
    if why is not None:
        raise plugin_config.SpecPlugConfigError(
            f"vllm-specplug does not support pipeline parallelism "
            f"(pipeline_parallel_size={pipeline_parallel_size}) for this speculative config: "
            f"{why}. Use tensor parallelism instead (tensor_parallel_size), or a chain method "
            f"without 'acceptance' (e.g. sam) with pipeline parallelism.")


def check_tensor_parallel(plugin: dict[str, Any], tensor_parallel_size: int) -> None:
    """Refuse, before the engine starts, a method not verified under tensor
    parallelism (``Proposer.supports_tensor_parallel``)."""
    from ...registry import get_proposer_class

    if int(tensor_parallel_size or 1) > 1 and not get_proposer_class(
            plugin["method"]).supports_tensor_parallel:
        raise plugin_config.SpecPlugConfigError(
            f"method {plugin['method']!r} is not yet supported with tensor parallelism "
            f"(tensor_parallel_size={tensor_parallel_size}): every rank must draft in "
            f"lockstep and this has not been verified; use tensor_parallel_size=1, or "
            f"another method (sam, token_recycling, sam_tr run with tensor parallelism)")


def make_create_speculative_config(original):
    def create_speculative_config(self, target_model_config, target_parallel_config):
        if not isinstance(self.speculative_config or {}, Mapping):
            raise plugin_config.SpecPlugConfigError(
                f"speculative_config must be a JSON object such as {{\"method\": \"sam\", "
                f"\"num_speculative_tokens\": 8}}, got {self.speculative_config!r}")
        spec: dict[str, Any] = plugin_config.normalize_keys(self.speculative_config or {})
        method = spec.get("method", self.spec_method)
        if plugin_config.is_plugin_method(method):
            for flag, key, value in (("--spec-method", "method", self.spec_method),
                                     ("--spec-model", "model", self.spec_model),
                                     ("--spec-tokens", "num_speculative_tokens",
                                      self.spec_tokens)):
                if value is None:
                    continue
                if key in spec:
                    raise ValueError(
                        f"{flag} and --speculative-config['{key}'] are mutually exclusive")
                spec[key] = value
            vllm_kwargs, plugin = plugin_config.translate(
                spec, tokenizer=target_model_config.tokenizer)
            from ... import faults
            from .request_options import check_watermark

            faults.check_env()
            check_watermark(self.watermark_config)
            check_pipeline_parallel(
                plugin, target_parallel_config.pipeline_parallel_size)
            check_tensor_parallel(
                plugin, target_parallel_config.tensor_parallel_size)
            from .cuda_checks import check_tree_model

            check_tree_model(plugin, target_model_config)
            self.spec_method = self.spec_model = self.spec_tokens = None
            self.speculative_config = vllm_kwargs
            self.additional_config = {**(self.additional_config or {}),
                                      plugin_config.ADDITIONAL_CONFIG_KEY: plugin}
        elif isinstance(method, str) and method not in vllm_method_names():
            raise plugin_config.unknown_method_error(method, vllm_method_names())
        return original(self, target_model_config, target_parallel_config)

    return create_speculative_config
