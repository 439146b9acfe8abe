#!/usr/bin/env bash
# Builds Kueue's controller manager (sigs.k8s.io/kueue's cmd/kueue) and copies its CRDs from the same module, once
# per set of pins, into a cache of its own: ${WEFT_CACHE_ROOT:-/var/cache/weft}/kueue/<key>/bin (the manager, and
# crds/ with the CustomResourceDefinitions the tests apply), where <key> is Kueue's version and a hash of this
# directory's go.mod, go.sum and tools.go. Its own module: Kueue pins its k8s.io libraries apart from the
# Kubernetes release components/build.sh builds.
#
# Static (CGO_ENABLED=0), symbols stripped, its version set through -ldflags -X as Kueue's Makefile does.
#
# Usage: components/kueue/build.sh             build if not cached; prints the bin directory last
#        components/kueue/build.sh --bin-dir   print the bin directory only (built or not)
#        components/kueue/build.sh --cached    exit 0 if it is built already, 1 if not (builds nothing)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../buildlib.sh
source "$HERE/../buildlib.sh"
SCRIPT=components/kueue/build.sh
KUEUE_VERSION=v0.17.0
# Bumped when this script builds differently (flags, files): part of the cache key.
KUEUE_BUILD_REVISION=1

hash="$( { cat "$HERE/go.mod" "$HERE/go.sum" "$HERE/tools.go"; echo "KUEUE_BUILD_REVISION=$KUEUE_BUILD_REVISION"; } |
  sha256sum | cut -c1-12)"
CACHE="$CACHE_ROOT/kueue"
DIR="$CACHE/kueue-$KUEUE_VERSION-$hash"

serve_cached "$DIR" "$CACHE" "${1:-}"  # answers --bin-dir and --cached; exits if built
need_go "Kueue's controller manager"

cd "$HERE"
have="$(go list -m -f '{{.Version}}' sigs.k8s.io/kueue)"
if [ "$have" != "$KUEUE_VERSION" ]; then
  echo "$SCRIPT: go.mod has sigs.k8s.io/kueue $have, this script pins $KUEUE_VERSION (run components/kueue/gen.sh)" >&2
  exit 1
fi
started=$(date +%s)
TMP="$DIR.tmp.$$"
rm -rf "$TMP"
mkdir -p "$TMP/bin/crds"
trap 'rm -rf "$TMP"' EXIT
echo "$SCRIPT: building Kueue $KUEUE_VERSION into $DIR"
go build -trimpath -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION" \
  -o "$TMP/bin/kueue" sigs.k8s.io/kueue/cmd/kueue
module_dir="$(go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)"
cp "$module_dir"/config/components/crd/bases/*.yaml "$TMP/bin/crds/"
chmod 0644 "$TMP"/bin/crds/*.yaml

printf 'KUEUE_VERSION=%s\nKUEUE_BUILD_REVISION=%s\n' "$KUEUE_VERSION" "$KUEUE_BUILD_REVISION" |
  publish "$TMP" "$DIR" "$started" kueue
trap - EXIT
echo "$SCRIPT: built in $(( $(date +%s) - started )) s, $(du -sh "$DIR" | cut -f1) in $DIR"
echo "$DIR/bin"
