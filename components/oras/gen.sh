#!/usr/bin/env bash
# Regenerates go.mod and go.sum from versions.env (needs the Go module proxy): a wrapper module requiring only
# $ORAS_MODULE, so that it is built with exactly the dependency versions it was released with.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../buildlib.sh
source "$HERE/../buildlib.sh"
# shellcheck source=versions.env
source "$HERE/versions.env"
gen_go_tool oras "$ORAS_MODULE" "$ORAS_VERSION"
