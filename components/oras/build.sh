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

hash="$(cat "$HERE/versions.env" "$HERE/go.mod" "$HERE/go.sum" "$HERE/tools.go" | sha256sum | cut -c1-12)"
CACHE="$CACHE_ROOT/oras"
DIR="$CACHE/oras-$ORAS_VERSION-$hash"

serve_cached "$DIR" "$CACHE" "${1:-}"  # answers --bin-dir and --cached; exits if built
need_go "oras"

cd "$HERE"
have="$(go list -m -f '{{.Version}}' "$ORAS_MODULE")"
if [ "$have" != "$ORAS_VERSION" ]; then
  echo "$SCRIPT: go.mod has $ORAS_MODULE $have, versions.env says $ORAS_VERSION (run components/oras/gen.sh)" >&2
  exit 1
fi
started=$(date +%s)
TMP="$DIR.tmp.$$"
rm -rf "$TMP"
mkdir -p "$TMP/bin"
trap 'rm -rf "$TMP"' EXIT
echo "$SCRIPT: building oras $ORAS_VERSION into $DIR"
go build -trimpath -ldflags "-s -w -X oras.land/oras/internal/version.GitTreeState=clean" -o "$TMP/bin/oras" oras.land/oras/cmd/oras

printf 'ORAS_VERSION=%s\nORAS_BUILD_REVISION=%s\n' "$ORAS_VERSION" "$ORAS_BUILD_REVISION" |
  publish "$TMP" "$DIR" "$started" oras
trap - EXIT
echo "$SCRIPT: built in $(( $(date +%s) - started )) s, $(du -sh "$DIR" | cut -f1) in $DIR"
echo "$DIR/bin"
