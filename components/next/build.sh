#!/usr/bin/env bash
# Builds kubelet, kube-apiserver, kube-scheduler and kubectl of the newest release (versions.env here), once
# per set of pins, into ${WEFT_CACHE_ROOT:-/var/cache/weft}/kube/<key>/bin as ../build.sh does for the pinned
# release (same flags: static, providerless, stripped, --version set). The smoke subset runs them with the
# pinned set's etcd, crictl and critest (harness/binaries.py, WEFT_KUBE=next).
#
# Usage: components/next/build.sh             build if not cached; prints the bin directory last
#        components/next/build.sh --bin-dir   print the bin directory only (built or not)
#        components/next/build.sh --cached    exit 0 if it is built already, 1 if not (builds nothing)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=/dev/null
source "$HERE/versions.env"
# shellcheck source=../buildlib.sh
source "$HERE/../buildlib.sh"
SCRIPT=components/next/build.sh

hash="$(cat "$HERE/versions.env" "$HERE/go.mod" "$HERE/go.sum" | sha256sum | cut -c1-12)"
CACHE="$CACHE_ROOT/kube"
DIR="$CACHE/k8s-$KUBERNETES_VERSION-$hash"
BINARIES=(kubelet kube-apiserver kube-scheduler kubectl)

serve_cached "$DIR" "$CACHE" "${1:-}"  # answers --bin-dir and --cached; exits if built
need_go "the newest Kubernetes components (apt-get install golang-go, or Go >= 1.24 on PATH)"

# The module must say what versions.env says (gen.sh makes it so).
python3 - "$HERE/go.mod" "$KUBERNETES_VERSION" "$KUBERNETES_STAGING_VERSION" <<'PY'
import json, subprocess, sys
mod, version, staging = sys.argv[1:]
edit = json.loads(subprocess.run(["go", "mod", "edit", "-json", mod], check=True, capture_output=True, text=True).stdout)
req = {r["Path"]: r["Version"] for r in edit.get("Require") or []}
bad = [] if req.get("k8s.io/kubernetes") == version else [f"k8s.io/kubernetes is {req.get('k8s.io/kubernetes')}, versions.env says {version}"]
bad += [f"{r['Old']['Path']} is replaced by {r['New']}, versions.env says {staging}" for r in edit.get("Replace") or []
        if r["Old"]["Path"].startswith("k8s.io/") and r["New"].get("Version") != staging]
if bad:
    sys.exit(f"components/next/build.sh: {mod} disagrees with versions.env (run components/next/gen.sh):\n  " + "\n  ".join(bad))
PY

started=$(date +%s)
TMP="$DIR.tmp.$$"
rm -rf "$TMP"
mkdir -p "$TMP/bin"
trap 'rm -rf "$TMP"' EXIT
echo "components/next/build.sh: building ${BINARIES[*]} $KUBERNETES_VERSION into $DIR (a cold build takes several minutes)"
cd "$HERE"
go build -tags providerless -ldflags "$(kube_ldflags "$KUBERNETES_VERSION")" -o "$TMP/bin/" \
  k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kubectl
grep -E '^[A-Z_]+=' "$HERE/versions.env" | publish "$TMP" "$DIR" "$started" "${BINARIES[@]}"
trap - EXIT
echo "components/next/build.sh: built in $(( $(date +%s) - started )) s, $(du -sh "$DIR" | cut -f1) in $DIR"
echo "$DIR/bin"
