#!/usr/bin/env bash
# Regenerates go.mod and go.sum from versions.env (needs the Go module proxy): a wrapper module requiring only
# $OCIREGISTRY_MODULE, so that the registry is built with exactly the dependency versions that release was made with.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$HERE/versions.env"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod
cd "$HERE"
printf 'module weft.local/ociregistry\n\ngo 1.25.0\n\nrequire %s %s\n' "$OCIREGISTRY_MODULE" "$OCIREGISTRY_VERSION" > go.mod
rm -f go.sum
go get "$OCIREGISTRY_MODULE@$OCIREGISTRY_VERSION"
go mod tidy
echo "gen.sh: go.mod and go.sum regenerated for $OCIREGISTRY_MODULE $OCIREGISTRY_VERSION"
