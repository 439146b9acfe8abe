//go:build tools

// Package next names the Kubernetes components of the newest release that the smoke subset runs, so that
// go.mod and go.sum pin every module they are built from. build.sh builds them; nothing imports this.
package next

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
