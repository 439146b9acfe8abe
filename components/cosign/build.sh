#!/usr/bin/env bash
# Builds cosign (github.com/sigstore/cosign/v2/cmd/cosign, at versions.env's version) for signing and verifying the node image and its SBOM (integration/install/test_image_supply_chain.py), once per set of pins, into a cache of its own:
# ${WEFT_CACHE_ROOT:-/var/cache/weft}/cosign/<key>/bin, where <key> is its version and a hash of this directory's
# versions.env, go.mod, go.sum and tools.go.
#
# Static (CGO_ENABLED=0), symbols stripped, its version set through -ldflags -X as its release build does.
#
# Usage: components/cosign/build.sh             build if not cached; prints the bin directory last
#        components/cosign/build.sh --bin-dir   print the bin directory only (built or not)
#        components/cosign/build.sh --cached    exit 0 if it is built already, 1 if not (builds nothing)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../buildlib.sh
source "$HERE/../buildlib.sh"
SCRIPT=components/cosign/build.sh
# shellcheck source=versions.env
source "$HERE/versions.env"

build_go_tool cosign "$COSIGN_MODULE" "$COSIGN_VERSION" "$COSIGN_BUILD_REVISION" github.com/sigstore/cosign/v2/cmd/cosign \
  "-s -w -X sigs.k8s.io/release-utils/version.gitVersion=${COSIGN_VERSION} -X sigs.k8s.io/release-utils/version.gitTreeState=clean" "${1:-}"
