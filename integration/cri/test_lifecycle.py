"""A whole pod lifecycle through the agent, against real containerd and runc.

Every call goes through the agent's socket, as kubelet's would, and each
assertion is about what kubelet would see: states, IPs, exit codes, output,
logs in CRI format, cgroup limits inside the container.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from shim.localfabric import images, pods
from shim.localfabric.containerd import Containerd
from shim.localfabric.waiting import wait_for


def test_full_pod_lifecycle_through_agent(containerd: Containerd, agent_channel: grpc.Channel) -> None:
    rt = cri_grpc.RuntimeServiceStub(agent_channel)
    im = cri_grpc.ImageServiceStub(agent_channel)

    version = rt.Version(cri.VersionRequest())
    assert version.runtime_name == "containerd"
    assert version.runtime_api_version == "v1"
    conditions = {c.type: c.status for c in rt.Status(cri.StatusRequest()).status.conditions}
    ready = {"RuntimeReady": True, "NetworkReady": True}
    if containerd.line != "1.6":  # 1.7 and 2.x add a condition of their own (false on 2.x on a cgroup v1 host);
        conditions.pop("ContainerdHasNoDeprecationWarnings", None)  # kubelet heeds only the two above
    assert conditions == ready

    # Images: the locally built ones, as containerd has them.
    tags = {t for i in im.ListImages(cri.ListImagesRequest()).images for t in i.repo_tags}
    assert {images.BUSYBOX_IMAGE, images.PAUSE_IMAGE} <= tags
    status = im.ImageStatus(cri.ImageStatusRequest(image=cri.ImageSpec(image=images.BUSYBOX_IMAGE)))
    assert images.BUSYBOX_IMAGE in status.image.repo_tags and status.image.size > 0
    fs = im.ImageFsInfo(cri.ImageFsInfoRequest()).image_filesystems
    # Usage is sampled every 10 s by containerd; where it is measured is known at once.
    assert fs and fs[0].fs_id.mountpoint.startswith(str(containerd.root))

    # Sandbox with CNI networking: an IP from this node's bridge subnet.
    cfg = pods.sandbox_config("life", containerd.pod_log_dir, labels={"app": "life"})
    sb = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=cfg)).pod_sandbox_id
    sb_status = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=sb)).status
    assert sb_status.state == cri.SANDBOX_READY
    assert ipaddress.ip_address(sb_status.network.ip) in ipaddress.ip_network(containerd.subnet)
    assert sb_status.metadata.name == "life"

    def sandbox_ids(**filt) -> list[str]:
        req = cri.ListPodSandboxRequest(filter=cri.PodSandboxFilter(**filt))
        return [s.id for s in rt.ListPodSandbox(req).items]

    assert sandbox_ids(id=sb) == [sb]
    assert sandbox_ids(label_selector={"app": "life"}) == [sb]
    assert sandbox_ids(label_selector={"app": "other"}) == []
    assert sb in sandbox_ids(state=cri.PodSandboxStateValue(state=cri.SANDBOX_READY))
    assert sb not in sandbox_ids(state=cri.PodSandboxStateValue(state=cri.SANDBOX_NOTREADY))

    # A container that writes a line, then sleeps.
    ccfg = pods.container_config("main", ["sh", "-c", "echo hello-from-weft; exec sleep 3600"],
                                 labels={"tier": "main"})
    create = cri.CreateContainerRequest(pod_sandbox_id=sb, config=ccfg, sandbox_config=cfg)
    cid = rt.CreateContainer(create).container_id
    assert rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status.state == cri.CONTAINER_CREATED
    rt.StartContainer(cri.StartContainerRequest(container_id=cid))
    cstatus = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status
    assert cstatus.state == cri.CONTAINER_RUNNING
    assert cstatus.labels["tier"] == "main" and cstatus.image.image == images.BUSYBOX_IMAGE

    both = ["sh", "-c", "echo out; echo err >&2"]
    exec_ok = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=both, timeout=10))
    assert (exec_ok.stdout, exec_ok.stderr, exec_ok.exit_code) == (b"out\n", b"err\n", 0)
    exec_fail = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", "exit 3"], timeout=10))
    assert exec_fail.exit_code == 3

    def container_ids(**filt) -> list[str]:
        req = cri.ListContainersRequest(filter=cri.ContainerFilter(**filt))
        return [c.id for c in rt.ListContainers(req).containers]

    assert container_ids(id=cid) == [cid]
    assert container_ids(pod_sandbox_id=sb) == [cid]
    assert container_ids(label_selector={"tier": "main"}) == [cid]
    assert container_ids(state=cri.ContainerStateValue(state=cri.CONTAINER_RUNNING), pod_sandbox_id=sb) == [cid]
    assert container_ids(state=cri.ContainerStateValue(state=cri.CONTAINER_EXITED), pod_sandbox_id=sb) == []

    stats = rt.ContainerStats(cri.ContainerStatsRequest(container_id=cid)).stats
    assert stats.attributes.id == cid and stats.memory.working_set_bytes.value > 0
    listed = rt.ListContainerStats(cri.ListContainerStatsRequest(filter=cri.ContainerStatsFilter(pod_sandbox_id=sb)))
    assert [s.attributes.id for s in listed.stats] == [cid]

    # Resources change inside the running container's cgroup.
    rt.UpdateContainerResources(cri.UpdateContainerResourcesRequest(
        container_id=cid, linux=cri.LinuxContainerResources(cpu_shares=512, memory_limit_in_bytes=96 << 20)))
    cat = ["cat", "/sys/fs/cgroup/cpu/cpu.shares"]
    shares = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=cat, timeout=10))
    assert shares.stdout.strip() == b"512"

    # The log, in CRI format, where kubelet asked for it; reopen keeps it going.
    log_file = Path(cfg.log_directory) / ccfg.log_path
    line = wait_for(lambda: log_file.exists() and log_file.read_text().strip(), what="container log")
    _, stream, tag, text = line.split(" ", 3)
    assert (stream, tag, text) == ("stdout", "F", "hello-from-weft")
    rt.ReopenContainerLog(cri.ReopenContainerLogRequest(container_id=cid))

    rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=2))
    stopped = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status
    assert stopped.state == cri.CONTAINER_EXITED and stopped.finished_at > 0
    rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid))
    assert container_ids(id=cid) == []

    rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sb))
    assert rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=sb)).status.state == cri.SANDBOX_NOTREADY
    rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sb))
    assert sandbox_ids(id=sb) == []
    # Removing again succeeds, as the CRI contract says (containerd 1.6 answers
    # NotFound to a Stop of a removed sandbox; the differential test pins that).
    rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sb))


def test_calls_are_counted_and_timed_by_method_and_code(containerd: Containerd, agent, agent_channel) -> None:
    rt = cri_grpc.RuntimeServiceStub(agent_channel)
    rt.Version(cri.VersionRequest())
    with contextlib.suppress(grpc.RpcError):
        rt.ContainerStatus(cri.ContainerStatusRequest(container_id="does-not-exist"))
    text = agent.metrics_text()
    assert 'weft_cri_requests_total{code="OK",kind="passthrough",method="Version"} 1.0' in text
    assert 'weft_cri_requests_total{code="NOT_FOUND",kind="passthrough",method="ContainerStatus"} 1.0' in text
    assert 'weft_cri_request_duration_seconds_count{code="OK",kind="passthrough",method="Version"} 1.0' in text
    status, body = agent.get("/readyz")
    assert status == 200 and json.loads(body)["containerd"] == "reachable"
    started = [e for e in agent.events() if e.get("event") == "agent.started"]
    assert started and started[0]["containerd"] == str(containerd.socket)


def test_each_call_s_log_line_names_its_sandbox_or_container_and_the_pod(containerd: Containerd, agent,
                                                                         agent_channel) -> None:
    rt = cri_grpc.RuntimeServiceStub(agent_channel)
    cfg = pods.sandbox_config("logged", containerd.pod_log_dir, namespace="team-a",
                              cgroup_parent=containerd.cgroup_root)
    sid = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=cfg)).pod_sandbox_id
    try:
        config = pods.container_config("app", ["sleep", "3600"])
        cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sid, config=config,
                                                            sandbox_config=cfg)).container_id
        rt.StartContainer(cri.StartContainerRequest(container_id=cid))  # passes through: the relay reads the ID
        rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0))
    finally:
        rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sid))
        rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sid))
    wanted = {"RunPodSandbox", "CreateContainer", "StartContainer", "StopPodSandbox", "RemovePodSandbox"}

    def logged() -> list[dict] | None:
        calls = [e for e in agent.events() if e.get("event") == "cri.call"]
        return calls if wanted <= {e["method"] for e in calls} else None

    lines = {e["method"]: e for e in wait_for(logged, timeout=10, what="the calls' log lines")}
    run, create, start = lines["RunPodSandbox"], lines["CreateContainer"], lines["StartContainer"]
    assert (run["pod"], run["namespace"], run["kind"]) == ("logged", "team-a", "intercepted")
    assert (create["pod_sandbox_id"], create["pod"]) == (sid, "logged")
    assert 0 < create["upstream_ms"] <= create["ms"]  # containerd's share, apart from weft's
    assert (start["container_id"], start["kind"]) == (cid, "passthrough")
    assert lines["StopPodSandbox"]["pod_sandbox_id"] == sid and lines["RemovePodSandbox"]["pod_sandbox_id"] == sid
