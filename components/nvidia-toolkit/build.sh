#!/usr/bin/env bash
# Builds NVIDIA's container toolkit at each line versions.env pins, once per set of pins, into a cache outside the
# checkout: ${WEFT_CACHE_ROOT:-/var/cache/weft}/nvidia-toolkit/nvidia-toolkit-<version>-<hash>/bin, where <hash>
# covers that line's pin, BUILD_REVISION and its wrapper module's go.mod, go.sum and tools.go.
#
#   nvidia-ctk                     `nvidia-ctk runtime configure`, as the GPU Operator's toolkit container runs it
#   nvidia-container-runtime       the runtime containerd's `nvidia` handler runs (its modes: legacy, cdi, auto)
#   nvidia-container-runtime-hook  the prestart hook the runtime adds in legacy mode
#   nvidia-toolkit (1.17), nvidia-ctk-installer (1.20)
#                                  the operator's installer: installs the toolkit, configures containerd, restarts it
#
# With cgo (go-nvml's bindings need it; built without, nvidia-ctk fails with "undefined: Return"), symbols
# stripped, the version set through -ldflags -X as the toolkit's Makefile does. libnvidia-container's
# nvidia-container-cli is C and no Go module: the tests stand in for it (they have no GPU).
#
# Usage: build.sh                   build every line not cached; prints the cache directory last
#        build.sh LINE              build LINE (1.17 or 1.20) if not cached; prints its bin directory last
#        build.sh --bin-dir [LINE]  print LINE's (or every line's, one a line) bin directory only (built or not)
#        build.sh --cached [LINE]   exit 0 if every line (or LINE) is built already, 1 if not (builds nothing)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=/dev/null
source "$HERE/versions.env"
# shellcheck source=../buildlib.sh
source "$HERE/../buildlib.sh"
SCRIPT=components/nvidia-toolkit/build.sh
CACHE="$CACHE_ROOT/nvidia-toolkit"
MODULE=github.com/NVIDIA/nvidia-container-toolkit
LINES=(1.17 1.20)

pin() {  # the version of a line
  case "$1" in
    1.17) echo "$NVIDIA_TOOLKIT_1_17_VERSION" ;;
    1.20) echo "$NVIDIA_TOOLKIT_1_20_VERSION" ;;
    *) echo "$SCRIPT: no toolkit line '$1' (want one of: ${LINES[*]})" >&2; return 1 ;;
  esac
}
installer() {  # the operator installer's package
  if [ "$1" = 1.17 ]; then echo "$MODULE/tools/container/nvidia-toolkit"; else echo "$MODULE/cmd/nvidia-ctk-installer"; fi
}
binaries() { echo nvidia-ctk nvidia-container-runtime nvidia-container-runtime-hook "$(basename "$(installer "$1")")"; }
dir() {  # the cache directory of a line
  local version hash
  version="$(pin "$1")"
  hash="$( { echo "$version"; grep '^BUILD_REVISION=' "$HERE/versions.env"; cat "$HERE/$1/go.mod" "$HERE/$1/go.sum" \
    "$HERE/$1/tools.go"; } | sha256sum | cut -c1-12)"
  echo "$CACHE/nvidia-toolkit-$version-$hash"
}
complete() { [ -f "$(dir "$1")/bin/.complete" ]; }
all_complete() { local l; for l in "${WANT[@]}"; do complete "$l" || return 1; done; }
last() { if [ -n "$ONE" ]; then echo "$(dir "$ONE")/bin"; else echo "$CACHE"; fi; }

ONE=""
case "${1:-}" in
  --bin-dir)
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
need_go "NVIDIA's container toolkit"
export CGO_ENABLED=1
command -v gcc >/dev/null || { echo "$SCRIPT: the toolkit needs a C compiler (cgo): apt-get install gcc" >&2; exit 1; }

build_line() {
  local line=$1 version DIR TMP started ldflags b
  version="$(pin "$line")"
  DIR="$(dir "$line")"
  have="$(cd "$HERE/$line" && go list -m -f '{{.Version}}' "$MODULE")"
  if [ "$have" != "$version" ]; then
    echo "$SCRIPT: $line/go.mod has $MODULE $have, versions.env says $version (run components/nvidia-toolkit/gen.sh)" >&2
    exit 1
  fi
  started=$(date +%s)
  TMP="$DIR.tmp.$$"
  rm -rf "$TMP"
  mkdir -p "$TMP/bin"
  trap 'rm -rf "$TMP"' EXIT
  echo "$SCRIPT: building the NVIDIA container toolkit $version into $DIR"
  ldflags="-s -w -X $MODULE/internal/info.version=${version#v} -X $MODULE/internal/info.gitCommit=$version"
  cd "$HERE/$line"
  go build -ldflags "$ldflags" -o "$TMP/bin/" "$MODULE/cmd/nvidia-ctk" "$MODULE/cmd/nvidia-container-runtime" \
    "$MODULE/cmd/nvidia-container-runtime-hook" "$(installer "$line")"
  # shellcheck disable=SC2046
  { echo "NVIDIA_TOOLKIT_VERSION=$version"; grep '^BUILD_REVISION=' "$HERE/versions.env"; } |
    publish "$TMP" "$DIR" "$started" $(binaries "$line")
  trap - EXIT
  echo "$SCRIPT: the NVIDIA container toolkit $version built in $(( $(date +%s) - started )) s," \
    "$(du -sh "$DIR" | cut -f1) in $DIR"
}
for line in "${WANT[@]}"; do
  complete "$line" || build_line "$line"
done
last
