#!/usr/bin/env bash
# Regenerates the wrapper modules' go.mod and go.sum from versions.env (needs the Go module proxy).
#
# One wrapper module per release line (2/ and 1.7/; 2.0/ to 2.3/ for the installer's tests), each
# requiring only that containerd module, so that containerd and its runc shim are built with exactly the dependency versions it was released
# with (go mod tidy keeps them: the wrapper adds nothing of its own). tools.go names the commands.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=/dev/null
source "$HERE/versions.env"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod

gen() {  # line module version
  local line=$1 module=$2 version=$3 name
  name="weft.local/containerd/${line//./}"
  cd "$HERE/$line"
  printf 'module %s\n\ngo 1.24.0\n\nrequire %s %s\n' "$name" "$module" "$version" > go.mod
  rm -f go.sum
  go get "$module@$version"  # raises the go line to what containerd asks for
  go mod tidy
}
gen 2 github.com/containerd/containerd/v2 "$CONTAINERD_2_VERSION"
gen 1.7 github.com/containerd/containerd "$CONTAINERD_1_7_VERSION"
for line in 2.0 2.1 2.2 2.3; do  # tools.go of these is written by hand, as 2/'s is
  var="CONTAINERD_${line//./_}_VERSION"
  gen "$line" github.com/containerd/containerd/v2 "${!var}"
done
echo "gen.sh: go.mod and go.sum regenerated for containerd $CONTAINERD_2_VERSION, $CONTAINERD_1_7_VERSION," \
  "$CONTAINERD_2_0_VERSION, $CONTAINERD_2_1_VERSION, $CONTAINERD_2_2_VERSION and $CONTAINERD_2_3_VERSION"
