//go:build tools

// Package containerd names the containerd commands weft's integration tests run, so that go.mod and
// go.sum pin every module they are built from. ../build.sh builds them; nothing imports this.
package containerd

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
)
