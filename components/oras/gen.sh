#!/usr/bin/env bash
# Regenerates go.mod and go.sum from versions.env (needs the Go module proxy): a wrapper module requiring only
# $ORAS_MODULE, so that oras is built with exactly the dependency versions it was released with.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$HERE/versions.env"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod
cd "$HERE"
printf 'module weft.local/oras\n\ngo 1.25.0\n\nrequire %s %s\n' "$ORAS_MODULE" "$ORAS_VERSION" > go.mod
rm -f go.sum
go get "$ORAS_MODULE@$ORAS_VERSION"
go mod tidy
echo "gen.sh: go.mod and go.sum regenerated for $ORAS_MODULE $ORAS_VERSION"
