"""Prepared shadow sandboxes on the three-node fabric: made as the opted-in pod starts, used, or removed.

RunPodSandbox of an opted-in pod on ``gpu-1`` asks a CPU host for the pod's
shadow sandbox at once. The pod's rerouted container then lands in it; a pod
that never creates a container, or is removed first, or whose origin agent is
killed, leaves nothing behind once the host's TTL has passed.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cri_api.v1 import api_pb2 as cri

from shim.localfabric.fabric import Fabric3
from shim.localfabric.pods import PLACEMENT, cpu_container, create, run_pod, status
from shim.localfabric.waiting import wait_for

HOSTS = ("cpu-1", "cpu-2")
TTL_S = 3.0


@pytest.fixture
def fabric(tmp_path: Path) -> Iterator[Fabric3]:
    with Fabric3(tmp_path / "fabric", mesh_config=f"prepared_sandbox_ttl = {TTL_S}\n") as f:
        yield f


def shadow_sandboxes(f: Fabric3, host: str) -> list[cri.PodSandbox]:
    ch, rt = f.direct(host)
    with ch:
        items = rt.ListPodSandbox(cri.ListPodSandboxRequest()).items
    return [s for s in items if s.labels.get("weft.io/origin-node") == "gpu-1"]


def all_shadow_sandboxes(f: Fabric3) -> dict[str, list[cri.PodSandbox]]:
    return {h: shadow_sandboxes(f, h) for h in HOSTS}


def remove_pod(f: Fabric3, sid: str) -> None:
    ch, rt = f.runtime("gpu-1")
    with ch:
        rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sid))
        rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sid))


def test_the_first_rerouted_container_lands_in_the_prepared_sandbox(fabric: Fabric3) -> None:
    f = fabric
    sid, sandbox = run_pod(f, "prepared")
    prepared = wait_for(lambda: [(h, s) for h, ss in all_shadow_sandboxes(f).items() for s in ss] or None,
                        what="a shadow sandbox prepared on a host")
    assert len(prepared) == 1
    host, shadow = prepared[0]
    assert shadow.state == cri.SANDBOX_READY
    assert "weft.io/origin-sandbox" not in shadow.labels  # made before the origin's sandbox ID was known
    cid = create(f, sid, sandbox, cpu_container("tokenize", ["sleep", "3600"]))
    st = wait_for(lambda: (s := status(f, cid)).state == cri.CONTAINER_RUNNING and s, what="remote container running")
    assert st.annotations[PLACEMENT] == f"remote:{host}"
    shadow_container = f.shadows(host)[0]
    assert shadow_container.pod_sandbox_id == shadow.id  # no second sandbox
    assert sum(len(v) for v in all_shadow_sandboxes(f).values()) == 1
    time.sleep(3 * TTL_S)  # sweeps pass: a sandbox with a container is never swept
    assert [s.id for s in shadow_sandboxes(f, host)] == [shadow.id]
    assert status(f, cid).state == cri.CONTAINER_RUNNING
    ch, rt = f.runtime("gpu-1")
    with ch:
        rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0))
        rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid))
    remove_pod(f, sid)
    wait_for(lambda: not any(all_shadow_sandboxes(f).values()), what="the shadow sandbox gone with its container")


def test_a_pod_that_never_creates_a_container_leaves_nothing(fabric: Fabric3) -> None:
    f = fabric
    sid, _ = run_pod(f, "never")
    wait_for(lambda: any(all_shadow_sandboxes(f).values()), what="a shadow sandbox prepared on a host")
    wait_for(lambda: not any(all_shadow_sandboxes(f).values()), timeout=6 * TTL_S + 10,
             what="the unused prepared sandbox removed by its host")
    remove_pod(f, sid)


def test_a_pod_removed_before_its_container_leaves_nothing(fabric: Fabric3) -> None:
    f = fabric
    sid, _ = run_pod(f, "gone")
    remove_pod(f, sid)  # at once: the prepare may still be in flight
    wait_for(lambda: not any(all_shadow_sandboxes(f).values()), timeout=6 * TTL_S + 10,
             what="the prepared sandbox of a removed pod removed by its host")


def test_an_origin_killed_after_the_prepare_leaves_nothing(fabric: Fabric3) -> None:
    f = fabric
    run_pod(f, "orphaned")
    wait_for(lambda: any(all_shadow_sandboxes(f).values()), what="a shadow sandbox prepared on a host")
    f.agents["gpu-1"].stop(signal.SIGKILL)
    wait_for(lambda: not any(all_shadow_sandboxes(f).values()), timeout=6 * TTL_S + 10,
             what="the prepared sandbox of a dead origin removed by its host")


def test_prepare_switched_off_prepares_nothing(tmp_path: Path) -> None:
    with Fabric3(tmp_path / "fabric", mesh_config="prepare_shadow_sandbox = false\n") as f:
        sid, sandbox = run_pod(f, "off")
        cid = create(f, sid, sandbox, cpu_container("tokenize", ["sleep", "3600"]))
        wait_for(lambda: status(f, cid).state == cri.CONTAINER_RUNNING, what="remote container running")
        host = status(f, cid).annotations[PLACEMENT].removeprefix("remote:")
        assert not any('"shadow.sandbox_prepared"' in line for line in f.agents[host].log_text().splitlines())
        assert len(shadow_sandboxes(f, host)) == 1
