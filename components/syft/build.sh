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

hash="$(cat "$HERE/versions.env" "$HERE/go.mod" "$HERE/go.sum" "$HERE/tools.go" | sha256sum | cut -c1-12)"
CACHE="$CACHE_ROOT/syft"
DIR="$CACHE/syft-$SYFT_VERSION-$hash"

serve_cached "$DIR" "$CACHE" "${1:-}"  # answers --bin-dir and --cached; exits if built
need_go "syft"

cd "$HERE"
have="$(go list -m -f '{{.Version}}' "$SYFT_MODULE")"
if [ "$have" != "$SYFT_VERSION" ]; then
  echo "$SCRIPT: go.mod has $SYFT_MODULE $have, versions.env says $SYFT_VERSION (run components/syft/gen.sh)" >&2
  exit 1
fi
started=$(date +%s)
TMP="$DIR.tmp.$$"
rm -rf "$TMP"
mkdir -p "$TMP/bin"
trap 'rm -rf "$TMP"' EXIT
echo "$SCRIPT: building syft $SYFT_VERSION into $DIR"
go build -trimpath -ldflags "-s -w -X main.version=${SYFT_VERSION#v} -X main.gitDescription=${SYFT_VERSION}" -o "$TMP/bin/syft" github.com/anchore/syft/cmd/syft

printf 'SYFT_VERSION=%s\nSYFT_BUILD_REVISION=%s\n' "$SYFT_VERSION" "$SYFT_BUILD_REVISION" |
  publish "$TMP" "$DIR" "$started" syft
trap - EXIT
echo "$SCRIPT: built in $(( $(date +%s) - started )) s, $(du -sh "$DIR" | cut -f1) in $DIR"
echo "$DIR/bin"
