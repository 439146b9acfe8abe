#!/usr/bin/env bash
# The main job: three test nodes on this machine (a GPU origin, two CPU hosts), a two-stage pod across them (weft demo).
# Pass --keep to leave it running (then: weft demo --down), --json for a machine-readable last line.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$VENV/bin/weft" demo "$@"
