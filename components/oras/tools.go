//go:build tools

// Package oras names the ORAS command (oras.land/oras's cmd/oras), with which the supply-chain tests attach the
// node image's SBOM to the image in a registry as an artifact that refers to it, and read it back, so that go.mod
// and go.sum pin every module it is built from. build.sh builds it; nothing imports this.
package oras

import (
	_ "oras.land/oras/cmd/oras"
)
