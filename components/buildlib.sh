# What the build scripts (components/build.sh, components/containerd/build.sh, components/dra/build.sh, components/next/build.sh,
# components/cosign/build.sh, components/oras/build.sh, components/syft/build.sh, components/ociregistry/build.sh,
# components/helm/build.sh, and the Go tools' gen.sh) share: a cache directory per set of pins, built under a lock by one checkout at a time,
# into a temporary directory moved into place whole.
# Sourced, not run. Each script names itself in SCRIPT (for its messages) before using these.

# Every cache under one root (WEFT_CACHE_ROOT; an empty directory there makes every build start from nothing).
CACHE_ROOT="${WEFT_CACHE_ROOT:-/var/cache/weft}"

# The cache's lock: another checkout may be building the same pins right now (held until the script exits).
cache_lock() {
  mkdir -p "$1"
  exec 9>"$1/.build.lock"
  flock 9
}

# serve_cached DIR CACHE ARG: what every build script does before it builds. --bin-dir prints DIR's bin
# directory (built or not); --cached exits 0 if DIR is built, 1 if not; otherwise a DIR built already has its bin
# directory printed and the script ends, and one that is not has CACHE's lock taken (and is looked at again under
# it: another checkout may have finished it meanwhile) before the caller builds.
serve_cached() {
  local dir=$1 cache=$2 arg=${3:-}
  if [ "$arg" = "--bin-dir" ]; then
    echo "$dir/bin"
    exit 0
  fi
  if [ "$arg" = "--cached" ]; then
    [ -f "$dir/bin/.complete" ]
    exit
  fi
  if [ -f "$dir/bin/.complete" ]; then
    echo "$dir/bin"
    exit 0
  fi
  cache_lock "$cache"
  if [ -f "$dir/bin/.complete" ]; then
    echo "$dir/bin"
    exit 0
  fi
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

# One Go tool from its released module (the components named after it: cosign, oras, syft), the way each of
# their build.sh asks: NAME MODULE VERSION BUILD_REVISION PACKAGE LDFLAGS [--bin-dir|--cached]. Cached in
# $CACHE_ROOT/NAME/NAME-VERSION-<hash of versions.env, go.mod, go.sum, its .go files>/bin; prints that bin dir last.
build_go_tool() {
  local name="$1" module="$2" version="$3" revision="$4" package="$5" ldflags="$6" mode="${7:-}"
  local here script="components/$name/build.sh"
  here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$name"
  local hash cache dir have started tmp upper
  hash="$(cat "$here/versions.env" "$here/go.mod" "$here/go.sum" "$here"/*.go | sha256sum | cut -c1-12)"
  cache="$CACHE_ROOT/$name"
  dir="$cache/$name-$version-$hash"
  serve_cached "$dir" "$cache" "$mode"  # answers --bin-dir and --cached; exits if built
  need_go "$name"
  cd "$here"
  have="$(go list -m -f '{{.Version}}' "$module")"
  if [ "$have" != "$version" ]; then
    echo "$script: go.mod has $module $have, versions.env says $version (run components/$name/gen.sh)" >&2
    exit 1
  fi
  started=$(date +%s)
  tmp="$dir.tmp.$$"
  rm -rf "$tmp"
  mkdir -p "$tmp/bin"
  # shellcheck disable=SC2064 # the path now, not at exit
  trap "rm -rf '$tmp'" EXIT
  echo "$script: building $name $version into $dir"
  go build -trimpath -ldflags "$ldflags" -o "$tmp/bin/$name" "$package"
  upper="$(echo "$name" | tr '[:lower:]' '[:upper:]')"
  printf '%s_VERSION=%s\n%s_BUILD_REVISION=%s\n' "$upper" "$version" "$upper" "$revision" |
    publish "$tmp" "$dir" "$started" "$name"
  trap - EXIT
  echo "$script: built in $(( $(date +%s) - started )) s, $(du -sh "$dir" | cut -f1) in $dir"
  echo "$dir/bin"
}

# gen_go_tool NAME MODULE VERSION: a Go tool's gen.sh (needs the Go module proxy): components/NAME/go.mod and
# go.sum for a wrapper module requiring only MODULE at VERSION, so that the tool is built with exactly the
# dependency versions it was released with.
gen_go_tool() {
  local name="$1" module="$2" version="$3"
  cd "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$name"
  export GOTOOLCHAIN=local GOFLAGS=-mod=mod
  printf 'module weft.local/%s\n\ngo 1.25.0\n\nrequire %s %s\n' "$name" "$module" "$version" > go.mod
  rm -f go.sum
  go get "$module@$version"
  go mod tidy
  echo "gen.sh: go.mod and go.sum regenerated for $module $version"
}
