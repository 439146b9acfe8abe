//go:build tools

// Package kueue names Kueue's controller manager, which weft's tests run beneath (integration/kube/test_kube_kueue.py),
// so that go.mod and go.sum pin every module it is built from. build.sh builds it; nothing imports this.
package kueue

import (
	_ "sigs.k8s.io/kueue/cmd/kueue"
)
