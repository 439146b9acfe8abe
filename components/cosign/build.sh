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

hash="$(cat "$HERE/versions.env" "$HERE/go.mod" "$HERE/go.sum" "$HERE/tools.go" | sha256sum | cut -c1-12)"
CACHE="$CACHE_ROOT/cosign"
DIR="$CACHE/cosign-$COSIGN_VERSION-$hash"

serve_cached "$DIR" "$CACHE" "${1:-}"  # answers --bin-dir and --cached; exits if built
need_go "cosign"

cd "$HERE"
have="$(go list -m -f '{{.Version}}' "$COSIGN_MODULE")"
if [ "$have" != "$COSIGN_VERSION" ]; then
  echo "$SCRIPT: go.mod has $COSIGN_MODULE $have, versions.env says $COSIGN_VERSION (run components/cosign/gen.sh)" >&2
  exit 1
fi
started=$(date +%s)
TMP="$DIR.tmp.$$"
rm -rf "$TMP"
mkdir -p "$TMP/bin"
trap 'rm -rf "$TMP"' EXIT
echo "$SCRIPT: building cosign $COSIGN_VERSION into $DIR"
go build -trimpath -ldflags "-s -w -X sigs.k8s.io/release-utils/version.gitVersion=${COSIGN_VERSION} -X sigs.k8s.io/release-utils/version.gitTreeState=clean" -o "$TMP/bin/cosign" github.com/sigstore/cosign/v2/cmd/cosign

printf 'COSIGN_VERSION=%s\nCOSIGN_BUILD_REVISION=%s\n' "$COSIGN_VERSION" "$COSIGN_BUILD_REVISION" |
  publish "$TMP" "$DIR" "$started" cosign
trap - EXIT
echo "$SCRIPT: built in $(( $(date +%s) - started )) s, $(du -sh "$DIR" | cut -f1) in $DIR"
echo "$DIR/bin"
