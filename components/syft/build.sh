#!/usr/bin/env bash
# Builds syft (github.com/anchore/syft/cmd/syft, at versions.env's version) for the node image's SBOM (nodeimage/build/sbom.py), once per set of pins, into a cache of its own:
# ${WEFT_CACHE_ROOT:-/var/cache/weft}/syft/<key>/bin, where <key> is its version and a hash of this directory's
# versions.env, go.mod, go.sum and tools.go.
#
# Static (CGO_ENABLED=0), symbols stripped, its version set through -ldflags -X as its release build does.
#
# Usage: components/syft/build.sh             build if not cached; prints the bin directory last
#        components/syft/build.sh --bin-dir   print the bin directory only (built or not)
#        components/syft/build.sh --cached    exit 0 if it is built already, 1 if not (builds nothing)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../buildlib.sh
source "$HERE/../buildlib.sh"
SCRIPT=components/syft/build.sh
# shellcheck source=versions.env
source "$HERE/versions.env"

build_go_tool syft "$SYFT_MODULE" "$SYFT_VERSION" "$SYFT_BUILD_REVISION" github.com/anchore/syft/cmd/syft \
  "-s -w -X main.version=${SYFT_VERSION#v} -X main.gitDescription=${SYFT_VERSION}" "${1:-}"
