//go:build tools

// Package kube names the Kubernetes components that weft's integration tests run, so that
// go.mod and go.sum pin every module they are built from. build.sh builds them; nothing imports this.
package kube

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
