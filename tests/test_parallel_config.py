"""Which methods run with pipeline parallelism (no engine)."""
from __future__ import annotations

import pytest

from vllm_specplug.config import translate
from vllm_specplug.options import SpecPlugConfigError
from vllm_specplug.vllm_adapter.v1.engine_args import check_pipeline_parallel


@pytest.mark.parametrize("spec", [
    {"method": "sam"},
    {"method": "sam", "num_speculative_tokens": 4, "sam_continuation": "first"},
])
def test_chain_methods_run_with_pipeline_parallelism(spec):
    _, plugin = translate(spec)
    check_pipeline_parallel(plugin, 2, on_cpu=False)
    check_pipeline_parallel(plugin, 1)


@pytest.mark.parametrize("spec, why", [
    ({"method": "token_recycling"}, "drafts trees"),
    ({"method": "sam_tr"}, "drafts trees"),
    ({"method": "debug_random_tree"}, "drafts trees"),
    ({"method": "del"}, "first layers"),
    ({"method": "sam", "acceptance": "rejection"}, "acceptance"),
    ({"method": "sam", "acceptance": "block"}, "acceptance"),
])
def test_other_methods_refuse_pipeline_parallelism(spec, why):
    _, plugin = translate(spec)
    check_pipeline_parallel(plugin, 1)  # no pipeline: fine
    with pytest.raises(SpecPlugConfigError) as e:
        check_pipeline_parallel(plugin, 4, on_cpu=False)
    msg = str(e.value)
    assert why in msg and "pipeline_parallel_size=4" in msg and "tensor_parallel_size" in msg
    assert repr(spec["method"]) in msg or "acceptance" in msg


@pytest.mark.parametrize("method", ["sam", "token_recycling", "del"])
def test_every_method_refuses_pipeline_parallelism_on_cpu(method):
    """vLLM 0.32's CPU runner fails to start PP with any speculative config
    (stages before the last have no drafter); refused with the reason."""
    _, plugin = translate({"method": method})
    check_pipeline_parallel(plugin, 1, on_cpu=True)
    with pytest.raises(SpecPlugConfigError, match="CPU runner") as e:
        check_pipeline_parallel(plugin, 2, on_cpu=True)
    assert "pipeline_parallel_size=2" in str(e.value)


def test_a_method_not_verified_under_tensor_parallelism_is_refused(monkeypatch):
    from vllm_specplug.proposers.early_exit import DelProposer
    from vllm_specplug.vllm_adapter.v1.engine_args import check_tensor_parallel

    check_tensor_parallel(translate({"method": "del"})[1], 2)  # verified: allowed
    monkeypatch.setattr(DelProposer, "supports_tensor_parallel", False)
    check_tensor_parallel(translate({"method": "del"})[1], 1)
    check_tensor_parallel(translate({"method": "sam"})[1], 2)
    with pytest.raises(SpecPlugConfigError, match="tensor_parallel_size=2"):
        check_tensor_parallel(translate({"method": "del"})[1], 2)
