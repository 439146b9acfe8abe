# What kube/build.sh, kube/containerd/build.sh and kube/dra/build.sh share: a cache directory per set of
# pins, built under a lock by one checkout at a time, into a temporary directory moved into place whole.
# Sourced, not run. Each script names itself in SCRIPT (for its messages) before using these.

# The cache's lock: another checkout may be building the same pins right now (held until the script exits).
cache_lock() {
  mkdir -p "$1"
  exec 9>"$1/.build.lock"
  flock 9
}

# Go on PATH, or a clear error naming what it is needed for; then the settings every build uses.
need_go() {
  [ -x /usr/local/go/bin/go ] && PATH="$PATH:/usr/local/go/bin"
  if ! command -v go >/dev/null; then
    echo "$SCRIPT: Go is needed to build $1" >&2
    exit 1
  fi
  export GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0
}

# The -ldflags of a Kubernetes binary of release $1: symbols stripped, --version set as its Makefile does.
kube_ldflags() {
  local kv=$1 minor major build_date out="-s -w" pkg
  minor="${kv#v*.}"; minor="${minor%%.*}"
  major="${kv#v}"; major="${major%%.*}"
  build_date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    out+=" -X $pkg.gitVersion=$kv -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    out+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
  done
  echo "$out"
}

# publish TMP DIR STARTED BINARY...: every binary built, the build's versions (stdin) written beside them,
# then TMP moved to DIR whole, marked complete: a reader never sees half a build.
publish() {
  local tmp=$1 dir=$2 started=$3 b
  shift 3
  for b in "$@"; do
    [ -x "$tmp/bin/$b" ] || { echo "$SCRIPT: $b was not built" >&2; exit 1; }
  done
  { cat; echo "GO_VERSION=$(go env GOVERSION)"; echo "BUILD_SECONDS=$(( $(date +%s) - started ))"; } > "$tmp/versions"
  touch "$tmp/bin/.complete"
  rm -rf "$dir"
  mv "$tmp" "$dir"
}
