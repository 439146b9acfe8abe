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
from shim.crishared.labels import CPU_LIMIT_ANNOTATION, MEMORY_LIMIT_ANNOTATION
from shim.errors import BadAnnotation, WeftError
from shim.shadowhost.capacity import HostedCapacity, limits, shares_of
from shim.shadowhost.cpu_limit import Limiter
from shim.shadowhost.lifecycle import HOSTED_CPU_SHARES, HOSTED_OOM_SCORE_ADJ
from shim.shadowhost.runtime import RT, ShadowRuntime

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


def admitted_limits(c: cri.Container, updated: tuple[float, int] | None = None) -> tuple[float, int]:
    """The CPU cores and memory bytes a shadow was admitted with (or last updated to, when admitted)."""
    if updated is not None:
        return updated
    try:
        return float(c.annotations.get(CPU_LIMIT_ANNOTATION, "0")), int(c.annotations.get(MEMORY_LIMIT_ANNOTATION, "0"))
    except ValueError:
        return 0.0, 0


def clamped(asked: cri.LinuxContainerResources, c: cri.Container,
            admitted: tuple[float, int] | None = None) -> cri.LinuxContainerResources:
    """What an UpdateContainerResources of a shadow may set: CPU and memory within ``admitted`` (what the
    host admitted it with; an unlimited or larger ask becomes that), at most the weight it was made with,
    nothing else (no cpuset, hugepages, ``unified`` keys or OOM score of the origin's choosing)."""
    cpu, memory = admitted if admitted is not None else admitted_limits(c)
    # The weight it was made with (its request's with a reservation, else the floor) is the most it may have:
    # kubelet resizing a pod down lowers it, nothing raises it.
    made = shares_of(c)
    shares = max(HOSTED_CPU_SHARES, min(asked.cpu_shares, made)) if asked.cpu_shares > 0 else made
    out = cri.LinuxContainerResources(cpu_shares=shares, oom_score_adj=HOSTED_OOM_SCORE_ADJ)
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
    def __init__(self, rt: ShadowRuntime, capacity: HostedCapacity, limiter: Limiter | None = None) -> None:
        self.rt, self.capacity = rt, capacity
        self.limiter = limiter  # a resize of the origin's wins over the limit a start left to set
        # Tunnels into shadows (shim.shadowhost.tunnel.ShadowNet), set by the agent when it serves them.
        self.net: Any = None
        # The mesh server's Admit rule, for an update that asks for more (set with the lifecycle's).
        self.admit: Any = None

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
        resize = req.method == "UpdateContainerResources" and request.HasField("linux")
        try:
            if resize:
                if self.limiter is not None:
                    self.limiter.drop(c.id)
                request.linux.CopyFrom(clamped(request.linux, c, self._readmitted(origin, req.key, c,
                                                                                   request.linux)))
            response = self.rt.raw(RT + req.method, request.SerializeToString(), timeout)
        except BaseException:
            if resize and self.limiter is not None:
                self.limiter.undrop(c.id)  # refused, or containerd kept the spec it had: the deferred quota holds
            raise
        if req.method in ("Exec", "Attach") and self.net is not None:
            self.net.issued(origin, req.key, req.method, response)
        if resize:
            self.capacity.updated[c.id] = limits(request.linux)
            self.capacity.forget()
        if req.method == "StopContainer":
            self.capacity.forget()
        _log.debug("shadow.call", origin=origin, key=req.key, method=req.method, container_id=c.id)
        return pb.ShadowCallResponse(response=response)

    def _readmitted(self, origin: str, key: str, c: cri.Container,
                    asked: cri.LinuxContainerResources) -> tuple[float, int]:
        """The limits an update may set: more than the shadow has only if the host admits the difference now
        (kubelet resizing a pod in place); otherwise what it has."""
        cpu, memory = admitted_limits(c, self.capacity.updated.get(c.id))
        want_cpu, want_memory = limits(asked)
        more = pb.Resources(cpu_cores=max(0.0, want_cpu - cpu), memory_bytes=max(0, want_memory - memory))
        if (more.cpu_cores <= 0 and more.memory_bytes <= 0) or self.admit is None or want_cpu <= 0 or want_memory <= 0:
            return cpu, memory
        # The difference against what is free now (the shadow's current limits are already counted).
        answer = self.admit(pb.AdmitRequest(origin_node=origin, key=key, limits=pb.Resources(
            cpu_cores=max(more.cpu_cores, 0.001), memory_bytes=max(more.memory_bytes, 1))))
        if not answer.admitted:
            _log.warning("shadow.update_clamped", origin=origin, key=key, container_id=c.id,
                         detail=f"{answer.reason}: {answer.detail}")
            return cpu, memory
        return max(cpu, want_cpu), max(memory, want_memory)

    def open_tunnel(self, origin: str, req: pb.TunnelRequest) -> pb.TunnelGrant:
        return self._net().open_tunnel(origin, req)

    def stitch(self, origin: str, req: pb.StitchRequest, context: grpc.ServicerContext) -> Iterator[pb.StitchEvent]:
        return self._net().stitch(origin, req, context)

    def _net(self):
        if self.net is None:
            raise RefusedCall("this host serves no tunnels")
        return self.net
