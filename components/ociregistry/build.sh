#!/usr/bin/env bash
# Builds ociregistry (main.go: go-containerregistry's registry with the OCI 1.1 referrers API on, at versions.env's
# version), the registry with that API in integration/install/test_image_supply_chain.py, once per set of pins,
# into a cache of its own: ${WEFT_CACHE_ROOT:-/var/cache/weft}/ociregistry/<key>/bin, where <key> is its version
# and a hash of this directory's versions.env, go.mod, go.sum and main.go.
#
# Static (CGO_ENABLED=0), symbols stripped.
#
# Usage: components/ociregistry/build.sh             build if not cached; prints the bin directory last
#        components/ociregistry/build.sh --bin-dir   print the bin directory only (built or not)
#        components/ociregistry/build.sh --cached    exit 0 if it is built already, 1 if not (builds nothing)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../buildlib.sh
source "$HERE/../buildlib.sh"
# shellcheck source=versions.env
source "$HERE/versions.env"

build_go_tool ociregistry "$OCIREGISTRY_MODULE" "$OCIREGISTRY_VERSION" "$OCIREGISTRY_BUILD_REVISION" . "-s -w" "${1:-}"
