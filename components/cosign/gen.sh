#!/usr/bin/env bash
# Regenerates go.mod and go.sum from versions.env (needs the Go module proxy): a wrapper module requiring only
# $COSIGN_MODULE, so that cosign is built with exactly the dependency versions it was released with.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../buildlib.sh
source "$HERE/../buildlib.sh"
# shellcheck source=versions.env
source "$HERE/versions.env"
gen_go_tool cosign "$COSIGN_MODULE" "$COSIGN_VERSION"
