#!/usr/bin/env bash
# The main job, today: a throwaway fabric on this machine (weft demo).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$VENV/bin/weft" demo "$@"
