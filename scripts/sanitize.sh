#!/usr/bin/env bash
# The engine under AddressSanitizer and UBSan: rebuilds specdec with SPECDEC_SANITIZE=ON, runs the
# tests that drive the engine in this process, and rebuilds the normal module on the way out.
# The server, subprocess, resource, 20,000-sample distribution and the longest deep-pair tests are
# left out: under the sanitizers they take too long or measure the sanitizer. Run scripts/test.sh first (it sets up
# the environment).
#
#   scripts/sanitize.sh [pytest args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SPECDEC_VENV:-$ROOT/.venv}"
cd "$ROOT"

build() {
    echo "[sanitize] building specdec with SPECDEC_SANITIZE=$1" >&2
    SPECDEC_SANITIZE="$1" SPECDEC_TEST_HOOKS=ON SPECDEC_WERROR=ON \
        "$VENV/bin/pip" install --quiet --no-build-isolation --no-deps --editable "$ROOT" >&2
}
trap 'build OFF' EXIT
build ON

# libasan must come first in the process; libstdc++ with it, for the C++ runtime it intercepts.
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)" \
    ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_generation.py tests/test_ngram.py tests/test_parallel.py tests/test_requests.py \
    tests/test_errors.py tests/test_callbacks.py tests/test_policy.py tests/test_cost_curve.py \
    tests/test_sampling_math.py tests/test_damaged_models.py tests/test_rate_check.py \
    tests/test_structured.py tests/test_prediction.py \
    -k "not distribution" "$@"
