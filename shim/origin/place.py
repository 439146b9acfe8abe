"""The origin's side of rerouting one CPU container: decide, ask the peers in turn, or stay here.

Called by CreateContainer for a CPU-stage container of an opted-in pod on a
node with a mesh. The rules are ``shim.core.reroute``'s: the container must
be safe to move (no privilege, host namespace, host path, device or shared
pod volume; limits declared), and peers are ranked by the free capacity their
last Hello reported. Then each candidate in turn is asked to Admit (against
its real capacity now) and to create the shadow (RunShadow, not started: as
kubelet's CreateContainer, its StartContainer follows). The first that does
gets the container; kubelet gets a virtual container ID, written to the state
store before the answer. If every candidate refuses or fails, the container
runs locally: the scheduler reserved the whole pod here, so running locally
is always valid, and the reason says what each peer answered.

What travels: kubelet's sandbox and container config (mounts taken out), the
read-only volumes' files (ConfigMap, Secret, projected, and kubelet's
/etc/hosts), an image name the host can pull, and the credentials kubelet
used for that image (from ``pull_image``, memory only).
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import DecodeError

from shim import failpoint, log
from shim._pb import mesh_pb2 as pb
from shim.core.placement import PLACEMENT_ANNOTATION, PLACEMENT_REASON_ANNOTATION, PlacementReason, PlacementState
from shim.core.podspec import SpecFacts, spec_facts
from shim.core.reroute import (
    ContainerFacts,
    RerouteReason,
    Resources,
    classify_mounts,
    decide,
)
from shim.crishared import baseline
from shim.crishared.attempt import CreateAttempt, LocalBecause
from shim.crishared.containerd import Containerd
from shim.crishared.remote import REMOTE_PREFIX, PulledImages, Remote, new_id
from shim.crishared.sides import OriginFabric
from shim.errors import WeftError
from shim.mesh.client import PeerUnavailable
from shim.mesh.wire import MAX_MESSAGE_BYTES
from shim.origin.prepare import Prepared
from shim.origin.settings import OriginSettings, PodSpecOf
from shim.state.agent import PlacementRecord

if TYPE_CHECKING:
    from shim.mesh.node import MeshNode

_log = log.get("weft.cri")

# Copied volumes travel in memory, in RunShadowChunked's parts, to a tmpfs on the host: large volumes are what
# hostPath or a PVC are for.
MAX_VOLUME_BYTES = 32 << 20
# What RunShadow holds besides kubelet's configs and the credentials: the key, the origin's names, the limits.
_REQUEST_SLACK = 64 << 10
# A shadow may take minutes to create (the host pulls the image), but kubelet's CreateContainer has a
# deadline (runtimeRequestTimeout, 2 min by default): a host may use half of what is left, so that running
# the container here still fits in the rest.
MAX_SHADOW_WAIT_S = 300.0
MIN_SHADOW_WAIT_S = 5.0
_CREATED_OR_LATER = (cri.CONTAINER_CREATED, cri.CONTAINER_RUNNING, cri.CONTAINER_EXITED)
# An Admit that found its peer silent, rather than refused or busy.
_SILENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def limits_of(config: cri.ContainerConfig) -> Resources | None:
    res = config.linux.resources
    cpu = res.cpu_quota / res.cpu_period if res.cpu_quota > 0 and res.cpu_period > 0 else 0.0
    memory = res.memory_limit_in_bytes if res.memory_limit_in_bytes > 0 else 0
    if not cpu and not memory:
        return None
    return Resources(cpu, memory)


def _volume_name(host_path: str) -> str:
    return host_path.rstrip("/").rsplit("/", 1)[-1]


def facts_of(config: cri.ContainerConfig, sandbox: cri.PodSandboxConfig, pods_dir: str,
             spec: SpecFacts | None = None) -> ContainerFacts:
    """The safety facts of a CreateContainer; with the pod spec (``spec``), an emptyDir only this container
    mounts is not shared, and a container without limits is described by its requests."""
    sc, psc = config.linux.security_context, sandbox.linux.security_context
    ns = (sc.namespace_options, psc.namespace_options)
    mounts = classify_mounts(((m.host_path, m.container_path, m.readonly) for m in config.mounts), pods_dir,
                             pod_uid=sandbox.metadata.uid or None)
    # Without the pod spec weft cannot see which other containers of the pod mount an emptyDir (kubelet creates
    # them one by one), so every emptyDir counts as shared with one that stays.
    shared = tuple(m for m in mounts.pod_volumes
                   if spec is None or _volume_name(m) not in spec.private_empty_dirs)
    return ContainerFacts(
        privileged=sc.privileged or psc.privileged,
        host_network=any(o.network == cri.NODE for o in ns),
        host_pid=any(o.pid == cri.NODE for o in ns),
        host_ipc=any(o.ipc == cri.NODE for o in ns),
        host_path_mounts=mounts.host_path_mounts,
        writable_shared_mounts=shared,
        readonly_copyable_mounts=mounts.readonly_copyable,
        devices=tuple(d.host_path for d in config.devices) + tuple(d.name for d in config.CDI_devices),
        limits=limits_of(config) or (spec.requests if spec is not None else None),
        beyond_baseline=_beyond_baseline(config, sandbox),
    )


def _beyond_baseline(config: cri.ContainerConfig, sandbox: cri.PodSandboxConfig) -> str:
    decision = baseline.check(config, sandbox)
    return "" if decision.allowed else f"{decision.reason.value}: {decision.detail}"


def _read_tree(root: Path, budget: list[int]) -> list[pb.VolumeFile]:
    """The visible files under ``root`` (kubelet's atomic-writer ``..data`` links followed, never left)."""
    real_root = root.resolve()
    files: list[pb.VolumeFile] = []

    def walk(d: Path, rel: str) -> None:
        for entry in sorted(os.scandir(d), key=lambda e: e.name):
            if entry.name.startswith(".."):
                continue  # the atomic writer's ..data and timestamped directories
            path = Path(entry.path)
            real = path.resolve()
            if real != real_root and real_root not in real.parents:
                continue  # a link out of the volume: not the volume's content
            name = f"{rel}/{entry.name}" if rel else entry.name
            st = real.stat()
            if stat.S_ISDIR(st.st_mode):
                walk(path, name)
            elif stat.S_ISREG(st.st_mode):
                budget[0] -= st.st_size
                if budget[0] < 0:
                    raise _TooLarge(str(root))
                files.append(pb.VolumeFile(path=name, data=real.read_bytes(), mode=st.st_mode & 0o7777))

    walk(root, "")
    return files


class _TooLarge(Exception):
    pass


def read_volumes(config: cri.ContainerConfig, copyable: tuple[str, ...]) -> list[pb.Volume]:
    """The files of the container's read-only volumes and kubelet's /etc/hosts, for the host to mount."""
    budget = [MAX_VOLUME_BYTES]
    volumes: list[pb.Volume] = []
    wanted = set(copyable)
    for m in config.mounts:
        path = Path(os.path.normpath(m.host_path)) if m.host_path else None
        if path is None:
            continue
        if str(path) in wanted:
            if path.is_dir():
                volumes.append(pb.Volume(container_path=m.container_path, files=_read_tree(path, budget)))
            elif path.is_file():
                data = path.read_bytes()
                budget[0] -= len(data)
                if budget[0] < 0:
                    raise _TooLarge(str(path))
                volumes.append(pb.Volume(container_path=m.container_path, single_file=True, files=[
                    pb.VolumeFile(path="", data=data, mode=path.stat().st_mode & 0o7777)]))
        elif path.name == "etc-hosts" and m.container_path == "/etc/hosts" and path.is_file():
            volumes.append(pb.Volume(container_path="/etc/hosts", single_file=True, files=[
                pb.VolumeFile(path="", data=path.read_bytes(), mode=0o644)]))
    return volumes


def pullable(upstream: Containerd, images: PulledImages,
             image: cri.ImageSpec) -> tuple[cri.ImageSpec, cri.AuthConfig | None]:
    """An ImageSpec a host can pull (kubelet names the image by its local ID) and the credentials for it."""
    ref = image.image
    known = images.lookup(ref) or (images.lookup(image.user_specified_image) if image.user_specified_image else None)
    name = known[0] if known else (image.user_specified_image or ref)
    if not known and ref.startswith("sha256:"):
        status = upstream.channel.unary_unary(
            "/runtime.v1.ImageService/ImageStatus", request_serializer=cri.ImageStatusRequest.SerializeToString,
            response_deserializer=cri.ImageStatusResponse.FromString)(
            cri.ImageStatusRequest(image=cri.ImageSpec(image=ref)), timeout=10).image
        names = [*status.repo_digests, *status.repo_tags]
        if names:
            name = names[0]
            known = images.lookup(name)
    spec = cri.ImageSpec()
    spec.CopyFrom(image)
    spec.image = name
    return spec, (known[1] if known else None)


def pod_spec_of(pod_spec: PodSpecOf | None, sandbox: cri.PodSandboxConfig, name: str) -> tuple[SpecFacts | None, str]:
    """What the pod spec says of the container, from the node's pod cache, and which rules placement follows."""
    if pod_spec is None:
        return None, "no pod spec: no Kubernetes API, so every emptyDir counts as shared and limits are required"
    pod = pod_spec(sandbox.metadata.namespace, sandbox.metadata.name)
    if pod is None:
        return None, "pod spec not found: every emptyDir counts as shared and limits are required"
    facts = spec_facts(pod, name)
    if facts is None:
        return None, f"the pod spec has no container {name!r}: every emptyDir counts as shared"
    return facts, "pod spec read"


def _empty_dirs(config: cri.ContainerConfig, spec: SpecFacts | None) -> list[pb.EmptyDir]:
    """The container's emptyDirs only it mounts, for its host to make fresh."""
    if spec is None:
        return []
    return [pb.EmptyDir(container_path=m.container_path, size_limit=spec.private_empty_dirs[_volume_name(m.host_path)])
            for m in config.mounts if "kubernetes.io~empty-dir" in m.host_path
            and _volume_name(m.host_path) in spec.private_empty_dirs]


def reservation_lost_on(fabric: OriginFabric, sandbox_id: str, name: str, attempt: int) -> tuple[str, str] | None:
    """(host, reason) when the previous attempt of this container ran on a host that stopped it because its
    reservation there was lost (refused, evicted, preempted, deleted); None otherwise."""
    for r in fabric.remotes.all():
        if (r.sandbox_id == sandbox_id and r.config.metadata.name == name and r.config.metadata.attempt == attempt - 1
                and r.status is not None and r.status.reason.startswith("Reservation")):
            return r.node, r.status.reason
    return None


def place_remote(fabric: OriginFabric, a: CreateAttempt, budget_s: float | None = None, *, mesh: MeshNode,
                 settings: OriginSettings, images: PulledImages, pod_spec: PodSpecOf | None = None,
                 prepared: Prepared | None = None) -> tuple[Remote | None, LocalBecause | None]:
    """Run the container on a peer: the Remote kubelet now knows, or why it stays here.

    ``budget_s`` is what is left of kubelet's deadline for the call (None: no deadline).
    """
    started = time.monotonic()
    req = a.req
    config, sandbox_config = req.config, req.sandbox_config
    spec, rules = pod_spec_of(pod_spec, sandbox_config, config.metadata.name)
    if spec is not None and spec.init:
        return None, LocalBecause(PlacementReason.INIT_CONTAINER, f"an init container runs on the pod's node ({rules})")
    facts = facts_of(config, sandbox_config, settings.pods_dir, spec)
    pod = f"{sandbox_config.metadata.uid}/{sandbox_config.metadata.attempt}"
    decision = decide(facts, facts.limits or Resources(0.0, 0), mesh.views(), max_age_s=settings.peer_max_age_s,
                      spread=mesh.spread(pod))
    if decision.reason is not RerouteReason.REROUTED:
        return None, LocalBecause(PlacementReason(decision.reason.value), f"{decision.detail} ({rules})")
    try:
        volumes = read_volumes(config, facts.readonly_copyable_mounts)
    except _TooLarge as exc:
        return None, LocalBecause(PlacementReason.VOLUMES_TOO_LARGE, f"read-only volume {exc} holds more than "
                                  f"{MAX_VOLUME_BYTES >> 20} MiB; it is not copied to a peer")
    except OSError as exc:
        return None, LocalBecause(PlacementReason.VOLUMES_TOO_LARGE, f"cannot read a read-only volume to copy: {exc}")
    image, auth = pullable(fabric.upstream, images, config.image)
    shadow_config = cri.ContainerConfig()
    shadow_config.CopyFrom(config)
    del shadow_config.mounts[:]
    shadow_config.image.CopyFrom(image)
    # RunShadow carries the configs in one message (only volumes come in parts); one larger than a mesh message
    # would fail at every peer alike. kubelet's hold so much only with an environment and arguments past what
    # the kernel lets a process start with, so the container fails here as it would without weft.
    configs = sandbox_config.ByteSize() + shadow_config.ByteSize() + (auth.ByteSize() if auth is not None else 0)
    if configs + _REQUEST_SLACK > MAX_MESSAGE_BYTES:
        return None, LocalBecause(PlacementReason.CONFIG_TOO_LARGE, f"its sandbox and container configs hold "
                                  f"{configs} bytes, more than a mesh message carries ({MAX_MESSAGE_BYTES} bytes)")
    limits = facts.limits
    tried: list[str] = []
    candidates = (prepared.order(decision.candidates, sandbox_config) if prepared is not None
                  else decision.candidates)
    lost = reservation_lost_on(fabric, req.pod_sandbox_id, config.metadata.name, config.metadata.attempt)
    if lost is not None:  # Kubernetes took the last attempt's CPU away there: placed afresh, elsewhere or here
        candidates = [n for n in candidates if n != lost[0]]
        tried.append(f"{lost[0]}: not asked again, the last attempt's reservation there was lost ({lost[1]})")
    for node in candidates:
        client = mesh.client(node)
        if client is None:
            tried.append(f"{node}: no longer a peer")
            continue
        try:
            answer = client.admit(pb.AdmitRequest(
                origin_node=mesh.node, key=a.key, image=image.image,
                limits=pb.Resources(cpu_cores=limits.cpu_cores, memory_bytes=limits.memory_bytes)))
        except WeftError as exc:
            tried.append(f"{node}: {exc.message}")
            if isinstance(exc, PeerUnavailable) and exc.status in _SILENT:
                mesh.unreachable(node, exc.message)  # the next placements skip it until a Hello reaches it
            continue
        if not answer.admitted:
            tried.append(f"{node}: {answer.reason} ({answer.detail})")
            continue
        detail = f"{decision.detail}; runs on {node}" + (f" after {'; '.join(tried)}" if tried else "")
        left = MAX_SHADOW_WAIT_S if budget_s is None else (budget_s - (time.monotonic() - started)) / 2
        if left < MIN_SHADOW_WAIT_S:
            tried.append(f"{node}: not asked, too little of kubelet's deadline left ({left:.1f} s)")
            break
        created = _create_on(fabric, mesh, ShadowCreate(
            a, node, f"{detail} ({rules})", shadow_config, auth, volumes, min(left, MAX_SHADOW_WAIT_S),
            admitted=limits if limits_of(config) is None else None,  # by requests
            empty_dirs=_empty_dirs(config, spec)))
        if isinstance(created, Remote):
            return created, None
        tried.append(created)
    return None, LocalBecause(PlacementReason.PEERS_REFUSED, "; ".join(tried))


@dataclass(frozen=True)
class ShadowCreate:
    """One try at running the container on a host: what its RunShadow carries besides the attempt itself."""

    attempt: CreateAttempt
    node: str
    # The placement's reason, as crictl and weft explain show it.
    detail: str
    # The container's config as the host gets it: mounts left out, the image named so a host can pull it.
    shadow_config: cri.ContainerConfig
    auth: cri.AuthConfig | None
    # Read-only volumes copied to the host.
    volumes: list[pb.Volume]
    timeout: float
    # What the host admitted by the container's requests (None: by its limits).
    admitted: Resources | None = None
    # The emptyDirs only this container mounts, made fresh on the host.
    empty_dirs: list[pb.EmptyDir] = field(default_factory=list)


def _create_on(fabric: OriginFabric, mesh: MeshNode, c: ShadowCreate) -> Remote | str:
    """The Remote now running on ``c.node``, or what that host said (for the placement's detail)."""
    a, node, shadow_config, auth, admitted = c.attempt, c.node, c.shadow_config, c.auth, c.admitted
    req, sandbox, key, classification, detail = a.req, a.sandbox, a.key, a.classification, c.detail
    config = cri.ContainerConfig()
    config.CopyFrom(req.config)
    config.annotations[PLACEMENT_ANNOTATION] = REMOTE_PREFIX + node
    config.annotations[PLACEMENT_REASON_ANNOTATION] = RerouteReason.REROUTED.value
    shadow_config.annotations[PLACEMENT_ANNOTATION] = REMOTE_PREFIX + node
    shadow_config.annotations[PLACEMENT_REASON_ANNOTATION] = RerouteReason.REROUTED.value
    log_path = (os.path.join(req.sandbox_config.log_directory, config.log_path)
                if req.sandbox_config.log_directory and config.log_path else "")
    vid = new_id()
    record = PlacementRecord(
        key=key, container_id=vid, sandbox_id=sandbox.id, name=config.metadata.name,
        attempt=config.metadata.attempt, stage=classification.stage.value,
        stage_reason=classification.reason.value, stage_detail=classification.detail,
        placement=REMOTE_PREFIX + node, reason=RerouteReason.REROUTED.value, detail=detail, lease_id="",
        state=PlacementState.PENDING, created_at=time.time(), remote_node=node, config=config.SerializeToString(),
        log_path=log_path)
    client = mesh.client(node)
    fabric.store.add_pending(record)
    try:
        failpoint.hit("place_remote.pending")
        state = client.run_shadow(pb.RunShadowRequest(
            origin_node=mesh.node, origin_sandbox_id=record.sandbox_id, key=key,
            sandbox_config=req.sandbox_config.SerializeToString(),
            container_config=shadow_config.SerializeToString(),
            auth=auth.SerializeToString() if auth is not None else b"", start=False, volumes=c.volumes,
            admitted=(pb.Resources(cpu_cores=admitted.cpu_cores, memory_bytes=admitted.memory_bytes)
                      if admitted is not None else None),
            empty_dirs=c.empty_dirs),
            timeout=c.timeout)
        failpoint.hit("place_remote.created")
        status = cri.ContainerStatus.FromString(state.status) if state.status else None
        if not state.shadow_container_id or (status is not None and status.state not in _CREATED_OR_LATER):
            raise DecodeError("no shadow container in the answer")
    except (WeftError, DecodeError) as exc:
        fabric.store.drop_placement(key)
        error = exc.message if isinstance(exc, WeftError) else f"answered RunShadow with garbage ({exc})"
        # The shadow may exist though the answer was lost or unreadable: ask for its removal now; the
        # host's Watch also removes it as an orphan, since this origin no longer lists its key.
        with contextlib.suppress(WeftError):
            client.remove_shadow(mesh.node, key)
        _log.warning("remote.create_failed", node=node, key=key, error=error)
        return f"{node}: {error}"
    fabric.store.mark_created(key, record.container_id, sandbox_id_remote=state.shadow_sandbox_id,
                              status=state.status or None, note=f"{node}: {state.note}" if state.note else "")
    remote = Remote(id=record.container_id or "", key=key, node=node, sandbox_id=record.sandbox_id, config=config,
                    log_path=record.log_path, created_at=record.created_at, status=status,
                    shadow_sandbox_id=state.shadow_sandbox_id)
    fabric.remotes.add(remote)
    return remote
