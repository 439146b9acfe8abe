//go:build tools

// Package critools names crictl and critest (sigs.k8s.io/cri-tools) so that go.mod and go.sum pin
// them with cri-tools' own dependency versions; ../build.sh builds them. Nothing imports this.
package critools

import (
	_ "sigs.k8s.io/cri-tools/cmd/crictl"
	_ "sigs.k8s.io/cri-tools/cmd/critest"
)
