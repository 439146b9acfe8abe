"""The pause image an agent started by hand gives its reservation pods, asked of each containerd line for real:
1.x's verbose CRI Status says it; 2.x's does not, and the agent reads the files that containerd runs on."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shim.install import dropin
from shim.localfabric import images
from shim.localfabric.containerd import LINES, Containerd
from shim.shadowhost.sandbox_image import SandboxImage


@pytest.mark.parametrize("line", LINES)
def test_the_agent_gives_reservation_pods_the_image_containerd_runs_sandboxes_from(line: str, tmp_path: Path) -> None:
    with Containerd(line=line) as c:
        root = tmp_path / "host"
        (root / "etc/containerd").mkdir(parents=True)
        # The host's config.toml is the one this containerd runs on (it names the harness's own pause image).
        shutil.copy(c.workdir / "config.toml", root / "etc/containerd/config.toml")
        with c.channel() as ch:
            asked = SandboxImage(ch, from_host=dropin.agent_sandbox_image(c.socket, root))
            assert asked() == images.PAUSE_IMAGE
            bare = SandboxImage(ch)  # without the files: 1.x still knows, 2.x falls back to a guess
            assert (bare() == images.PAUSE_IMAGE) is line.startswith("1.")
