#!/usr/bin/env bash
# Builds what weft's DRA tests run beside the Kubernetes components of components/build.sh, once per set of
# pins, into a cache of its own: ${WEFT_CACHE_ROOT:-/var/cache/weft}/dra/<key>/bin, where <key> is the
# Kubernetes version and a hash of ../versions.env and this directory's go.mod, go.sum and sources.
# A key of its own, so that a change here never rebuilds components/build.sh's set (nor the reverse).
#
#   kube-controller-manager   k8s.io/kubernetes at ../versions.env's release (its resourceclaim controller)
#   weft-test-dra-driver      gpudriver/: simulated GPUs as a ResourceSlice, a CDI spec per prepared claim
#
# Static (CGO_ENABLED=0), -tags providerless, symbols stripped, --version set through -ldflags -X, as
# components/build.sh builds; Go's build cache is shared with it, so most packages are compiled already.
#
# Usage: components/dra/build.sh             build if not cached; prints the bin directory last
#        components/dra/build.sh --bin-dir   print the bin directory only (built or not)
#        components/dra/build.sh --cached    exit 0 if it is built already, 1 if not (builds nothing)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=/dev/null
source "$HERE/../versions.env"
# shellcheck source=../buildlib.sh
source "$HERE/../buildlib.sh"
SCRIPT=components/dra/build.sh
# Bumped when this script builds differently (flags, binaries): part of the cache key.
DRA_BUILD_REVISION=1

key_files=("$HERE/../versions.env" "$HERE/go.mod" "$HERE/go.sum" "$HERE/tools.go" "$HERE/gpudriver/main.go")
hash="$( { cat "${key_files[@]}"; echo "DRA_BUILD_REVISION=$DRA_BUILD_REVISION"; } | sha256sum | cut -c1-12)"
CACHE="$CACHE_ROOT/dra"
DIR="$CACHE/dra-$KUBERNETES_VERSION-$hash"
BINARIES=(kube-controller-manager weft-test-dra-driver)

serve_cached "$DIR" "$CACHE" "${1:-}"  # answers --bin-dir and --cached; exits if built
need_go "kube-controller-manager and the test DRA driver"

# The module must build the release ../versions.env pins, with its staging modules at theirs.
python3 - "$HERE/go.mod" "$KUBERNETES_VERSION" "$KUBERNETES_STAGING_VERSION" <<'PY'
import json, subprocess, sys
mod, kube, staging = sys.argv[1:]
edit = json.loads(subprocess.run(["go", "mod", "edit", "-json", mod], check=True, capture_output=True, text=True).stdout)
req = {r["Path"]: r["Version"] for r in edit.get("Require") or []}
bad = [] if req.get("k8s.io/kubernetes") == kube else [f"k8s.io/kubernetes is {req.get('k8s.io/kubernetes')}, versions.env says {kube}"]
bad += [f"{r['Old']['Path']} is replaced by {r['New']}, versions.env says {staging}" for r in edit.get("Replace") or []
        if r["Old"]["Path"].startswith("k8s.io/") and r["New"].get("Version") != staging]
if bad:
    sys.exit(f"components/dra/build.sh: {mod} disagrees with components/versions.env (copy components/go.mod's requires and replaces, "
             "then go mod tidy):\n  " + "\n  ".join(bad))
PY

started=$(date +%s)
TMP="$DIR.tmp.$$"
rm -rf "$TMP"
mkdir -p "$TMP/bin"
trap 'rm -rf "$TMP"' EXIT
echo "components/dra/build.sh: building ${BINARIES[*]} into $DIR"

ldflags="$(kube_ldflags "$KUBERNETES_VERSION")"
cd "$HERE"
go build -tags providerless -ldflags "$ldflags" -o "$TMP/bin/" k8s.io/kubernetes/cmd/kube-controller-manager
go build -ldflags "$ldflags" -o "$TMP/bin/weft-test-dra-driver" ./gpudriver

printf 'KUBERNETES_VERSION=%s\nDRA_BUILD_REVISION=%s\n' "$KUBERNETES_VERSION" "$DRA_BUILD_REVISION" |
  publish "$TMP" "$DIR" "$started" "${BINARIES[@]}"
trap - EXIT
echo "components/dra/build.sh: built in $(( $(date +%s) - started )) s, $(du -sh "$DIR" | cut -f1) in $DIR"
echo "$DIR/bin"
