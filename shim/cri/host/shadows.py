"""A host's side of rerouting: shadow sandboxes and containers run for an origin's pod.

The origin asks over the mesh (``RunShadow``); this node runs the container
through its own containerd: one shadow sandbox per origin sandbox (made on
first use), the image pulled with the credentials kubelet gave the origin
(held in memory for the pull only), the container created and started at low
CPU weight so the node's own pods are never starved. Every shadow carries
``weft.io/origin-node`` and ``weft.io/origin-key`` (a digest of the key),
which is how this node finds them again after a restart and how
``verbs.listing`` keeps them from its kubelet; the full key and the limits it
was admitted by ride along as annotations. A host never runs what is unsafe
to reroute (privileged, host namespaces, host paths, devices), whatever the
origin asks. The pod's read-only volumes come copied (``shadow_volumes``).

What the origin sees of its shadows afterwards (the contract it relies on):

- ``watch``: first the shadows of the origin not among ``keys`` are removed
  (so ``keys`` must hold every key the origin owns, a RunShadow in flight
  included); then one ShadowState per remaining shadow (key, ids, status);
  then a heartbeat, which marks the end of that snapshot; then, every
  interval (``heartbeat_s`` or the host's, within 0.2-5 s), a ShadowState
  for each shadow that appeared or whose state, exit code or finish time
  changed, ``gone`` (with key and ids, no status) for each that disappeared,
  and a heartbeat. A failure to read containerd ends the stream with its
  status; the origin watches again.
- ``call``: ExecSync, ContainerStats, UpdateContainerResources,
  StopContainer, ReopenContainerLog, and Exec/Attach (whose URL the origin
  may then tunnel to once, ``shadow_tunnel``); any other method is PERMISSION_DENIED,
  an unknown key NOT_FOUND, a malformed request INVALID_ARGUMENT, and
  containerd's own status comes back unchanged. Responses are containerd's,
  so they name the shadow (ContainerStats' attributes: its id, labels and
  annotations); the origin puts its own back.
- ``stream_log``: the log file from the offset on, in chunks of at most
  256 KiB that end at a line end (only the last, after the exit, may not);
  it ends (OK) once the container has exited or is gone and the file is read
  to its end. An unknown key is NOT_FOUND.
- ``sync_volumes``: the same volumes as at RunShadow (same container paths,
  same order; FAILED_PRECONDITION otherwise), files replaced atomically;
  single-file volumes are bound by inode and, as a Kubernetes subPath, do
  not see updates inside a running container.

Fencing (at most one live copy, DESIGN 2.3): a thread kills the running
shadows of an origin that sent nothing (Hello, Watch, any shadow call) for
``fence_timeout``. What this host sends (Watch heartbeats) proves nothing
about the origin and does not count. The origin gives up on its shadows only
after its longer loss timeout, by which time they are dead. A fenced shadow
stays until the origin removes it or a Watch finds it orphaned.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import grpc
from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import DecodeError

from shim import log
from shim._pb import mesh_pb2 as pb
from shim.core.reroute import ZERO, Resources
from shim.cri.fabric import Fabric
from shim.cri.host import volumes as shadow_volumes
from shim.cri.host.logs import Life, follow
from shim.cri.labels import (
    CPU_LIMIT_ANNOTATION,
    KEY_ANNOTATION,
    KEY_LABEL,
    MEMORY_LIMIT_ANNOTATION,
    ORIGIN_LABEL,
    SANDBOX_LABEL,
)
from shim.errors import BadAnnotation, UnknownContainer, UpstreamError, WeftError

_log = log.get("weft.shadows")

# cpu.shares of a hosted container: the floor, so any of the node's own pods outweighs it.
HOSTED_CPU_SHARES = 2
FENCE_TICK_S = 0.5
HEARTBEAT_BOUNDS_S = (0.2, 5.0)
CAPACITY_TTL_S = 2.0
OWN_RESOURCES_TTL_S = 30.0
_RT = "/runtime.v1.RuntimeService/"
_IMG = "/runtime.v1.ImageService/"

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


class UnsafeShadow(BadAnnotation):
    """The origin asked this host to run something that must never be rerouted."""

    code = grpc.StatusCode.PERMISSION_DENIED


class RefusedCall(WeftError):
    """ShadowCall named a CRI method that an origin may not make on a shadow."""

    code = grpc.StatusCode.PERMISSION_DENIED


class NoLog(WeftError):
    """The shadow was created without a log path: there is nothing to stream."""

    code = grpc.StatusCode.FAILED_PRECONDITION


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
    # containerd writes the log at <sandbox log directory>/<log_path>: it must stay inside.
    if config.log_path.startswith("/") or ".." in PurePosixPath(config.log_path).parts or "\0" in config.log_path:
        return f"a log path outside the pod's log directory ({config.log_path})"
    return ""


def sandbox_to_use(existing: Iterable[cri.PodSandbox], attempt: int) -> tuple[str | None, int]:
    """A ready shadow sandbox of the pod to reuse, else None and the attempt a new one takes (``attempt``, the
    origin's, unless a dead one holds it).

    A sandbox that is no longer ready (its host rebooted, its pause process
    was killed) keeps its name reserved in containerd until it is removed,
    which happens with its last shadow; a new one with the same metadata would
    be refused, so it is the next attempt, as kubelet makes one.
    """
    existing = list(existing)
    ready = [s for s in existing if s.state == cri.SANDBOX_READY]
    if ready:
        return ready[0].id, ready[0].metadata.attempt
    return None, max([attempt, *(s.metadata.attempt + 1 for s in existing)])


def orphans(shadows: Iterable[cri.Container], keys: Iterable[str]) -> list[cri.Container]:
    """The shadows whose key is none of ``keys`` (the keys an origin still owns); pure."""
    owned = {_label(k) for k in keys}
    return [c for c in shadows if c.labels.get(KEY_LABEL) not in owned]


def heartbeat_s(asked: float, default: float) -> float:
    """The Watch interval: what the origin asked (or the host's own), within ``HEARTBEAT_BOUNDS_S``."""
    low, high = HEARTBEAT_BOUNDS_S
    return min(high, max(low, asked if asked > 0 else default))


def _limits(resources: cri.LinuxContainerResources) -> tuple[float, int]:
    cpu = resources.cpu_quota / resources.cpu_period if resources.cpu_quota > 0 and resources.cpu_period > 0 else 0.0
    return cpu, max(0, resources.memory_limit_in_bytes)


def _safe_component(value: str, what: str) -> str:
    if not value or "/" in value or "\0" in value or value in (".", ".."):
        raise BadAnnotation(f"{what} {value!r} cannot name a directory")
    return value


class ShadowHost:
    def __init__(self, fabric: Fabric, state_dir: Path, *, fence_timeout: float = 8.0,
                 heartbeat_interval: float = 1.0, cgroup_parent: str = "/weft-shadows") -> None:
        self.fabric = fabric
        # Shadows live under a cgroup of this host's choosing: the origin's pod cgroup path means
        # nothing here, and one under kubelet's own tree would be cleaned up by it as an orphaned pod.
        self.cgroup_parent = cgroup_parent
        self.log_root = state_dir / "shadow-logs"
        self.volume_root = state_dir / "shadow-volumes"
        self.fence_timeout = fence_timeout
        self.heartbeat_interval = heartbeat_interval
        # Creating and removing shadows (and their sandboxes) one at a time: sandbox reuse stays simple.
        self._lock = threading.Lock()
        self._volume_lock = threading.Lock()
        self._contact_lock = threading.Lock()
        self._contact: dict[str, float] = {}  # origin -> monotonic time it was last heard from
        self._seeded = False
        self._stop = threading.Event()
        self._fencer: threading.Thread | None = None
        # Limits set by UpdateContainerResources since this agent started (the annotations hold the first ones).
        self._updated: dict[str, tuple[float, int]] = {}
        self._cache: dict[str, tuple[float, Resources]] = {}
        self._own: dict[str, tuple[float, int, int]] = {}  # container id -> (asked at, cpu.shares, memory limit)
        self._cache_lock = threading.Lock()
        # Tunnels into shadows (shim.cri.host.tunnel.ShadowNet), set by the agent when it serves them.
        self.net: Any = None

    # -- fencing -------------------------------------------------------------------
    def open(self) -> None:
        """Start the fencer. Origins with shadows here get one fence timeout from now to show up."""
        self._stop.clear()
        self._seed()
        self._fencer = threading.Thread(target=self._fence_loop, name="weft-shadow-fencer", daemon=True)
        self._fencer.start()

    def close(self) -> None:
        self._stop.set()
        if self._fencer is not None:
            self._fencer.join(timeout=5)
            self._fencer = None

    def touch(self, origin: str) -> None:
        """The origin was heard from (Hello, Watch or any shadow call): its shadows are not fenced yet."""
        with self._contact_lock:
            self._contact[origin] = time.monotonic()

    def _seed(self) -> None:
        try:
            shadows = [c for c in self._list() if ORIGIN_LABEL in c.labels]
        except WeftError as exc:
            _log.warning("shadow.fence_seed_failed", error=exc.message)  # the fencer tries again
            return
        now = time.monotonic()
        with self._contact_lock:
            for c in shadows:
                self._contact.setdefault(c.labels[ORIGIN_LABEL], now)
            self._seeded = True
        if shadows:
            self.fabric.shadows_present = True

    def _fence_loop(self) -> None:
        while not self._stop.wait(FENCE_TICK_S):
            try:
                self.fence()
            except WeftError as exc:
                _log.warning("shadow.fence_failed", error=exc.message)

    def fence(self) -> None:
        """One round: kill the running shadows of every origin silent for longer than the fence timeout."""
        if not self._seeded:
            self._seed()
            if not self._seeded:
                return
        now = time.monotonic()
        with self._contact_lock:
            overdue = {o: t for o, t in self._contact.items() if now - t > self.fence_timeout}
        if not overdue:
            return
        running = [c for c in self._list(cri.CONTAINER_RUNNING) if c.labels.get(ORIGIN_LABEL) in overdue]
        for c in running:
            origin = c.labels[ORIGIN_LABEL]
            with self._contact_lock:
                silent = time.monotonic() - self._contact.get(origin, overdue[origin])
            if silent <= self.fence_timeout:  # heard from while we listed
                continue
            try:
                self._call(_RT + "StopContainer", cri.StopContainerRequest(container_id=c.id, timeout=0),
                           cri.StopContainerResponse)
            except UpstreamError as exc:
                if exc.code is not grpc.StatusCode.NOT_FOUND:
                    raise
            self.fabric.metrics.shadows_fenced.labels(origin).inc()
            _log.warning("shadow.fenced", origin=origin, key=c.annotations.get(KEY_ANNOTATION, ""),
                         container_id=c.id, silent_s=round(silent, 1))
        with self._contact_lock:  # an origin with nothing left running needs no watching until it runs more
            for origin, t in overdue.items():
                if self._contact.get(origin) == t and not any(c.labels[ORIGIN_LABEL] == origin for c in running):
                    del self._contact[origin]

    # -- containerd ----------------------------------------------------------------
    def _call(self, path: str, request, response_type, timeout: float | None = 120.0):
        return response_type.FromString(self._raw(path, request.SerializeToString(), timeout))

    def _raw(self, path: str, request: bytes, timeout: float | None) -> bytes:
        try:
            return self.fabric.upstream.channel.unary_unary(path)(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise self.fabric.upstream.translate(exc) from None

    def _list(self, state: int | None = None, labels: dict[str, str] | None = None) -> list[cri.Container]:
        f = cri.ContainerFilter(label_selector=labels or {})
        if state is not None:
            f.state.state = state
        req = cri.ListContainersRequest(filter=f)
        return list(self._call(_RT + "ListContainers", req, cri.ListContainersResponse).containers)

    def _find(self, labels: dict[str, str], containers: bool) -> list:
        if containers:
            return self._list(labels=labels)
        req = cri.ListPodSandboxRequest(filter=cri.PodSandboxFilter(label_selector=labels))
        return list(self._call(_RT + "ListPodSandbox", req, cri.ListPodSandboxResponse).items)

    def _one(self, origin: str, key: str) -> cri.Container:
        found = self._find({ORIGIN_LABEL: origin, KEY_LABEL: _label(key)}, containers=True)
        if not found:
            raise UnknownContainer(f"no shadow {key} for {origin} on this host")
        return found[0]

    def _status(self, container_id: str) -> cri.ContainerStatus | None:
        """The container's status; None once containerd no longer has it."""
        try:
            return self._call(_RT + "ContainerStatus", cri.ContainerStatusRequest(container_id=container_id),
                              cri.ContainerStatusResponse).status
        except UpstreamError as exc:
            if exc.code is grpc.StatusCode.NOT_FOUND:
                return None
            raise

    def _state(self, key: str, sandbox_id: str, container_id: str) -> pb.ShadowState:
        status = self._status(container_id)
        if status is None:
            raise UnknownContainer(f"shadow {key} ({container_id}) is gone from this host")
        return pb.ShadowState(key=key, shadow_sandbox_id=sandbox_id, shadow_container_id=container_id,
                              status=status.SerializeToString())

    def _volume_dir(self, origin: str, key: str) -> Path:
        return self.volume_root / _safe_component(origin, "origin node") / _label(key)

    # -- lifecycle -------------------------------------------------------------------
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
        plans = shadow_volumes.plan(req.volumes)
        volumes = self._volume_dir(origin, req.key)
        origin_labels = {ORIGIN_LABEL: origin, SANDBOX_LABEL: req.origin_sandbox_id}
        # The pull may take minutes: outside the lock, so Watch, RemoveShadow and other RunShadows go on.
        self._pull(config.image, auth)
        with self._lock:
            existing = self._find({ORIGIN_LABEL: origin, KEY_LABEL: _label(req.key)}, containers=True)
            if existing:  # idempotent: the origin retried
                return self._state(req.key, existing[0].pod_sandbox_id, existing[0].id)
            try:
                if plans:
                    shadow_volumes.remove(volumes)  # a leftover of a RunShadow that failed half-way
                    shadow_volumes.write(volumes, plans)
                for i, p in enumerate(plans):
                    config.mounts.append(cri.Mount(container_path=p.container_path, readonly=True,
                                                   host_path=str(shadow_volumes.host_path(volumes, i, p))))
                shadow_sandbox = self._shadow_sandbox(origin, req, sandbox, origin_labels)
                sandbox_id = self._sandbox(shadow_sandbox, origin_labels)
                cpu, memory = _limits(config.linux.resources)
                config.labels.update({**origin_labels, KEY_LABEL: _label(req.key)})
                config.annotations.update({KEY_ANNOTATION: req.key, CPU_LIMIT_ANNOTATION: repr(cpu),
                                           MEMORY_LIMIT_ANNOTATION: str(memory)})
                config.linux.resources.cpu_shares = HOSTED_CPU_SHARES
                created = self._call(_RT + "CreateContainer", cri.CreateContainerRequest(
                    pod_sandbox_id=sandbox_id, config=config, sandbox_config=shadow_sandbox),
                    cri.CreateContainerResponse)
                self.fabric.shadows_present = True
                if req.start:
                    self._call(_RT + "StartContainer", cri.StartContainerRequest(container_id=created.container_id),
                               cri.StartContainerResponse)
            except BaseException:
                with contextlib.suppress(WeftError):  # the original error is the one to report
                    if plans and not self._find({ORIGIN_LABEL: origin, KEY_LABEL: _label(req.key)}, containers=True):
                        shadow_volumes.remove(volumes)
                raise
        self._forget_capacity()
        _log.info("shadow.created", origin=origin, key=req.key, sandbox_id=sandbox_id,
                  container_id=created.container_id, image=config.image.image, started=req.start,
                  volumes=len(plans))
        return self._state(req.key, sandbox_id, created.container_id)

    def start(self, origin: str, key: str) -> pb.ShadowState:
        c = self._one(origin, key)
        if c.state == cri.CONTAINER_CREATED:
            self._call(_RT + "StartContainer", cri.StartContainerRequest(container_id=c.id),
                       cri.StartContainerResponse)
            self._forget_capacity()
            _log.info("shadow.started", origin=origin, key=key, container_id=c.id)
        return self._state(key, c.pod_sandbox_id, c.id)

    def _shadow_sandbox(self, origin: str, req: pb.RunShadowRequest, sandbox: cri.PodSandboxConfig,
                        origin_labels: dict[str, str]) -> cri.PodSandboxConfig:
        """The origin's sandbox config as this host runs it: its own log directory, cgroup and labels.

        CreateContainer must be given this one too: containerd takes a
        container's log directory and cgroup from the request's sandbox config.
        """
        shadow = cri.PodSandboxConfig()
        shadow.CopyFrom(sandbox)
        shadow.metadata.uid = f"{sandbox.metadata.uid}-shadow"
        shadow.labels.update(origin_labels)
        shadow.log_directory = str(self._sandbox_logs(origin, req.origin_sandbox_id))
        shadow.linux.cgroup_parent = shadow_cgroup(self.cgroup_parent, shadow.metadata.uid,
                                                   systemd=sandbox.linux.cgroup_parent.endswith(".slice"))
        del shadow.port_mappings[:]  # the pod's ports are the origin's; the mesh stitches what is needed
        return shadow

    def _sandbox(self, shadow: cri.PodSandboxConfig, origin_labels: dict[str, str]) -> str:
        """The pod's ready shadow sandbox, or a new one (``shadow``'s attempt set to follow any dead one)."""
        ready, shadow.metadata.attempt = sandbox_to_use(self._find(origin_labels, containers=False),
                                                        shadow.metadata.attempt)
        if ready:
            return ready
        return self._call(_RT + "RunPodSandbox", cri.RunPodSandboxRequest(config=shadow),
                          cri.RunPodSandboxResponse).pod_sandbox_id

    def _sandbox_logs(self, origin: str, origin_sandbox_id: str) -> Path:
        return self.log_root / _safe_component(origin, "origin node") / _label(origin_sandbox_id)

    def _pull(self, image: cri.ImageSpec, auth: cri.AuthConfig | None) -> None:
        present = self._call(_IMG + "ImageStatus", cri.ImageStatusRequest(image=image), cri.ImageStatusResponse)
        if not present.image.id:
            self._call(_IMG + "PullImage", cri.PullImageRequest(image=image, auth=auth), cri.PullImageResponse)

    def status(self, origin: str, key: str) -> pb.ShadowState:
        c = self._one(origin, key)
        return self._state(key, c.pod_sandbox_id, c.id)

    def remove(self, origin: str, key: str) -> bool:
        with self._lock:
            found = self._find({ORIGIN_LABEL: origin, KEY_LABEL: _label(key)}, containers=True)
            if not found:
                shadow_volumes.remove(self._volume_dir(origin, key))
                return False
            self._remove(origin, key, found[0])
        return True

    def _remove(self, origin: str, key: str, c: cri.Container, why: str = "removed") -> None:
        """Stop and remove a shadow, its sandbox with its last container, its volumes and its logs (lock held)."""
        status = self._status(c.id)
        try:
            # At once, as containerd's RemoveContainer does: the origin's kubelet gave the grace period when
            # it stopped the container; waiting here would hold the lock every other shadow call needs.
            self._call(_RT + "StopContainer", cri.StopContainerRequest(container_id=c.id, timeout=0),
                       cri.StopContainerResponse)
            self._call(_RT + "RemoveContainer", cri.RemoveContainerRequest(container_id=c.id),
                       cri.RemoveContainerResponse)
            rest = self._find({ORIGIN_LABEL: origin}, containers=True)
            last = not [x for x in rest if x.pod_sandbox_id == c.pod_sandbox_id]
            if last:
                self._call(_RT + "StopPodSandbox", cri.StopPodSandboxRequest(pod_sandbox_id=c.pod_sandbox_id),
                           cri.StopPodSandboxResponse)
                self._call(_RT + "RemovePodSandbox", cri.RemovePodSandboxRequest(pod_sandbox_id=c.pod_sandbox_id),
                           cri.RemovePodSandboxResponse)
        except UpstreamError as exc:
            if exc.code is not grpc.StatusCode.NOT_FOUND:
                raise
            last = False
        shadow_volumes.remove(self._volume_dir(origin, key) if key else
                              self.volume_root / _safe_component(origin, "origin node") / c.labels[KEY_LABEL])
        if status is not None and status.log_path:
            log_file = Path(status.log_path)
            log_file.unlink(missing_ok=True)
            _rmdir_up(log_file.parent, self.log_root)
        if last and c.labels.get(SANDBOX_LABEL) is not None:
            _rmtree_quietly(self._sandbox_logs(origin, c.labels[SANDBOX_LABEL]))
            _rmdir_up(self.log_root / origin, self.log_root)
        self._updated.pop(c.id, None)
        self._forget_capacity()
        _log.info(f"shadow.{why}", origin=origin, key=key, container_id=c.id)

    # -- Watch -----------------------------------------------------------------------
    def watch(self, origin: str, req: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.ShadowState]:
        """Orphans removed; one state per shadow; a heartbeat; then changes and a heartbeat every interval.

        Runs in the mesh server's worker thread and starts none of its own; a
        client that goes away wakes the wait (``add_callback``) and ends it.
        """
        interval = heartbeat_s(req.heartbeat_s, self.heartbeat_interval)
        gone = threading.Event()
        context.add_callback(gone.set)
        with self._lock:
            shadows = self._list(labels={ORIGIN_LABEL: origin})
            for c in orphans(shadows, req.keys):
                self._remove(origin, c.annotations.get(KEY_ANNOTATION, ""), c, why="orphan_removed")
        kept = {c.id: c for c in shadows if c.labels.get(KEY_LABEL) in {_label(k) for k in req.keys}}
        seen: dict[str, tuple[cri.Container, int, tuple]] = {}
        for c in kept.values():
            message = self._watched(c, seen)
            if message is not None:
                yield message
        yield pb.ShadowState(heartbeat=True)
        while context.is_active():
            gone.wait(interval)
            if not context.is_active():
                return
            now = {c.id: c for c in self._list(labels={ORIGIN_LABEL: origin})}
            for cid in [cid for cid in seen if cid not in now]:
                c = seen.pop(cid)[0]
                yield pb.ShadowState(key=c.annotations.get(KEY_ANNOTATION, ""), shadow_sandbox_id=c.pod_sandbox_id,
                                     shadow_container_id=cid, gone=True)
            for cid, c in now.items():
                if cid not in seen or seen[cid][1] != c.state:
                    message = self._watched(c, seen)
                    if message is not None:
                        yield message
            yield pb.ShadowState(heartbeat=True)

    def _watched(self, c: cri.Container, seen: dict) -> pb.ShadowState | None:
        """The state to send for ``c`` if it changed since last sent (updating ``seen``); None if not."""
        status = self._status(c.id)
        if status is None:
            return None  # removed as we looked: the next round reports it gone if it was seen
        mark = (status.state, status.exit_code, status.finished_at)
        previous = seen.get(c.id)
        seen[c.id] = (c, status.state, mark)
        if previous is not None and previous[2] == mark:
            return None
        return pb.ShadowState(key=c.annotations.get(KEY_ANNOTATION, ""), shadow_sandbox_id=c.pod_sandbox_id,
                              shadow_container_id=c.id, status=status.SerializeToString())

    # -- ShadowCall ------------------------------------------------------------------
    def call(self, origin: str, req: pb.ShadowCallRequest) -> pb.ShadowCallResponse:
        types = CALLS.get(req.method)
        if types is None:
            raise RefusedCall(f"ShadowCall {req.method!r}: an origin may only call {', '.join(CALLS)} on a shadow")
        request_type, response_type = types
        try:
            request = request_type.FromString(req.request)
        except DecodeError as exc:
            raise BadAnnotation(f"ShadowCall {req.method} {req.key}: malformed request: {exc}") from None
        c = self._one(origin, req.key)
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
            request.linux.cpu_shares = HOSTED_CPU_SHARES  # a hosted container never outweighs the host's own pods
        response = self._raw(_RT + req.method, request.SerializeToString(), timeout)
        if req.method in ("Exec", "Attach") and self.net is not None:
            self.net.issued(origin, req.key, req.method, response)
        if req.method == "UpdateContainerResources" and request.HasField("linux"):
            self._updated[c.id] = _limits(request.linux)
            self._forget_capacity()
        if req.method == "StopContainer":
            self._forget_capacity()
        _log.debug("shadow.call", origin=origin, key=req.key, method=req.method, container_id=c.id)
        return pb.ShadowCallResponse(response=response)

    # -- StreamLog -------------------------------------------------------------------
    def stream_log(self, origin: str, req: pb.LogRequest, context: grpc.ServicerContext) -> Iterator[pb.LogChunk]:
        """The shadow's log file from ``req.offset``, as it grows, until the container has exited and all is sent."""
        c = self._one(origin, req.key)
        status = self._status(c.id)
        if status is None:
            raise UnknownContainer(f"shadow {req.key} ({c.id}) is gone from this host")
        if not status.log_path:
            raise NoLog(f"shadow {req.key} was created without a log path")
        gone = threading.Event()
        context.add_callback(gone.set)

        def life() -> Life:
            s = self._status(c.id)
            if s is None:
                return Life.GONE
            return {cri.CONTAINER_CREATED: Life.CREATED, cri.CONTAINER_RUNNING: Life.RUNNING}.get(
                s.state, Life.EXITED)

        for offset, data in follow(Path(status.log_path), req.offset, life, context.is_active, gone.wait):
            yield pb.LogChunk(offset=offset, data=data)

    # -- tunnels (shim.cri.host.tunnel) ------------------------------------------------
    def open_tunnel(self, origin: str, req: pb.TunnelRequest) -> pb.TunnelGrant:
        return self._net().open_tunnel(origin, req)

    def stitch(self, origin: str, req: pb.StitchRequest, context: grpc.ServicerContext) -> Iterator[pb.StitchEvent]:
        return self._net().stitch(origin, req, context)

    def _net(self):
        if self.net is None:
            raise RefusedCall("this host serves no tunnels")
        return self.net

    # -- SyncVolumes -----------------------------------------------------------------
    def sync_volumes(self, origin: str, req: pb.SyncVolumesRequest) -> pb.SyncVolumesResponse:
        plans = shadow_volumes.plan(req.volumes)
        c = self._one(origin, req.key)
        with self._volume_lock:
            changed = shadow_volumes.sync(self._volume_dir(origin, req.key), plans)
        _log.info("shadow.volumes_synced", origin=origin, key=req.key, container_id=c.id, changed=changed)
        return pb.SyncVolumesResponse(changed=changed)

    # -- capacity (CapacityProbe's own_requests and hosted_limits) -------------------
    def own_requests(self) -> Resources:
        """CPU (cpu.shares / 1024) and memory limits of this node's own running containers, shadows left out."""
        return self._cached("own", self._own_requests)

    def hosted_limits(self) -> Resources:
        """CPU (quota / period) and memory limits of the running shadows; also sets ``weft_shadows_hosted``."""
        return self._cached("hosted", self._hosted_limits)

    def _own_requests(self) -> Resources:
        cpu, memory = 0.0, 0
        now = time.monotonic()
        known, self._own = self._own, {}
        for c in self._list(cri.CONTAINER_RUNNING):
            if ORIGIN_LABEL in c.labels:
                continue
            # Resources change only by an in-place resize: each container is asked again now and then, not each time.
            at, shares, limit = known.get(c.id) or (now, *self._resources(c.id))
            if now - at > OWN_RESOURCES_TTL_S:
                at, shares, limit = now, *self._resources(c.id)
            self._own[c.id] = (at, shares, limit)
            cpu += shares / 1024
            memory += limit
        return Resources(cpu, memory)

    def _resources(self, container_id: str) -> tuple[int, int]:
        """(cpu.shares, memory limit) of a container: the CRI field containerd 1.6 fills, else the OCI spec."""
        try:
            resp = self._call(_RT + "ContainerStatus", cri.ContainerStatusRequest(container_id=container_id),
                              cri.ContainerStatusResponse)
            if resp.status.HasField("resources") and resp.status.resources.HasField("linux"):
                r = resp.status.resources.linux
                return r.cpu_shares, max(0, r.memory_limit_in_bytes)
            resp = self._call(_RT + "ContainerStatus", cri.ContainerStatusRequest(
                container_id=container_id, verbose=True), cri.ContainerStatusResponse)
        except UpstreamError as exc:
            if exc.code is grpc.StatusCode.NOT_FOUND:
                return 0, 0
            raise
        try:
            spec = json.loads(resp.info.get("info", "{}")).get("runtimeSpec", {})
            r = spec.get("linux", {}).get("resources", {})
            return int(r.get("cpu", {}).get("shares") or 0), max(0, int(r.get("memory", {}).get("limit") or 0))
        except (ValueError, AttributeError, TypeError):
            return 0, 0

    def _hosted_limits(self) -> Resources:
        cpu, memory, count = 0.0, 0, 0
        for c in self._list(cri.CONTAINER_RUNNING):
            if ORIGIN_LABEL not in c.labels:
                continue
            count += 1
            try:
                c_cpu, c_mem = self._updated.get(c.id) or (float(c.annotations.get(CPU_LIMIT_ANNOTATION, "0")),
                                                           int(c.annotations.get(MEMORY_LIMIT_ANNOTATION, "0")))
            except ValueError:
                c_cpu, c_mem = 0.0, 0
            cpu += c_cpu
            memory += c_mem
        self.fabric.metrics.shadows_hosted.set(count)
        return Resources(cpu, memory)

    def _cached(self, name: str, compute: Callable[[], Resources]) -> Resources:
        with self._cache_lock:
            now = time.monotonic()
            hit = self._cache.get(name)
            if hit is not None and now - hit[0] < CAPACITY_TTL_S:
                return hit[1]
            try:
                value = compute()
            except WeftError as exc:  # a Hello must still be answered: the last known figures, or none
                _log.warning("shadow.capacity_failed", what=name, error=exc.message)
                return hit[1] if hit is not None else ZERO
            self._cache[name] = (now, value)
            return value

    def _forget_capacity(self) -> None:
        with self._cache_lock:
            self._cache.clear()


def _label(value: str) -> str:
    """Keys hold '/', and label values are kept short and plain: a stable digest names them."""
    return hashlib.sha256(value.encode()).hexdigest()[:40]


def _rmdir_up(path: Path, stop: Path) -> None:
    """Remove ``path`` and its parents while they are empty, up to (not including) ``stop``."""
    while path != stop and stop in path.parents:
        try:
            path.rmdir()
        except OSError:
            return
        path = path.parent


def _rmtree_quietly(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def shadow_cgroup(parent: str, uid: str, *, systemd: bool) -> str:
    """The shadow sandbox's cgroup parent under ``parent``, in the cgroup driver's own spelling."""
    if systemd:  # a slice: "weft_shadows-pod<uid>.slice" nests under weft_shadows.slice
        base = parent.strip("/").removesuffix(".slice").replace("-", "_") or "weft_shadows"
        return f"{base}-pod{uid.replace('-', '_')}.slice"
    return f"{parent.rstrip('/')}/pod{uid}"
