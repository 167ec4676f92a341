#!/usr/bin/env bash
# Sets up the development environment (see setup.sh) and runs the linters and the test suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SPECDEC_VENV:-$ROOT/.venv}"
bash "$ROOT/scripts/setup.sh" --dev
cd "$ROOT"
"$VENV/bin/ruff" check specdec_native cli tests
"$VENV/bin/mypy"
exec "$VENV/bin/python" -m pytest "$@"
