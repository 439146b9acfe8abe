#!/usr/bin/env bash
# Builds the containerd releases weft's integration tests run beside Debian's 1.6 (pins in versions.env),
# once per set of pins, into a cache outside the checkout:
# ${WEFT_CACHE_ROOT:-/var/cache/weft}/containerd/containerd-<version>-<hash>/bin, where <hash>
# covers that release's pin, BUILD_REVISION and its wrapper module's go.mod and go.sum, so a new 2.x
# pin leaves the 1.7 build where it is. Clones and later runs on the same machine build nothing.
#
#   2     containerd, containerd-shim-runc-v2   github.com/containerd/containerd/v2  (2/)
#   1.7   containerd, containerd-shim-runc-v2   github.com/containerd/containerd     (1.7/)
#   2.0, 2.1, 2.2, 2.3                          github.com/containerd/containerd/v2  (2.0/ ... 2.3/)
#         the newest patch of each other 2.x line, for the installer's tests (config default, --version)
#
# Static (CGO_ENABLED=0, so the netgo/osusergo paths), without the snapshotters only cgo or the CRI
# tests never use would bring (btrfs needs cgo; devmapper, zfs, aufs are left out with their tags),
# symbols stripped, and --version set through -ldflags -X as containerd's Makefile does. runc stays
# Debian's.
#
# Usage: build.sh                   build every line not cached; prints the cache directory last
#        build.sh LINE              build LINE (2, 1.7, 2.0, ...) if not cached; prints its bin directory last
#        build.sh --bin-dir [LINE]  print LINE's (or every line's, one a line) bin directory only (built or not)
#        build.sh --cached [LINE]   exit 0 if every line (or LINE) is built already, 1 if not (builds nothing)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=/dev/null
source "$HERE/versions.env"
# shellcheck source=../buildlib.sh
source "$HERE/../buildlib.sh"
SCRIPT=components/containerd/build.sh
CACHE="$CACHE_ROOT/containerd"
LINES=(2 1.7 2.0 2.1 2.2 2.3)
BINARIES=(containerd containerd-shim-runc-v2)
TAGS="no_btrfs no_devmapper no_zfs no_aufs urfave_cli_no_docs"

pin() {  # the version of a line
  case "$1" in
    2) echo "$CONTAINERD_2_VERSION" ;;
    1.7) echo "$CONTAINERD_1_7_VERSION" ;;
    2.0) echo "$CONTAINERD_2_0_VERSION" ;;
    2.1) echo "$CONTAINERD_2_1_VERSION" ;;
    2.2) echo "$CONTAINERD_2_2_VERSION" ;;
    2.3) echo "$CONTAINERD_2_3_VERSION" ;;
    *) echo "build.sh: no containerd line '$1' (want one of: ${LINES[*]})" >&2; return 1 ;;
  esac
}
module() { if [ "$1" = 1.7 ]; then echo github.com/containerd/containerd; else echo github.com/containerd/containerd/v2; fi; }
dir() {  # the cache directory of a line
  local version hash
  version="$(pin "$1")"
  hash="$( { echo "$version"; grep '^BUILD_REVISION=' "$HERE/versions.env"; cat "$HERE/$1/go.mod" "$HERE/$1/go.sum"; } |
    sha256sum | cut -c1-12)"
  echo "$CACHE/containerd-$version-$hash"
}
complete() { [ -f "$(dir "$1")/bin/.complete" ]; }
all_complete() { local l; for l in "${WANT[@]}"; do complete "$l" || return 1; done; }
last() { if [ -n "$ONE" ]; then echo "$(dir "$ONE")/bin"; else echo "$CACHE"; fi; }

ONE=""
case "${1:-}" in
  --bin-dir)  # LINE's, or every line's, one a line
    if [ -n "${2:-}" ]; then pin "$2" >/dev/null; echo "$(dir "$2")/bin"; exit 0; fi
    for l in "${LINES[@]}"; do echo "$(dir "$l")/bin"; done
    exit 0 ;;
  --cached) ONE="${2:-}" ;;
  "") ;;
  *) ONE="$1" ;;
esac
if [ -n "$ONE" ]; then pin "$ONE" >/dev/null; WANT=("$ONE"); else WANT=("${LINES[@]}"); fi
if [ "${1:-}" = --cached ]; then  # builds nothing
  all_complete
  exit
fi
if all_complete; then
  last
  exit 0
fi

cache_lock "$CACHE"
need_go "containerd (Go >= the go line of 2/go.mod on PATH)"

build_line() {
  local line=$1 version mod DIR TMP started ldflags
  version="$(pin "$line")"
  mod="$(module "$line")"
  DIR="$(dir "$line")"
  # The module must say what versions.env says (gen.sh makes it so).
  have="$(cd "$HERE/$line" && go list -m -f '{{.Version}}' "$mod")"
  if [ "$have" != "$version" ]; then
    echo "components/containerd/build.sh: $line/go.mod has $mod $have, versions.env says $version (run components/containerd/gen.sh)" >&2
    exit 1
  fi
  started=$(date +%s)
  TMP="$DIR.tmp.$$"
  rm -rf "$TMP"
  mkdir -p "$TMP/bin"
  trap 'rm -rf "$TMP"' EXIT
  echo "components/containerd/build.sh: building containerd $version into $DIR"
  ldflags="-s -w -X $mod/version.Version=$version -X $mod/version.Revision=$version -X $mod/version.Package=$mod"
  cd "$HERE/$line"
  go build -tags "$TAGS" -ldflags "$ldflags" -o "$TMP/bin/" "$mod/cmd/containerd" "$mod/cmd/containerd-shim-runc-v2"
  { echo "CONTAINERD_VERSION=$version"; grep '^BUILD_REVISION=' "$HERE/versions.env"; } |
    publish "$TMP" "$DIR" "$started" "${BINARIES[@]}"
  trap - EXIT
  echo "components/containerd/build.sh: containerd $version built in $(( $(date +%s) - started )) s, $(du -sh "$DIR" | cut -f1) in $DIR"
}
for line in "${WANT[@]}"; do
  complete "$line" || build_line "$line"
done
last
