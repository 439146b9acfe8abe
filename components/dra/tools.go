//go:build tools

// Package dra names what weft's DRA tests build beside the Kubernetes components of ../: the
// controller-manager (its resourceclaim controller makes claims from ResourceClaimTemplates) at
// the same Kubernetes release, and the test DRA driver in gpudriver/. build.sh builds them.
package dra

import (
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
)
