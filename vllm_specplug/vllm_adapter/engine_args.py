"""Process 0: turn our method names into vLLM's ``custom_class`` hook.

See ``vllm_specplug.config`` for the wiring. Runs before the engine starts,
so every bad key fails there with a message naming it.
"""
from __future__ import annotations

import typing
from typing import Any, Mapping

from .. import config as plugin_config


def vllm_method_names() -> list[str]:
    from vllm.config.speculative import SpeculativeMethod

    return list(typing.get_args(SpeculativeMethod))


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
            self.spec_method = self.spec_model = self.spec_tokens = None
            self.speculative_config = vllm_kwargs
            self.additional_config = {**(self.additional_config or {}),
                                      plugin_config.ADDITIONAL_CONFIG_KEY: plugin}
        elif isinstance(method, str) and method not in vllm_method_names():
            raise plugin_config.unknown_method_error(method, vllm_method_names())
        return original(self, target_model_config, target_parallel_config)

    return create_speculative_config
