"""A host's side of rerouting: shadow sandboxes and containers run for an origin's pod.

The origin asks over the mesh (``RunShadow``); this node runs the container
through its own containerd: one shadow sandbox per origin sandbox (made on
first use), the image pulled with the credentials kubelet gave the origin
(held in memory for the pull only), the container created and started at low
CPU weight so the node's own pods are never starved. Every shadow carries
``weft.io/origin-node`` and ``weft.io/origin-key``, which is how this node
finds them again after a restart and how ``hide_shadows`` keeps them from its
kubelet. A host never runs what is unsafe to reroute (privileged, host
namespaces, host paths, devices), whatever the origin asks.
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import DecodeError

from shim import log
from shim._pb import mesh_pb2 as pb
from shim.cri.fabric import Fabric
from shim.cri.hide_shadows import ORIGIN_LABEL
from shim.errors import BadAnnotation, UnknownContainer, UpstreamError

_log = log.get("weft.shadows")

KEY_LABEL = "weft.io/origin-key"
SANDBOX_LABEL = "weft.io/origin-sandbox"
# cpu.shares of a hosted container: the floor, so any of the node's own pods outweighs it.
HOSTED_CPU_SHARES = 2
_RT = "/runtime.v1.RuntimeService/"
_IMG = "/runtime.v1.ImageService/"


class UnsafeShadow(BadAnnotation):
    """The origin asked this host to run something that must never be rerouted."""

    code = grpc.StatusCode.PERMISSION_DENIED


def _unsafe(sandbox: cri.PodSandboxConfig, config: cri.ContainerConfig) -> str:
    sc = config.linux.security_context
    if sc.privileged or sandbox.linux.security_context.privileged:
        return "privileged"
    for opts in (sc.namespace_options, sandbox.linux.security_context.namespace_options):
        if opts.network == cri.NODE or opts.pid == cri.NODE or opts.ipc == cri.NODE:
            return "host namespaces"
    if config.mounts:
        return f"mounts ({config.mounts[0].host_path})"  # volumes are copied by the origin, never bound
    if config.devices or config.CDI_devices:
        return "devices"
    return ""


class ShadowHost:
    def __init__(self, fabric: Fabric, state_dir: Path, *, fence_timeout: float = 8.0,
                 heartbeat_interval: float = 1.0) -> None:
        self.fabric = fabric
        self.log_root = state_dir / "shadow-logs"
        self.fence_timeout = fence_timeout
        self.heartbeat_interval = heartbeat_interval
        self._lock = threading.Lock()  # one RunShadow at a time per host: sandbox reuse stays simple
        self._contact: dict[str, float] = {}

    def open(self) -> None:
        """Start the fencer (a thread that kills the shadows of origins not heard from in time)."""

    def close(self) -> None:
        """Stop the fencer."""

    def touch(self, origin: str) -> None:
        """The origin was heard from (Hello or any shadow call): its shadows are not fenced yet."""
        self._contact[origin] = time.monotonic()

    def _call(self, path: str, request, response_type):
        return response_type.FromString(self.fabric.upstream.channel.unary_unary(path)(
            request.SerializeToString(), timeout=120))

    def _find(self, labels: dict[str, str], containers: bool) -> list:
        if containers:
            req = cri.ListContainersRequest(filter=cri.ContainerFilter(label_selector=labels))
            return list(self._call(_RT + "ListContainers", req, cri.ListContainersResponse).containers)
        req = cri.ListPodSandboxRequest(filter=cri.PodSandboxFilter(label_selector=labels))
        return list(self._call(_RT + "ListPodSandbox", req, cri.ListPodSandboxResponse).items)

    def _state(self, key: str, sandbox_id: str, container_id: str) -> pb.ShadowState:
        status = self._call(_RT + "ContainerStatus", cri.ContainerStatusRequest(container_id=container_id),
                            cri.ContainerStatusResponse).status
        return pb.ShadowState(key=key, shadow_sandbox_id=sandbox_id, shadow_container_id=container_id,
                              status=status.SerializeToString())

    def run(self, origin: str, req: pb.RunShadowRequest) -> pb.ShadowState:
        try:
            sandbox = cri.PodSandboxConfig.FromString(req.sandbox_config)
            config = cri.ContainerConfig.FromString(req.container_config)
            auth = cri.AuthConfig.FromString(req.auth) if req.auth else None
        except DecodeError as exc:
            raise BadAnnotation(f"RunShadow {req.key}: malformed CRI config from {origin}: {exc}") from None
        unsafe = _unsafe(sandbox, config)
        if unsafe:
            raise UnsafeShadow(f"RunShadow {req.key}: this host never runs a rerouted container with {unsafe}")
        origin_labels = {ORIGIN_LABEL: origin, SANDBOX_LABEL: req.origin_sandbox_id}
        with self._lock:
            existing = self._find({ORIGIN_LABEL: origin, KEY_LABEL: _label(req.key)}, containers=True)
            if existing:  # idempotent: the origin retried
                return self._state(req.key, existing[0].pod_sandbox_id, existing[0].id)
            try:
                sandbox_id = self._sandbox(origin, req, sandbox, origin_labels)
                self._pull(config.image, auth)
                config.labels.update({**origin_labels, KEY_LABEL: _label(req.key)})
                config.linux.resources.cpu_shares = HOSTED_CPU_SHARES
                created = self._call(_RT + "CreateContainer", cri.CreateContainerRequest(
                    pod_sandbox_id=sandbox_id, config=config, sandbox_config=sandbox), cri.CreateContainerResponse)
                if req.start:
                    self._call(_RT + "StartContainer", cri.StartContainerRequest(container_id=created.container_id),
                               cri.StartContainerResponse)
            except grpc.RpcError as exc:
                raise self.fabric.upstream.translate(exc) from None
            self.fabric.shadows_present = True
        _log.info("shadow.created", origin=origin, key=req.key, sandbox_id=sandbox_id,
                  container_id=created.container_id, image=config.image.image, started=req.start)
        return self._state(req.key, sandbox_id, created.container_id)

    def start(self, origin: str, key: str) -> pb.ShadowState:
        found = self._find({ORIGIN_LABEL: origin, KEY_LABEL: _label(key)}, containers=True)
        if not found:
            raise UnknownContainer(f"no shadow {key} for {origin} on this host")
        c = found[0]
        if c.state == cri.CONTAINER_CREATED:
            try:
                self._call(_RT + "StartContainer", cri.StartContainerRequest(container_id=c.id),
                           cri.StartContainerResponse)
            except grpc.RpcError as exc:
                raise self.fabric.upstream.translate(exc) from None
            _log.info("shadow.started", origin=origin, key=key, container_id=c.id)
        return self._state(key, c.pod_sandbox_id, c.id)

    def _sandbox(self, origin: str, req: pb.RunShadowRequest, sandbox: cri.PodSandboxConfig,
                 origin_labels: dict[str, str]) -> str:
        found = [s for s in self._find(origin_labels, containers=False) if s.state == cri.SANDBOX_READY]
        if found:
            return found[0].id
        shadow = cri.PodSandboxConfig()
        shadow.CopyFrom(sandbox)
        shadow.metadata.uid = f"{sandbox.metadata.uid}-shadow"
        shadow.labels.update(origin_labels)
        shadow.log_directory = str(self.log_root / origin / _label(req.origin_sandbox_id))
        del shadow.port_mappings[:]  # the pod's ports are the origin's; the mesh stitches what is needed
        return self._call(_RT + "RunPodSandbox", cri.RunPodSandboxRequest(config=shadow),
                          cri.RunPodSandboxResponse).pod_sandbox_id

    def _pull(self, image: cri.ImageSpec, auth: cri.AuthConfig | None) -> None:
        present = self._call(_IMG + "ImageStatus", cri.ImageStatusRequest(image=image), cri.ImageStatusResponse)
        if not present.image.id:
            self._call(_IMG + "PullImage", cri.PullImageRequest(image=image, auth=auth), cri.PullImageResponse)

    def status(self, origin: str, key: str) -> pb.ShadowState:
        found = self._find({ORIGIN_LABEL: origin, KEY_LABEL: _label(key)}, containers=True)
        if not found:
            raise UnknownContainer(f"no shadow {key} for {origin} on this host")
        return self._state(key, found[0].pod_sandbox_id, found[0].id)

    def remove(self, origin: str, key: str) -> bool:
        with self._lock:
            found = self._find({ORIGIN_LABEL: origin, KEY_LABEL: _label(key)}, containers=True)
            if not found:
                return False
            c = found[0]
            try:
                self._call(_RT + "StopContainer", cri.StopContainerRequest(container_id=c.id, timeout=10),
                           cri.StopContainerResponse)
                self._call(_RT + "RemoveContainer", cri.RemoveContainerRequest(container_id=c.id),
                           cri.RemoveContainerResponse)
                rest = self._find({ORIGIN_LABEL: origin}, containers=True)
                if not [x for x in rest if x.pod_sandbox_id == c.pod_sandbox_id]:
                    self._call(_RT + "StopPodSandbox", cri.StopPodSandboxRequest(pod_sandbox_id=c.pod_sandbox_id),
                               cri.StopPodSandboxResponse)
                    self._call(_RT + "RemovePodSandbox",
                               cri.RemovePodSandboxRequest(pod_sandbox_id=c.pod_sandbox_id),
                               cri.RemovePodSandboxResponse)
            except grpc.RpcError as exc:
                error = self.fabric.upstream.translate(exc)
                if not isinstance(error, UpstreamError) or error.code is not grpc.StatusCode.NOT_FOUND:
                    raise error from None
        _log.info("shadow.removed", origin=origin, key=key, container_id=c.id)
        return True


def _label(value: str) -> str:
    """Keys hold '/', and label values are kept short and plain: a stable digest names them."""
    return hashlib.sha256(value.encode()).hexdigest()[:40]
