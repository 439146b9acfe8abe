//go:build tools

// Package toolkit names the NVIDIA container toolkit commands weft's tests run beside it, so that go.mod and go.sum
// pin every module they are built from. ../build.sh builds them; nothing imports this.
package toolkit

import (
	_ "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-container-runtime"
	_ "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-container-runtime-hook"
	_ "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-ctk"
	_ "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-ctk-installer"
)
