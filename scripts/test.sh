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
exec "$PY" -m pytest -q -p no:cacheprovider --durations=40 tests "$@"
