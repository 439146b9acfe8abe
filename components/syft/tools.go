//go:build tools

// Package syft names Anchore's syft command (github.com/anchore/syft's cmd/syft), which writes the node image's
// CycloneDX SBOM (nodeimage/build/sbom.py), so that go.mod and go.sum pin every module it is built from. build.sh
// builds it; nothing imports this.
package syft

import (
	_ "github.com/anchore/syft/cmd/syft"
)
