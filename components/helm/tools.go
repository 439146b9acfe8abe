//go:build tools

// Package helm names the helm command (helm.sh/helm/v4) so that go.mod and go.sum pin it with Helm's own
// dependency versions; build.sh builds it. Nothing imports this.
package helm

import (
	_ "helm.sh/helm/v4/cmd/helm"
)
