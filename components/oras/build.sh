#!/usr/bin/env bash
# Builds oras (oras.land/oras/cmd/oras, at versions.env's version) for attaching the node image's SBOM to the image in a registry (integration/install/test_image_supply_chain.py), once per set of pins, into a cache of its own:
# ${WEFT_CACHE_ROOT:-/var/cache/weft}/oras/<key>/bin, where <key> is its version and a hash of this directory's
# versions.env, go.mod, go.sum and tools.go.
#
# Static (CGO_ENABLED=0), symbols stripped, its version set through -ldflags -X as its release build does.
#
# Usage: components/oras/build.sh             build if not cached; prints the bin directory last
#        components/oras/build.sh --bin-dir   print the bin directory only (built or not)
#        components/oras/build.sh --cached    exit 0 if it is built already, 1 if not (builds nothing)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../buildlib.sh
source "$HERE/../buildlib.sh"
SCRIPT=components/oras/build.sh
# shellcheck source=versions.env
source "$HERE/versions.env"

build_go_tool oras "$ORAS_MODULE" "$ORAS_VERSION" "$ORAS_BUILD_REVISION" oras.land/oras/cmd/oras \
  "-s -w -X oras.land/oras/internal/version.GitTreeState=clean" "${1:-}"
