"""Rerouted CPU containers on the three-node fabric, seen through the origin's socket as kubelet sees them.

A pod with a CPU and a GPU container opts in on ``gpu-1``; the CPU container
runs on a CPU host as a shadow, and every CRI verb kubelet uses on it through
the origin's socket behaves as for a local container: status, list with
filters, logs in kubelet's log path, exec, stats, update, stop, remove. Hosts
that refuse or are full send it elsewhere or keep it local; a host that dies
gets it reported ``WeftPeerLost``, and a cut link fences it on the host before
the origin gives up, never two live copies.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from harness.registry import Registry
from shim.localfabric import images, pods
from shim.localfabric.agent import free_port
from shim.localfabric.containerd import IMAGE_CACHE
from shim.localfabric.fabric import Fabric3
from shim.localfabric.pods import PLACEMENT, cpu_container, create, run_pod, status
from shim.localfabric.waiting import wait_for


@pytest.fixture
def fabric(tmp_path: Path) -> Iterator[Fabric3]:
    with Fabric3(tmp_path / "fabric") as f:
        yield f


def _passthrough_count(f: Fabric3, method: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(f.agents["gpu-1"].metrics_text()):
        for sample in family.samples:
            if (sample.name == "weft_cri_requests_total" and sample.labels.get("method") == method
                    and sample.labels.get("kind") == "passthrough"):
                return sum(s.value for s in family.samples if s.name == sample.name
                           and s.labels.get("method") == method and s.labels.get("kind") == "passthrough")
    return 0.0


def log_path(sandbox: cri.PodSandboxConfig, config: cri.ContainerConfig) -> Path:
    return Path(sandbox.log_directory) / config.log_path


def no_two_live_copies(f: Fabric3) -> None:
    """Every origin key runs at most once across the hosts."""
    seen: dict[str, str] = {}
    for host in ("cpu-1", "cpu-2"):
        for c in f.shadows(host, running_only=True):
            key = c.labels["weft.io/origin-key"]
            assert key not in seen, f"two live copies of {key}: on {seen[key]} and {host}"
            seen[key] = host


def test_a_cpu_container_runs_on_a_host_and_kubelet_cannot_tell(fabric: Fabric3) -> None:
    f = fabric
    sid, sandbox = run_pod(f)
    config = cpu_container("tokenize", ["sh", "-c", "for i in 1 2 3; do echo line $i; done; exec sleep 3600"])
    cid = create(f, sid, sandbox, config)
    gpu_config = pods.container_config("serve", ["sleep", "3600"],
                                       envs={"NVIDIA_VISIBLE_DEVICES": "all"})
    gid = create(f, sid, sandbox, gpu_config)

    st = wait_for(lambda: (s := status(f, cid)).state == cri.CONTAINER_RUNNING and s, what="remote container running")
    host = st.annotations[PLACEMENT].removeprefix("remote:")
    assert host in ("cpu-1", "cpu-2"), _explain(f, cid)
    assert st.id == cid and st.metadata.name == "tokenize"
    assert st.labels == config.labels  # what kubelet gave, nothing of weft's
    assert {k: v for k, v in st.annotations.items() if not k.startswith("weft.io/")} == dict(config.annotations)
    assert st.log_path == str(log_path(sandbox, config))
    assert status(f, gid).annotations[PLACEMENT] == "local"
    # While remote containers exist, a local container's call still goes to containerd as it came.
    before = _passthrough_count(f, "ContainerStatus")
    ch, direct = f.direct("gpu-1")
    with ch:
        assert status(f, gid) == direct.ContainerStatus(cri.ContainerStatusRequest(container_id=gid)).status
    assert _passthrough_count(f, "ContainerStatus") == before + 1
    # It is a shadow on the host, and only there.
    shadows = f.shadows(host)
    assert len(shadows) == 1 and shadows[0].state == cri.CONTAINER_RUNNING
    ch, direct = f.direct("gpu-1")
    with ch:
        assert cid not in {c.id for c in direct.ListContainers(cri.ListContainersRequest()).containers}

    ch, rt = f.runtime("gpu-1")
    with ch:
        listed = {c.id: c for c in rt.ListContainers(cri.ListContainersRequest()).containers}
        assert {cid, gid} <= set(listed)
        assert listed[cid].pod_sandbox_id == sid and listed[cid].labels == config.labels
        # Every filter, as containerd applies it to local ones.
        by = lambda **kw: {c.id for c in rt.ListContainers(  # noqa: E731
            cri.ListContainersRequest(filter=cri.ContainerFilter(**kw))).containers}
        assert by(id=cid) == {cid}
        assert by(id=cid[:12]) == {cid}
        assert cid in by(pod_sandbox_id=sid)
        assert by(label_selector={"io.kubernetes.container.name": "tokenize"}) == {cid}
        assert cid in by(state=cri.ContainerStateValue(state=cri.CONTAINER_RUNNING))
        assert cid not in by(state=cri.ContainerStateValue(state=cri.CONTAINER_EXITED))
        assert by(pod_sandbox_id="nosuchsandbox") == set()

        # Logs: in kubelet's path, CRI format, as containerd writes them.
        path = log_path(sandbox, config)
        lines = wait_for(lambda: (t := path.read_text() if path.exists() else "").count("\n") >= 3 and t,
                         what="the remote log in kubelet's path").splitlines()
        assert [ln.split(" ", 3)[1:] for ln in lines] == [["stdout", "F", f"line {i}"] for i in (1, 2, 3)]

        out = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", "echo hi; hostname; exit 3"],
                                              timeout=10))
        assert out.exit_code == 3 and out.stdout.startswith(b"hi\n")

        stats = rt.ContainerStats(cri.ContainerStatsRequest(container_id=cid)).stats
        assert stats.attributes.id == cid and stats.attributes.labels == config.labels
        assert stats.memory.working_set_bytes.value > 0
        all_stats = {s.attributes.id for s in rt.ListContainerStats(cri.ListContainerStatsRequest()).stats}
        assert {cid, gid} <= all_stats

        rt.UpdateContainerResources(cri.UpdateContainerResourcesRequest(
            container_id=cid, linux=cri.LinuxContainerResources(memory_limit_in_bytes=96 << 20, cpu_period=100000,
                                                                 cpu_quota=50000, cpu_shares=512)))
        limit_file = "/sys/fs/cgroup/memory/memory.limit_in_bytes"
        mem = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["cat", limit_file], timeout=10)).stdout
        assert int(mem) == 96 << 20

        rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=2))
        st = status(f, cid)
        assert st.state == cri.CONTAINER_EXITED and st.finished_at > 0
        rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid))
        with pytest.raises(grpc.RpcError) as err:
            rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid))
        assert err.value.code() is grpc.StatusCode.NOT_FOUND
    wait_for(lambda: not f.shadows(host), what="the shadow removed on the host")

    # RemovePodSandbox takes the remote parts too.
    cid2 = create(f, sid, sandbox, cpu_container("tokenize", ["sleep", "3600"], attempt=1), start=False)
    host2 = status(f, cid2).annotations[PLACEMENT].removeprefix("remote:")
    wait_for(lambda: status(f, cid2).state == cri.CONTAINER_CREATED, what="the second remote container created")
    ch, rt = f.runtime("gpu-1")
    with ch:
        rt.StartContainer(cri.StartContainerRequest(container_id=cid2))
        rt.StopContainer(cri.StopContainerRequest(container_id=gid, timeout=0))
        # StopPodSandbox stops the remote parts too, as containerd does the local ones.
        rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sid))
        assert status(f, cid2).state == cri.CONTAINER_EXITED
        assert not f.shadows(host2, running_only=True)
        rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sid))
    assert not f.shadows(host2)
    ch, direct = f.direct(host2)
    with ch:
        assert not [s for s in direct.ListPodSandbox(cri.ListPodSandboxRequest()).items
                    if "weft.io/origin-node" in s.labels]
    assert f.status("gpu-1")["placements"] == []


def test_unsafe_containers_stay_local_with_the_reason(fabric: Fabric3) -> None:
    f = fabric
    sid, sandbox = run_pod(f, privileged=True)  # a pod that may hold a privileged container
    priv = cpu_container("priv", ["sleep", "3600"])
    priv.linux.security_context.privileged = True
    nolimits = pods.container_config("nolimits", ["sleep", "3600"])
    nolimits.linux.resources.memory_limit_in_bytes = 0
    hostpath = cpu_container("hostpath", ["sleep", "3600"])
    hostpath.mounts.add(container_path="/data", host_path="/srv/data")
    for config, reason in ((priv, "unsafe"), (nolimits, "unsafe"), (hostpath, "unsafe")):
        cid = create(f, sid, sandbox, config)
        st = status(f, cid)
        assert st.annotations[PLACEMENT] == "local", config.metadata.name
        assert st.annotations["weft.io/placement-reason"] == reason
        assert st.state == cri.CONTAINER_RUNNING
    assert not f.shadows("cpu-1") and not f.shadows("cpu-2")


def test_a_full_host_is_skipped_and_all_full_means_local(fabric: Fabric3) -> None:
    f = fabric
    sid, sandbox = run_pod(f)
    free = {p["node"]: p["free_memory_bytes"] for p in f.status("gpu-1")["peers"]}
    # Bigger than any host has free: no peer fits, it runs here.
    huge = cpu_container("huge", ["sleep", "3600"], memory=max(free.values()) + (1 << 30))
    cid = create(f, sid, sandbox, huge)
    st = status(f, cid)
    assert st.annotations[PLACEMENT] == "local"
    assert st.annotations["weft.io/placement-reason"] == "no-peer-fits"
    explained = json.loads(_explain(f, cid))
    assert "fits on no peer" in explained["detail"]


def _explain(f: Fabric3, cid: str) -> bytes:
    with f.agents["gpu-1"].channel() as ch:
        return ch.unary_unary("/weft.agent.v1.Admin/Explain")(cid.encode(), timeout=10)


def test_a_dead_host_is_reported_lost_then_the_restart_is_placed_afresh(fabric: Fabric3) -> None:
    f = fabric
    sid, sandbox = run_pod(f)
    cid = create(f, sid, sandbox, cpu_container("tokenize", ["sleep", "3600"]))
    st = wait_for(lambda: (s := status(f, cid)).state == cri.CONTAINER_RUNNING and s, what="running remotely")
    host = st.annotations[PLACEMENT].removeprefix("remote:")
    other = "cpu-2" if host == "cpu-1" else "cpu-1"
    i = [n.name for n in f.cluster.nodes].index(host)
    died = time.monotonic()
    f.agents[host].stop(9)
    f.cluster.kill_node(i)
    st = wait_for(lambda: (s := status(f, cid)).state == cri.CONTAINER_EXITED and s, timeout=30,
                  what="the container reported exited")
    assert st.reason == "WeftPeerLost" and st.exit_code == 137
    assert time.monotonic() - died >= f.loss_s - 1
    # kubelet restarts it: a new attempt, placed afresh on the host that is left.
    ch, rt = f.runtime("gpu-1")
    with ch:
        rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid))
    cid2 = create(f, sid, sandbox, cpu_container("tokenize", ["sleep", "3600"], attempt=1))
    st2 = wait_for(lambda: (s := status(f, cid2)).state == cri.CONTAINER_RUNNING and s, what="replacement running")
    assert st2.annotations[PLACEMENT] == f"remote:{other}"
    assert time.monotonic() - died < 30


def test_a_cut_link_fences_on_the_host_before_the_origin_gives_up(fabric: Fabric3) -> None:
    f = fabric
    sid, sandbox = run_pod(f)
    cid = create(f, sid, sandbox, cpu_container("tokenize", ["sleep", "3600"]))
    st = wait_for(lambda: (s := status(f, cid)).state == cri.CONTAINER_RUNNING and s, what="running remotely")
    host = st.annotations[PLACEMENT].removeprefix("remote:")
    i = [n.name for n in f.cluster.nodes].index(host)
    f.cluster.cut(i)
    fenced_at = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        running_there = bool(f.shadows(host, running_only=True))
        lost_here = status(f, cid).state == cri.CONTAINER_EXITED
        assert not (running_there and lost_here), "the origin gave up while the host still ran it"
        if not running_there and fenced_at is None:
            fenced_at = time.monotonic()
        if lost_here:
            break
        time.sleep(0.1)
    assert fenced_at is not None and status(f, cid).reason == "WeftPeerLost"
    f.cluster.heal(i)
    # Back together: the fenced shadow is not restarted, and kubelet's restart runs once.
    ch, rt = f.runtime("gpu-1")
    with ch:
        rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid))
    cid2 = create(f, sid, sandbox, cpu_container("tokenize", ["sleep", "3600"], attempt=1))
    wait_for(lambda: status(f, cid2).state == cri.CONTAINER_RUNNING, what="replacement running")
    wait_for(lambda: len(f.shadows(host)) + len(f.shadows("cpu-2" if host == "cpu-1" else "cpu-1")) == 1,
             timeout=20, what="the fenced copy removed as an orphan")
    no_two_live_copies(f)


def test_kill_9_of_either_agent_keeps_the_same_containers(fabric: Fabric3) -> None:
    f = fabric
    sid, sandbox = run_pod(f)
    config = cpu_container("tokenize", ["sh", "-c", "i=0; while true; do i=$((i+1)); echo n $i; sleep 0.05; done"])
    cid = create(f, sid, sandbox, config)
    st = wait_for(lambda: (s := status(f, cid)).state == cri.CONTAINER_RUNNING and s, what="running remotely")
    host = st.annotations[PLACEMENT].removeprefix("remote:")
    for name in ("gpu-1", host):
        time.sleep(1)
        f.agents[name].stop(9)
        f.agents[name].start()
        f.wait_meshed()
        st = status(f, cid)
        assert st.state == cri.CONTAINER_RUNNING, f"after kill -9 of {name}"
        assert [c.id for c in f.shadows(host)] and len(f.shadows(host)) == 1
    time.sleep(2)
    ch, rt = f.runtime("gpu-1")
    with ch:
        rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=1))
    # The copied log has every line once, in order, across both restarts.
    path = log_path(sandbox, config)

    def complete() -> list[int] | None:
        numbers = [int(ln.rsplit(" ", 1)[1]) for ln in path.read_text().splitlines() if " n " in ln]
        ch, direct = f.direct(host)
        with ch:
            shadow = f.shadows(host)[0]
            host_log = direct.ContainerStatus(cri.ContainerStatusRequest(container_id=shadow.id)).status.log_path
        host_lines = Path(host_log).read_text().count("\n") if os.path.exists(host_log) else -1
        return numbers if len(numbers) == host_lines else None

    numbers = wait_for(complete, timeout=20, what="the log copy to catch up")
    assert numbers == list(range(1, len(numbers) + 1))
    no_two_live_copies(f)


def _configmap(root: Path, files: dict[str, str], generation: int) -> None:
    """A ConfigMap volume as kubelet's atomic writer lays it out: files behind a ..data link swapped at once."""
    root.mkdir(parents=True, exist_ok=True)
    gen = root / f"..gen{generation}"
    gen.mkdir()
    for name, text in files.items():
        (gen / name).write_text(text)
        link = root / name
        if not link.is_symlink():
            link.symlink_to(f"..data/{name}")
    tmp = root / "..data_tmp"
    tmp.symlink_to(gen.name)
    tmp.rename(root / "..data")


def test_a_host_pulls_with_the_origins_credentials_and_mounts_its_volumes(fabric: Fabric3) -> None:
    f = fabric
    gpu = f.node("gpu-1")
    hosts = tuple(f.node(n).containerd for n in ("cpu-1", "cpu-2"))
    with Registry(gpu.containerd, address=f.cluster.bridge_ip, port=free_port(), clients=hosts) as reg:
        archive = next(a for a in images.cached_archives(IMAGE_CACHE) if "busybox" in a.name)
        ref = reg.push(archive, "weft/remote-pull:1")
        auth = cri.AuthConfig(username=reg.user, password=reg.password)
        with f.agents["gpu-1"].channel() as ch:
            image_ref = cri_grpc.ImageServiceStub(ch).PullImage(
                cri.PullImageRequest(image=cri.ImageSpec(image=ref), auth=auth), timeout=60).image_ref
        sid, sandbox = run_pod(f)
        volume = f.pods_dir / sandbox.metadata.uid / "volumes" / "kubernetes.io~configmap" / "settings"
        _configmap(volume, {"greeting": "hello"}, 1)
        config = cpu_container("reader", ["sleep", "3600"])
        # As kubelet does: the image by the ID PullImage returned, the name the user wrote beside it.
        config.image.CopyFrom(cri.ImageSpec(image=image_ref, user_specified_image=ref))
        config.mounts.add(container_path="/etc/settings", host_path=str(volume), readonly=True)
        cid = create(f, sid, sandbox, config)
        st = wait_for(lambda: (s := status(f, cid)).state == cri.CONTAINER_RUNNING and s, what="running remotely")
        host = st.annotations[PLACEMENT].removeprefix("remote:")
        assert host in ("cpu-1", "cpu-2"), _explain(f, cid)
        ch, rt = f.runtime("gpu-1")
        with ch:
            def read() -> bytes:
                return rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["cat", "/etc/settings/greeting"],
                                                       timeout=10)).stdout

            assert read() == b"hello"
            denied = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["touch", "/etc/settings/x"], timeout=10))
            assert denied.exit_code != 0  # read-only, as on the origin
            _configmap(volume, {"greeting": "bonjour"}, 2)  # the ConfigMap changed
            wait_for(lambda: read() == b"bonjour", timeout=20, what="the volume update to reach the host")
        # The host pulled the image itself, with credentials that were never written down there.
        ch, _ = f.direct(host)
        with ch:
            found = cri_grpc.ImageServiceStub(ch).ImageStatus(cri.ImageStatusRequest(
                image=cri.ImageSpec(image=ref))).image
        assert ref in found.repo_tags
        for name in ("gpu-1", host):
            agent = f.agents[name]
            assert reg.password not in agent.log_text()
            for path in agent.state_dir.rglob("*"):
                if path.is_file():
                    assert reg.password.encode() not in path.read_bytes(), path


def test_a_host_that_filled_up_refuses_at_admit_and_the_next_one_takes_it(tmp_path: Path) -> None:
    # Hellos 5 s apart: the origin's view of a host is old when the second container comes.
    with Fabric3(tmp_path / "fabric", hello_s=5.0, fence_s=10.0, loss_s=17.0) as f:
        sid, sandbox = run_pod(f)
        first = create(f, sid, sandbox, cpu_container("a", ["sleep", "3600"], memory=5 << 30))
        second = create(f, sid, sandbox, cpu_container("b", ["sleep", "3600"], memory=5 << 30))
        where = {c: status(f, c).annotations[PLACEMENT] for c in (first, second)}
        assert where == {first: "remote:cpu-1", second: "remote:cpu-2"}, where
        detail = json.loads(_explain(f, second))["detail"]
        assert "cpu-1: insufficient-memory" in detail, detail
