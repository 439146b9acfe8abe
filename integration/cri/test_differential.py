"""The same call sequence direct and through the agent, compared field by field.

Only what differs between any two runs is set aside: IDs, timestamps, the pod
IP (host-local hands out the next address), and usage counters (whether they
are there at all included). Everything
else, including errors (code and message), must be identical.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import grpc
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc
from google.protobuf.json_format import MessageToDict

from shim.localfabric import images, pods
from shim.localfabric.containerd import Containerd

_VOLATILE_KEYS = {"id", "podSandboxId", "containerId", "createdAt", "startedAt", "finishedAt", "timestamp", "ip",
                  "imageRef", "usageCoreNanoSeconds", "usageNanoCores", "workingSetBytes", "availableBytes",
                  "usageBytes", "rssBytes", "pageFaults", "majorPageFaults", "usedBytes", "inodesUsed"}
_HEX_ID = re.compile(r"[0-9a-f]{64}")


def _normalize(value):
    if isinstance(value, dict):
        # Left out, not only masked: whether a counter is there at all is volatile too (containerd leaves out
        # usageNanoCores until it has an earlier sample, a zero counter is not sent, and a group of nothing but
        # counters, such as ContainerStats' cpu, may be missing until its first sample).
        out = {k: _normalize(v) for k, v in value.items() if k not in _VOLATILE_KEYS}
        return {k: v for k, v in out.items() if v != {}}
    if isinstance(value, list):
        return [_normalize(v) for v in value]
    if isinstance(value, str):
        return _HEX_ID.sub("<id>", value)
    return value


def recorder(out: list[tuple[str, object]], timeout: float) -> Callable[[str, Callable, object], object]:
    """``call(name, fn, request)``: make the call, append ``(name, its answer normalised)`` or ``(name, its error)``
    to ``out``, and return the response (None on an error): what both paths are compared on."""

    def call(name: str, fn: Callable, request: object) -> object:
        try:
            response = fn(request, timeout=timeout)
        except grpc.RpcError as e:
            out.append((name, ("error", e.code().name, _HEX_ID.sub("<id>", e.details() or ""))))
            return None
        doc = _normalize(MessageToDict(response))
        for key in ("images", "items", "containers", "stats"):
            # containerd lists from maps: the order is not part of the contract.
            if isinstance(doc.get(key), list):
                doc[key] = sorted(doc[key], key=lambda item: json.dumps(item, sort_keys=True))
        out.append((name, doc))
        return response

    return call


def _sequence(channel: grpc.Channel, containerd: Containerd, cfg: cri.PodSandboxConfig) -> list[tuple[str, object]]:
    rt = cri_grpc.RuntimeServiceStub(channel)
    im = cri_grpc.ImageServiceStub(channel)
    out: list[tuple[str, object]] = []
    call = recorder(out, timeout=30)
    call("Version", rt.Version, cri.VersionRequest())
    call("Status", rt.Status, cri.StatusRequest())
    call("ImageStatus", im.ImageStatus, cri.ImageStatusRequest(image=cri.ImageSpec(image=images.BUSYBOX_IMAGE)))
    call("ImageStatusMissing", im.ImageStatus, cri.ImageStatusRequest(image=cri.ImageSpec(image="nope:1")))
    call("ListImages", im.ListImages, cri.ListImagesRequest())
    call("ImageFsInfo", im.ImageFsInfo, cri.ImageFsInfoRequest())
    sb = call("RunPodSandbox", rt.RunPodSandbox, cri.RunPodSandboxRequest(config=cfg)).pod_sandbox_id
    call("PodSandboxStatus", rt.PodSandboxStatus, cri.PodSandboxStatusRequest(pod_sandbox_id=sb))
    call("ListPodSandbox", rt.ListPodSandbox, cri.ListPodSandboxRequest(filter=cri.PodSandboxFilter(id=sb)))
    ccfg = pods.container_config("diff", ["sh", "-c", "echo same; exec sleep 3600"])
    cid = call("CreateContainer", rt.CreateContainer,
               cri.CreateContainerRequest(pod_sandbox_id=sb, config=ccfg, sandbox_config=cfg)).container_id
    call("StartContainer", rt.StartContainer, cri.StartContainerRequest(container_id=cid))
    call("ContainerStatus", rt.ContainerStatus, cri.ContainerStatusRequest(container_id=cid))
    call("ExecSync", rt.ExecSync, cri.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", "echo a; exit 4"], timeout=10))
    call("ListContainers", rt.ListContainers,
         cri.ListContainersRequest(filter=cri.ContainerFilter(pod_sandbox_id=sb)))
    call("ContainerStats", rt.ContainerStats, cri.ContainerStatsRequest(container_id=cid))
    call("UpdateContainerResources", rt.UpdateContainerResources, cri.UpdateContainerResourcesRequest(
        container_id=cid, linux=cri.LinuxContainerResources(cpu_shares=256)))
    call("StopContainer", rt.StopContainer, cri.StopContainerRequest(container_id=cid, timeout=1))
    call("ContainerStatusExited", rt.ContainerStatus, cri.ContainerStatusRequest(container_id=cid))
    call("RemoveContainer", rt.RemoveContainer, cri.RemoveContainerRequest(container_id=cid))
    call("StopPodSandbox", rt.StopPodSandbox, cri.StopPodSandboxRequest(pod_sandbox_id=sb))
    call("RemovePodSandbox", rt.RemovePodSandbox, cri.RemovePodSandboxRequest(pod_sandbox_id=sb))
    # Errors must carry the same code and the same words.
    call("ContainerStatusMissing", rt.ContainerStatus, cri.ContainerStatusRequest(container_id="missing"))
    call("StartContainerMissing", rt.StartContainer, cri.StartContainerRequest(container_id="missing"))
    call("StopPodSandboxRemoved", rt.StopPodSandbox, cri.StopPodSandboxRequest(pod_sandbox_id=sb))
    call("ExecSyncMissing", rt.ExecSync, cri.ExecSyncRequest(container_id="missing", cmd=["true"]))
    call("CreateContainerBadSandbox", rt.CreateContainer,
         cri.CreateContainerRequest(pod_sandbox_id="missing", config=ccfg, sandbox_config=cfg))
    return out


def test_direct_and_through_agent_answer_the_same(containerd: Containerd, agent_channel: grpc.Channel) -> None:
    cfg = pods.sandbox_config("differential", containerd.pod_log_dir)
    with containerd.channel() as direct:
        expected = _sequence(direct, containerd, cfg)
    got = _sequence(agent_channel, containerd, cfg)
    assert [name for name, _ in got] == [name for name, _ in expected]
    for (name, want), (_, have) in zip(expected, got, strict=True):
        assert have == want, f"{name} differs through the agent"
    # The errors really were errors, so the comparison covered them.
    assert dict(expected)["ContainerStatusMissing"][1] == "NOT_FOUND"


def test_malformed_request_gets_containerd_status(containerd: Containerd, agent_channel: grpc.Channel) -> None:
    garbage = b"\x0a\xff\xff\xff\xff\x0f"  # a length-delimited field running past the end

    def outcome(ch: grpc.Channel):
        try:
            ch.unary_unary("/runtime.v1.RuntimeService/ContainerStatus")(garbage, timeout=10)
        except grpc.RpcError as e:
            return e.code(), e.details()
        return grpc.StatusCode.OK, ""

    with containerd.channel() as direct:
        want = outcome(direct)
    assert want[0] is not grpc.StatusCode.OK
    assert outcome(agent_channel) == want
