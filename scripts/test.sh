#!/usr/bin/env bash
# The whole test suite: lint, layer contracts, unit tests, integration tests
# against real containerd/runc (each test makes and removes its own).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WEFT_SETUP_KUBE=1 source "$ROOT/scripts/setup.sh"
cd "$ROOT"
"$VENV/bin/ruff" check .
"$VENV/bin/lint-imports"
exec "$VENV/bin/pytest" "$@"
