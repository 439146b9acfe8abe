#!/usr/bin/env bash
# Builds Helm (helm.sh/helm/v4's cmd/helm, at go.mod's version) for the chart's tests (charts/weft), once per
# set of pins, into a cache of its own: ${WEFT_CACHE_ROOT:-/var/cache/weft}/helm/<key>/bin, where <key> is
# Helm's version and a hash of this directory's go.mod, go.sum and tools.go.
#
# Static (CGO_ENABLED=0), symbols stripped, `helm version` set through -ldflags -X as Helm's Makefile does.
#
# Usage: components/helm/build.sh             build if not cached; prints the bin directory last
#        components/helm/build.sh --bin-dir   print the bin directory only (built or not)
#        components/helm/build.sh --cached    exit 0 if it is built already, 1 if not (builds nothing)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../buildlib.sh
source "$HERE/../buildlib.sh"
SCRIPT=components/helm/build.sh
# Bumped when this script builds differently (flags, binaries): part of the cache key.
HELM_BUILD_REVISION=1

HELM_VERSION="$(sed -n 's|^require helm.sh/helm/v4 \(v[^ ]*\)$|\1|p; s|^[[:space:]]*helm.sh/helm/v4 \(v[^ ]*\)$|\1|p' \
  "$HERE/go.mod" | head -n 1)"
[ -n "$HELM_VERSION" ] || { echo "$SCRIPT: $HERE/go.mod does not require helm.sh/helm/v4" >&2; exit 1; }
key_files=("$HERE/go.mod" "$HERE/go.sum" "$HERE/tools.go")
hash="$( { cat "${key_files[@]}"; echo "HELM_BUILD_REVISION=$HELM_BUILD_REVISION"; } | sha256sum | cut -c1-12)"
CACHE="$CACHE_ROOT/helm"
DIR="$CACHE/helm-$HELM_VERSION-$hash"

serve_cached "$DIR" "$CACHE" "${1:-}"  # answers --bin-dir and --cached; exits if built
need_go "helm"

started=$(date +%s)
TMP="$DIR.tmp.$$"
rm -rf "$TMP"
mkdir -p "$TMP/bin"
trap 'rm -rf "$TMP"' EXIT
echo "$SCRIPT: building helm $HELM_VERSION into $DIR"
cd "$HERE"
go build -trimpath -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION \
-X helm.sh/helm/v4/internal/version.gitTreeState=clean" -o "$TMP/bin/helm" helm.sh/helm/v4/cmd/helm

printf 'HELM_VERSION=%s\nHELM_BUILD_REVISION=%s\n' "$HELM_VERSION" "$HELM_BUILD_REVISION" |
  publish "$TMP" "$DIR" "$started" helm
trap - EXIT
echo "$SCRIPT: built in $(( $(date +%s) - started )) s, $(du -sh "$DIR" | cut -f1) in $DIR"
echo "$DIR/bin"
