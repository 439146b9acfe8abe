#!/usr/bin/env bash
# Builds the Kubernetes components that weft's integration tests run, once per set of pins, into a
# cache outside the checkout: ${WEFT_CACHE_ROOT:-/var/cache/weft}/kube/<key>/bin, where <key> is the
# Kubernetes version and a hash of versions.env and the wrapper modules' go.mod and go.sum. Clones and
# later runs on the same machine find it there and build nothing.
#
#   kubelet, kube-apiserver, kube-scheduler, kubectl   k8s.io/kubernetes   (this directory's module)
#   etcd                                                go.etcd.io/etcd/server/v3 (same module)
#   crictl, critest                                     sigs.k8s.io/cri-tools (critools/, its own deps)
#
# All static (CGO_ENABLED=0), cloud providers left out (-tags providerless), symbols stripped
# (-s -w: a quicker link), and each binary's --version set through -ldflags -X.
#
# Usage: components/build.sh             build if not cached; prints the bin directory last
#        components/build.sh --bin-dir   print the bin directory only (built or not)
#        components/build.sh --cached    exit 0 if it is built already, 1 if not (builds nothing)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=/dev/null
source "$HERE/versions.env"
# shellcheck source=buildlib.sh
source "$HERE/buildlib.sh"
SCRIPT=components/build.sh

key_files=("$HERE/versions.env" "$HERE/go.mod" "$HERE/go.sum" "$HERE/critools/go.mod" "$HERE/critools/go.sum")
hash="$(cat "${key_files[@]}" | sha256sum | cut -c1-12)"
CACHE="$CACHE_ROOT/kube"
DIR="$CACHE/k8s-$KUBERNETES_VERSION-$hash"
BINARIES=(kubelet kube-apiserver kube-scheduler kubectl etcd crictl critest)

serve_cached "$DIR" "$CACHE" "${1:-}"  # answers --bin-dir and --cached; exits if built
need_go "the Kubernetes components (apt-get install golang-go, or Go >= 1.24 on PATH)"

# The modules must say what versions.env says (gen.sh makes them so).
check_pins() {
  python3 - "$@" <<'PY'
import json, subprocess, sys
mod, want = sys.argv[1], dict(a.split("=", 1) for a in sys.argv[2:])
edit = json.loads(subprocess.run(["go", "mod", "edit", "-json", mod], check=True, capture_output=True, text=True).stdout)
req = {r["Path"]: r["Version"] for r in edit.get("Require") or []}
bad = [f"{p} is {req.get(p)}, versions.env says {v}" for p, v in want.items() if not p.startswith("replace:") and req.get(p) != v]
staging = want.get("replace:k8s.io")
for r in edit.get("Replace") or []:
    if staging and r["Old"]["Path"].startswith("k8s.io/") and r["New"].get("Version") != staging:
        bad.append(f"{r['Old']['Path']} is replaced by {r['New']}, versions.env says {staging}")
if bad:
    sys.exit(f"components/build.sh: {mod} disagrees with versions.env (run components/gen.sh):\n  " + "\n  ".join(bad))
PY
}
check_pins "$HERE/go.mod" "k8s.io/kubernetes=$KUBERNETES_VERSION" "go.etcd.io/etcd/server/v3=$ETCD_VERSION" \
  "replace:k8s.io=$KUBERNETES_STAGING_VERSION"
check_pins "$HERE/critools/go.mod" "sigs.k8s.io/cri-tools=$CRI_TOOLS_VERSION"

started=$(date +%s)
TMP="$DIR.tmp.$$"
rm -rf "$TMP"
mkdir -p "$TMP/bin"
trap 'rm -rf "$TMP"' EXIT
echo "components/build.sh: building ${BINARIES[*]} into $DIR (a cold build takes several minutes)"

cd "$HERE"
go build -tags providerless -ldflags "$(kube_ldflags "$KUBERNETES_VERSION")" -o "$TMP/bin/" \
  k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kubectl
go build -ldflags "-s -w" -o "$TMP/bin/etcd" go.etcd.io/etcd/server/v3

cd "$HERE/critools"
cri_ldflags="-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=${CRI_TOOLS_VERSION#v}"
go build -ldflags "$cri_ldflags" -o "$TMP/bin/crictl" sigs.k8s.io/cri-tools/cmd/crictl
# critest is cri-tools' ginkgo suite compiled as a test binary, as its Makefile does.
go test -c -ldflags "$cri_ldflags" -o "$TMP/bin/critest" sigs.k8s.io/cri-tools/cmd/critest

grep -E '^[A-Z_]+=' "$HERE/versions.env" | publish "$TMP" "$DIR" "$started" "${BINARIES[@]}"
trap - EXIT
echo "components/build.sh: built in $(( $(date +%s) - started )) s, $(du -sh "$DIR" | cut -f1) in $DIR"
echo "$DIR/bin"
