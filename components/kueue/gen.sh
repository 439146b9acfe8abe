#!/usr/bin/env bash
# Regenerates go.mod and go.sum from the pin in build.sh's KUEUE_VERSION (needs the Go module proxy): a wrapper
# module requiring only Kueue, so its manager is built with exactly the dependency versions it was released with.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VERSION="$(sed -n 's/^KUEUE_VERSION=//p' "$HERE/build.sh")"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod
cd "$HERE"
printf 'module weft.local/kueue\n\ngo 1.25.0\n\nrequire sigs.k8s.io/kueue %s\n' "$VERSION" > go.mod
rm -f go.sum
go get "sigs.k8s.io/kueue@$VERSION"
go mod tidy
echo "gen.sh: go.mod and go.sum regenerated for Kueue $VERSION"
