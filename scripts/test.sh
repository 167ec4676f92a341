#!/usr/bin/env bash
# Sets up the development environment (see setup.sh) and runs the linters and the test suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SPECDEC_VENV:-$ROOT/.venv}"
# Warnings fail the build here, so they cannot accumulate.
SPECDEC_WERROR=ON bash "$ROOT/scripts/setup.sh" --dev
cd "$ROOT"
"$VENV/bin/ruff" check specdec_native cli tests scripts
"$VENV/bin/ruff" format --check specdec_native cli tests scripts
"$VENV/bin/clang-format" --dry-run --Werror csrc/*.cpp csrc/*.h
"$VENV/bin/mypy"
exec "$VENV/bin/python" -m pytest "$@"
