#!/usr/bin/env bash
# Sets up (idempotent) and runs the test suite.
#
#   bash scripts/test.sh            CI's tier: every unit and property test and
#                                   one real-engine check of each method and path
#   bash scripts/test.sh --fast     day-to-day: unit and property tests only (no
#                                   engine, no server, nothing marked slow; fewer
#                                   hypothesis examples); skips set-up. Measured
#                                   here: 960 tests, 178 s wall, 105 s CPU (load 4-5)
#   SPECPLUG_SLOW_TESTS=1 bash scripts/test.sh   both tiers
#   After the main suite (no arguments), the vLLM 0.34 tier runs in the side
#   environment of scripts/setup-vllm034.sh (SPECPLUG_VLLM034_TIER=0 skips it)
#
# Further arguments go to pytest (e.g. a test file, -k NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
if [[ "${1:-}" == "--fast" ]]; then
  shift
  # tests/conftest.py loads the hypothesis profile "fast" (fewer examples)
  export SPECPLUG_FAST_TESTS=1
  exec "$PY" -m pytest -q -p no:cacheprovider --durations=15 \
    -m "not engine and not server and not slow" tests "$@"
fi
bash scripts/setup.sh
rc=0
"$PY" -m pytest -q -p no:cacheprovider --durations=40 tests "$@" || rc=$?
# The vLLM 0.34 tier (docs/compatibility.md): the MRV2 adapter against vLLM
# 0.34.0's real classes, then vLLM 0.34's own engine loop on this CPU, in the
# side environment. Runs after the whole suite only (no arguments given);
# SPECPLUG_VLLM034_TIER=0 skips it.
if [[ $# -eq 0 && "${SPECPLUG_VLLM034_TIER:-1}" != "0" ]]; then
  VENV034="${SPECPLUG_VLLM034_VENV:-/work/.venv-vllm034}"
  SPECPLUG_VLLM034_VENV="$VENV034" bash scripts/setup-vllm034.sh
  "$VENV034/bin/python" -m pytest -q -p no:cacheprovider --durations=15 -m vllm034 \
    tests/test_mrv2_speculator.py tests/test_vllm034_cpu_ops.py tests/test_vllm034_engine.py \
    || rc=$?
fi
exit $rc
