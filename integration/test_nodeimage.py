"""The node image, built without a container engine, imported into a real containerd and run through CRI.

``nodeimage/build.py`` writes ``weft-image.oci.tar``; ``ctr images import``
loads it as it would be on a node; then kubelet's calls run its entrypoint
(``weft --version``), the OCI hook's entrypoint, and check the image's user.

The base is Debian's packages (``--base debian-packages``) unless
``WEFT_NODEIMAGE_BASE`` names another (for example the Containerfile's pinned
``docker.io/library/python:3.11-slim-bookworm@sha256:...``, which needs Docker
Hub once and is cached under /var/cache/weft/nodeimage/bases after).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from nodeimage import build
from shim import __version__
from shim.localfabric import pods
from shim.localfabric.containerd import Containerd
from shim.localfabric.waiting import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> build.Built:
    base = os.environ.get("WEFT_NODEIMAGE_BASE", "debian-packages")
    try:
        return build.build(tmp_path_factory.mktemp("nodeimage"), base=base)
    except build.BuildError as exc:
        pytest.fail(f"building the node image on base {base!r} failed (a first build needs network access: apt's "
                    f"mirror for Debian packages, the package index for wheels, the registry for a registry "
                    f"base; later builds use /var/cache/weft/nodeimage): {exc}")


@pytest.fixture
def imported(containerd: Containerd, archive: build.Built) -> Iterator[build.Built]:
    res = subprocess.run(["ctr", "-a", str(containerd.socket), "-n", "k8s.io", "images", "import",
                          str(archive.archive)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"ctr images import {archive.archive}: {res.stderr}"
    yield archive
    subprocess.run(["ctr", "-a", str(containerd.socket), "-n", "k8s.io", "images", "rm", archive.name],
                   capture_output=True, text=True, timeout=60)


def _run_to_exit(rt, containerd: Containerd, name: str, command: list[str], args: list[str], image: str):
    """Run one container of the image in its own pod until it exits: (exit code, log lines)."""
    cfg = pods.sandbox_config(name, containerd.pod_log_dir)
    sb = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=cfg)).pod_sandbox_id
    ccfg = pods.container_config(name, command, image=image)
    del ccfg.args[:]
    ccfg.args.extend(args)
    ccfg.linux.resources.memory_limit_in_bytes = 512 << 20  # Python and grpc, not busybox
    ccfg.linux.security_context.ClearField("run_as_user")  # the image's USER decides
    create = cri.CreateContainerRequest(pod_sandbox_id=sb, config=ccfg, sandbox_config=cfg)
    cid = rt.CreateContainer(create).container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=cid))
    status = wait_for(lambda: (s := rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status).state
                      == cri.CONTAINER_EXITED and s, timeout=120, what=f"container {name} to exit")
    log = Path(cfg.log_directory) / ccfg.log_path
    lines = [ln.split(" ", 3)[3] for ln in log.read_text().splitlines()] if log.exists() else []
    return status.exit_code, lines


def test_image_imports_and_its_entrypoint_runs_weft(containerd: Containerd, imported: build.Built):
    with containerd.channel() as ch:
        rt, im = cri_grpc.RuntimeServiceStub(ch), cri_grpc.ImageServiceStub(ch)
        status = im.ImageStatus(cri.ImageStatusRequest(image=cri.ImageSpec(image=imported.name)), timeout=30)
        assert imported.name in status.image.repo_tags
        code, lines = _run_to_exit(rt, containerd, "weft-version", [], ["--version"], imported.name)
    assert (code, lines) == (0, [f"weft {__version__}"])


def test_image_runs_as_its_non_root_user(containerd: Containerd, imported: build.Built):
    with containerd.channel() as ch:
        rt = cri_grpc.RuntimeServiceStub(ch)
        code, lines = _run_to_exit(rt, containerd, "weft-user", ["python3", "-c", "import os; print(os.getuid())"],
                                   [], imported.name)
    assert (code, lines) == (0, ["65532"])


def test_image_runs_the_oci_hook(containerd: Containerd, imported: build.Built):
    state = json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": 1,
                        "annotations": {"weft.io/lease": "lease-1"}})
    # An unknown stage with a lease: the hook reads and parses the state, warns and exits 0 (never blocks).
    script = f"printf '%s' '{state}' | weft-oci-hook probe 2>&1; echo rc=$?"
    with containerd.channel() as ch:
        rt = cri_grpc.RuntimeServiceStub(ch)
        code, lines = _run_to_exit(rt, containerd, "weft-hook", ["sh", "-c", script], [], imported.name)
    assert (code, lines) == (0, ["weft-oci-hook: unknown hook stage 'probe'; doing nothing", "rc=0"])
