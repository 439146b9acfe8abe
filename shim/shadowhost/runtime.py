"""This host's containerd as the shadow code asks it: typed calls, lists by label, one shadow by its key."""

from __future__ import annotations

import hashlib
import time

import grpc
from cri_api.v1 import api_pb2 as cri

from shim import log
from shim._pb import mesh_pb2 as pb
from shim.crishared.labels import KEY_LABEL, ORIGIN_LABEL
from shim.errors import UnknownContainer, UpstreamError
from shim.shadowhost.context import HostContext

_log = log.get("weft.shadows")
RT = "/runtime.v1.RuntimeService/"
IMG = "/runtime.v1.ImageService/"
# containerd answers a kill UNKNOWN ("ttrpc: closed") when its connection to the container's shim drops during
# the call; it has the task's exit, or a new connection, by a later try (kubelet too stops again at its next sync).
STOP_RETRY_S = (0.2, 0.5, 1.0)


def label(value: str) -> str:
    """Keys hold '/', and label values are kept short and plain: a stable digest names them."""
    return hashlib.sha256(value.encode()).hexdigest()[:40]


class ShadowRuntime:
    def __init__(self, ctx: HostContext) -> None:
        self.ctx = ctx
        # Why the host stopped a shadow itself (its reservation lost): container id -> (reason, message), put
        # on its ContainerStatus once it has exited, so the origin's kubelet shows weft's reason, not "Error".
        self.reasons: dict[str, tuple[str, str]] = {}

    def call(self, path: str, request, response_type, timeout: float | None = 120.0):
        return response_type.FromString(self.raw(path, request.SerializeToString(), timeout))

    def raw(self, path: str, request: bytes, timeout: float | None) -> bytes:
        try:
            return self.ctx.upstream.channel.unary_unary(path)(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise self.ctx.upstream.translate(exc) from None

    def stop(self, container_id: str, retry_s: tuple[float, ...] = STOP_RETRY_S) -> None:
        """StopContainer at once (no grace: the origin's kubelet gave it), tried again after an UNKNOWN."""
        req = cri.StopContainerRequest(container_id=container_id, timeout=0)
        for wait in (*retry_s, None):
            try:
                self.call(RT + "StopContainer", req, cri.StopContainerResponse)
                return
            except UpstreamError as exc:
                if exc.code is not grpc.StatusCode.UNKNOWN or wait is None:
                    raise
                _log.warning("shadow.stop_retried", container_id=container_id, error=exc.message, retry_in=wait)
                time.sleep(wait)

    def remove_sandbox(self, sandbox_id: str) -> None:
        """StopPodSandbox, then RemovePodSandbox: a removed shadow's last sandbox and a swept one go alike."""
        self.call(RT + "StopPodSandbox", cri.StopPodSandboxRequest(pod_sandbox_id=sandbox_id),
                  cri.StopPodSandboxResponse)
        self.call(RT + "RemovePodSandbox", cri.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id),
                  cri.RemovePodSandboxResponse)

    def containers(self, state: int | None = None, labels: dict[str, str] | None = None) -> list[cri.Container]:
        f = cri.ContainerFilter(label_selector=labels or {})
        if state is not None:
            f.state.state = state
        req = cri.ListContainersRequest(filter=f)
        return list(self.call(RT + "ListContainers", req, cri.ListContainersResponse).containers)

    def find(self, labels: dict[str, str], containers: bool) -> list:
        if containers:
            return self.containers(labels=labels)
        req = cri.ListPodSandboxRequest(filter=cri.PodSandboxFilter(label_selector=labels))
        return list(self.call(RT + "ListPodSandbox", req, cri.ListPodSandboxResponse).items)

    def one(self, origin: str, key: str) -> cri.Container:
        found = self.find({ORIGIN_LABEL: origin, KEY_LABEL: label(key)}, containers=True)
        if not found:
            raise UnknownContainer(f"no shadow {key} for {origin} on this host")
        return found[0]

    def status(self, container_id: str) -> cri.ContainerStatus | None:
        """The container's status; None once containerd no longer has it."""
        try:
            status = self.call(RT + "ContainerStatus", cri.ContainerStatusRequest(container_id=container_id),
                               cri.ContainerStatusResponse).status
        except UpstreamError as exc:
            if exc.code is grpc.StatusCode.NOT_FOUND:
                self.reasons.pop(container_id, None)
                return None
            raise
        why = self.reasons.get(container_id)
        if why is not None and status.state == cri.CONTAINER_EXITED:
            status.reason, status.message = why
        return status

    def state(self, key: str, sandbox_id: str, container_id: str) -> pb.ShadowState:
        status = self.status(container_id)
        if status is None:
            raise UnknownContainer(f"shadow {key} ({container_id}) is gone from this host")
        return pb.ShadowState(key=key, shadow_sandbox_id=sandbox_id, shadow_container_id=container_id,
                              status=status.SerializeToString())
