#!/usr/bin/env bash
# Regenerates the wrapper modules' go.mod and go.sum from versions.env (needs the Go module proxy).
#
# One wrapper module per toolkit line (1.17/ and 1.20/), each requiring only the toolkit's module at its pin, so
# that its commands are built with exactly the dependency versions it was released with. tools.go names them.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=/dev/null
source "$HERE/versions.env"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod
MODULE=github.com/NVIDIA/nvidia-container-toolkit

gen() {  # line version
  local line=$1 version=$2
  cd "$HERE/$line"
  printf 'module weft.local/nvidia-toolkit/%s\n\ngo 1.24.0\n\nrequire %s %s\n' "${line//./}" "$MODULE" "$version" > go.mod
  rm -f go.sum
  go get "$MODULE@$version"  # pinned: without @version the whole module moves to its newest release
  go mod tidy
}
gen 1.17 "$NVIDIA_TOOLKIT_1_17_VERSION"
gen 1.20 "$NVIDIA_TOOLKIT_1_20_VERSION"
echo "gen.sh: go.mod and go.sum regenerated for the NVIDIA container toolkit $NVIDIA_TOOLKIT_1_17_VERSION and" \
  "$NVIDIA_TOOLKIT_1_20_VERSION"
