//go:build tools

// Package cosign names sigstore's cosign command (github.com/sigstore/cosign/v2's cmd/cosign), with which the
// supply-chain tests sign the node image and its SBOM and verify them (integration/install/
// test_image_supply_chain.py), so that go.mod and go.sum pin every module it is built from. build.sh builds it;
// nothing imports this.
package cosign

import (
	_ "github.com/sigstore/cosign/v2/cmd/cosign"
)
