#!/usr/bin/env bash
# The whole test suite: lint, layer contracts, unit tests, integration tests
# against real containerd/runc (each test makes and removes its own).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WEFT_SETUP_KUBE=background source "$ROOT/scripts/setup.sh"
# A background build of the Kubernetes components ends with this script, whatever happens.
trap '[ -n "${WEFT_KUBE_BUILD_PID:-}" ] && kill -- "-$WEFT_KUBE_BUILD_PID" 2>/dev/null; true' EXIT
cd "$ROOT"
"$VENV/bin/ruff" check .
"$VENV/bin/lint-imports"
# The tests that run real Kubernetes components go last (integration/conftest.py); by then the build has had
# the time the others left idle, and kube/build.sh waits for it (a lock) if it has not finished.
# On WEFT_TEST_WORKERS workers (pytest-xdist; 0: one process), a module to a worker, since a module's tests share
# its fabric or cluster: most of the time an integration test waits on daemons, not on the CPU.
"$VENV/bin/pytest" -n "${WEFT_TEST_WORKERS:-3}" --dist loadfile --durations=25 "$@"
