"""The CRI calls an origin may make on its shadow (``ShadowCall``), and the tunnels into it.

``call`` allows ExecSync, ContainerStats, UpdateContainerResources,
StopContainer, ReopenContainerLog, and Exec/Attach (whose URL the origin may
then tunnel to once, ``tunnel``); any other method is PERMISSION_DENIED, an
unknown key NOT_FOUND, a malformed request INVALID_ARGUMENT, and
containerd's own status comes back unchanged. Responses are containerd's,
so they name the shadow (ContainerStats' attributes: its id, labels and
annotations); the origin puts its own back.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import DecodeError

from shim import log
from shim._pb import mesh_pb2 as pb
from shim.cri.host.capacity import HostedCapacity, limits
from shim.cri.host.lifecycle import HOSTED_CPU_SHARES, HOSTED_OOM_SCORE_ADJ
from shim.cri.host.runtime import RT, ShadowRuntime
from shim.cri.labels import CPU_LIMIT_ANNOTATION, MEMORY_LIMIT_ANNOTATION
from shim.errors import BadAnnotation, WeftError

_log = log.get("weft.shadows")

# The CRI verbs an origin may make on its shadow (everything kubelet does to a
# live container that is not create/start/remove/status): request, response.
CALLS: dict[str, tuple[Any, Any]] = {
    "ExecSync": (cri.ExecSyncRequest, cri.ExecSyncResponse),
    "ContainerStats": (cri.ContainerStatsRequest, cri.ContainerStatsResponse),
    "UpdateContainerResources": (cri.UpdateContainerResourcesRequest, cri.UpdateContainerResourcesResponse),
    "StopContainer": (cri.StopContainerRequest, cri.StopContainerResponse),
    "ReopenContainerLog": (cri.ReopenContainerLogRequest, cri.ReopenContainerLogResponse),
    # A streaming URL of this host's containerd, which the origin may then tunnel to (shadow_tunnel).
    "Exec": (cri.ExecRequest, cri.ExecResponse),
    "Attach": (cri.AttachRequest, cri.AttachResponse),
}
CALL_TIMEOUT_S = 30.0
# ExecSync and StopContainer take their own timeout; containerd gets this much more.
CALL_SLACK_S = 10.0


class RefusedCall(WeftError):
    """ShadowCall named a CRI method that an origin may not make on a shadow."""

    code = grpc.StatusCode.PERMISSION_DENIED


def clamped(asked: cri.LinuxContainerResources, c: cri.Container) -> cri.LinuxContainerResources:
    """What an UpdateContainerResources of a shadow may set: CPU and memory within what the host admitted it
    with (an unlimited or larger ask becomes that), at the floor's weight, nothing else (no cpuset,
    hugepages, ``unified`` keys or OOM score of the origin's choosing)."""
    try:
        cpu = float(c.annotations.get(CPU_LIMIT_ANNOTATION, "0"))
        memory = int(c.annotations.get(MEMORY_LIMIT_ANNOTATION, "0"))
    except ValueError:
        cpu, memory = 0.0, 0
    out = cri.LinuxContainerResources(cpu_shares=HOSTED_CPU_SHARES, oom_score_adj=HOSTED_OOM_SCORE_ADJ)
    period = asked.cpu_period if asked.cpu_period > 0 else 100000
    want = asked.cpu_quota / period if asked.cpu_quota > 0 else 0.0
    if cpu > 0:
        out.cpu_period = period
        out.cpu_quota = int(period * (want if 0 < want <= cpu else cpu))
    want_memory = asked.memory_limit_in_bytes
    if memory > 0:
        out.memory_limit_in_bytes = want_memory if 0 < want_memory <= memory else memory
    return out


class Calls:
    def __init__(self, rt: ShadowRuntime, capacity: HostedCapacity) -> None:
        self.rt, self.capacity = rt, capacity
        # Tunnels into shadows (shim.cri.host.tunnel.ShadowNet), set by the agent when it serves them.
        self.net: Any = None

    def call(self, origin: str, req: pb.ShadowCallRequest) -> pb.ShadowCallResponse:
        types = CALLS.get(req.method)
        if types is None:
            raise RefusedCall(f"ShadowCall {req.method!r}: an origin may only call {', '.join(CALLS)} on a shadow")
        request_type, response_type = types
        try:
            request = request_type.FromString(req.request)
        except DecodeError as exc:
            raise BadAnnotation(f"ShadowCall {req.method} {req.key}: malformed request: {exc}") from None
        c = self.rt.one(origin, req.key)
        request.container_id = c.id
        if req.method == "ReopenContainerLog":
            # The origin's copy of the log is what kubelet rotates (and reopens); the
            # host's file is followed by byte offset and never rotated, so there is
            # nothing to reopen here. The shadow exists: answer as containerd would.
            return pb.ShadowCallResponse(response=response_type().SerializeToString())
        timeout: float | None = CALL_TIMEOUT_S
        if req.method in ("ExecSync", "StopContainer"):
            timeout = request.timeout + CALL_SLACK_S if request.timeout > 0 else None
        if req.method == "UpdateContainerResources" and request.HasField("linux"):
            request.linux.CopyFrom(clamped(request.linux, c))
        response = self.rt.raw(RT + req.method, request.SerializeToString(), timeout)
        if req.method in ("Exec", "Attach") and self.net is not None:
            self.net.issued(origin, req.key, req.method, response)
        if req.method == "UpdateContainerResources" and request.HasField("linux"):
            self.capacity.updated[c.id] = limits(request.linux)
            self.capacity.forget()
        if req.method == "StopContainer":
            self.capacity.forget()
        _log.debug("shadow.call", origin=origin, key=req.key, method=req.method, container_id=c.id)
        return pb.ShadowCallResponse(response=response)

    def open_tunnel(self, origin: str, req: pb.TunnelRequest) -> pb.TunnelGrant:
        return self._net().open_tunnel(origin, req)

    def stitch(self, origin: str, req: pb.StitchRequest, context: grpc.ServicerContext) -> Iterator[pb.StitchEvent]:
        return self._net().stitch(origin, req, context)

    def _net(self):
        if self.net is None:
            raise RefusedCall("this host serves no tunnels")
        return self.net
