#!/usr/bin/env bash
# Sets up (idempotent) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec "$PY" -m pytest -q -p no:cacheprovider --durations=40 tests "$@"
