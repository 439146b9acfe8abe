"""CreateContainer: classify, place, lease and rewrite the containers of opted-in pods.

For a pod that did not opt in the request is forwarded byte for byte. For an
opted-in pod each container is classified (``shim.core.classify``) and placed
(``shim.core.placement``); on a node with a mesh a CPU container may go to a
peer (``shim.origin.place``), and kubelet gets a virtual container ID; a
GPU container gets a lease from the broker and
its request is rewritten so it sees exactly the leased devices (device nodes,
CDI devices, visible-devices variables, and for a shared device the MPS
environment and pipe directory). The decision is shown to crictl as
annotations, logged as ``placement.decided`` and counted.

Order, so that a crash at any point loses nothing: lease (broker store) ->
pending placement (agent store) -> containerd CreateContainer -> placement
marked created -> answer. A failure after the lease releases it; a crash is
settled on restart (``shim.cri.recovery``).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Mapping

import grpc
from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import DecodeError

from shim import failpoint, log
from shim._pb import broker_pb2 as pb
from shim.core import kai
from shim.core.cdi import GPU_CDI as _GPU_CDI
from shim.core.cdi import claim_gpus, names_gpu_itself, resolve
from shim.core.classify import ContainerAsk, Stage, StageAnnotationError, classify, requested_gpus
from shim.core.kai import ShareSource
from shim.core.placement import (
    GPU_COMPUTE_ANNOTATION,
    GPU_MEMORY_ANNOTATION,
    LEASE_ANNOTATION,
    LOCAL,
    PLACEMENT_ANNOTATION,
    PLACEMENT_REASON_ANNOTATION,
    GpuAsk,
    Placement,
    PlacementReason,
    PlacementState,
    gpu_ask,
    place,
)
from shim.core.quantity import AnnotationError
from shim.cri.fabric import Fabric
from shim.cri.instrument import note_pod
from shim.cri.passthrough import timeout_of
from shim.cri.route import Route
from shim.cri.wire import string_field
from shim.crishared.attempt import CreateAttempt
from shim.crishared.remote import REMOTE_PREFIX as PLACEMENT_REMOTE
from shim.errors import BadAnnotation, CreateInProgress, MalformedRequest
from shim.state.agent import PlacementRecord, SandboxRecord
from shim.state.db import StateError

PATH = "/runtime.v1.RuntimeService/CreateContainer"
SANDBOX_ID_FIELD = cri.CreateContainerRequest.DESCRIPTOR.fields_by_name["pod_sandbox_id"].number
_log = log.get("weft.cri")

# Every GPU node the device plugin may have given; after leasing the container
# gets the lease's nodes only, so it cannot reach a device outside its lease.
_GPU_NODE = re.compile(r"^/dev/(nvidia\d+|nvidiactl|nvidia-uvm(-tools)?|nvidia-modeset|nvidia-caps/.*|dri/.*)$")
_VISIBLE = ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


# Where NVIDIA's runtime takes a device list from mounts (accept-nvidia-visible-devices-as-volume-mounts), and
# the container annotations through which containerd and NVIDIA's runtime in CDI mode take CDI devices.
_DEVICE_MOUNTS = "/var/run/nvidia-container-devices"
_CDI_ANNOTATION = "cdi.k8s.io/"


def _gpu_cdi_annotations(config: cri.ContainerConfig) -> list[str]:
    """Container annotations that ask containerd or NVIDIA's runtime (CDI mode) for a GPU CDI device."""
    return [k for k, v in config.annotations.items()
            if k.startswith(_CDI_ANNOTATION) and any(_GPU_CDI.match(n.strip()) for n in v.split(","))]


def rewrite_without_gpus(config: cri.ContainerConfig, claimed: Mapping[str, frozenset[str]] | None = None) -> list[
        str]:
    """Make a container of an opted-in pod that holds no lease see no GPU, whatever runtime runs it (pure: edits
    the message in place); what was taken, for the log.

    The ``weft`` handler copies containerd's default runtime, which on a GPU Operator's node is NVIDIA's: in its
    legacy mode it gives a container every GPU its ``NVIDIA_VISIBLE_DEVICES`` names, and CUDA base images set
    ``all`` in their own environment, which the CRI request does not show. A variable of the request wins over
    the image's, so ``void`` here closes that; GPU device nodes, GPU CDI devices (a claim's too), device-list
    mounts and CDI annotations go with it.
    """
    claimed = claimed or {}
    taken: list[str] = []
    gpu_nodes = [d.host_path for d in config.devices if _GPU_NODE.match(d.host_path)]
    if gpu_nodes:
        kept = [d for d in config.devices if not _GPU_NODE.match(d.host_path)]
        del config.devices[:]
        config.devices.extend(kept)
        taken += gpu_nodes
    gpu_cdi = [d.name for d in config.CDI_devices if _GPU_CDI.match(d.name) or d.name in claimed]
    if gpu_cdi:
        kept_cdi = [d.name for d in config.CDI_devices if d.name not in gpu_cdi]
        del config.CDI_devices[:]
        for name in kept_cdi:
            config.CDI_devices.add(name=name)
        taken += gpu_cdi
    mounts = [m.container_path for m in config.mounts if m.container_path.startswith(_DEVICE_MOUNTS)]
    if mounts:
        kept_mounts = [m for m in config.mounts if not m.container_path.startswith(_DEVICE_MOUNTS)]
        del config.mounts[:]
        config.mounts.extend(kept_mounts)
        taken += mounts
    for key in _gpu_cdi_annotations(config):
        del config.annotations[key]
        taken.append(key)
    asked = [f"{e.key}={e.value}" for e in config.envs if e.key == "NVIDIA_VISIBLE_DEVICES"
             and e.value not in ("void", "")]
    kept_env = [(e.key, e.value) for e in config.envs if e.key != "NVIDIA_VISIBLE_DEVICES"]
    del config.envs[:]
    for key, value in [*kept_env, ("NVIDIA_VISIBLE_DEVICES", "void")]:
        config.envs.add(key=key, value=value)
    return taken + asked


def rewrite_for_lease(config: cri.ContainerConfig, lease: pb.Lease,
                      claimed: Mapping[str, frozenset[str]] | None = None) -> None:
    """Make the container see exactly its leased devices (pure: edits the message in place).

    ``claimed`` are its DRA claim's CDI devices with their GPUs: the ones whose GPUs are all leased
    stay, so the runtime applies the driver's edits for them; the others go. A vendor's own GPU
    CDI names are replaced by the leased UUIDs'.
    """
    claimed = claimed or {}
    leased = set(lease.device_uuids)
    used_cdi = any(_GPU_CDI.match(d.name) and d.name not in claimed for d in config.CDI_devices)
    kept_devices = [d for d in config.devices if not _GPU_NODE.match(d.host_path)]
    del config.devices[:]
    config.devices.extend(kept_devices)
    for node in lease.device_nodes:
        config.devices.add(container_path=node, host_path=node, permissions="rw")
    kept_cdi = [d.name for d in config.CDI_devices
                if (claimed[d.name] <= leased if d.name in claimed else not _GPU_CDI.match(d.name))]
    del config.CDI_devices[:]
    for name in kept_cdi:
        config.CDI_devices.add(name=name)
    if used_cdi:  # keep the runtime injecting driver libraries, now for the leased UUIDs
        for uuid in lease.device_uuids:
            config.CDI_devices.add(name=f"nvidia.com/gpu={uuid}")
    replaced = {**{v: ",".join(lease.device_uuids) for v in _VISIBLE}, **dict(lease.env)}
    kept_env = [(e.key, e.value) for e in config.envs if e.key not in replaced]
    del config.envs[:]
    for key, value in [*kept_env, *sorted(replaced.items())]:
        config.envs.add(key=key, value=value)
    listed = [m for m in config.mounts if m.container_path.startswith(_DEVICE_MOUNTS)]
    if listed:  # the device plugin lists devices as mounts: the leased ones, and no other
        kept_mounts = [m for m in config.mounts if not m.container_path.startswith(_DEVICE_MOUNTS)]
        del config.mounts[:]
        config.mounts.extend(kept_mounts)
        for uuid in lease.device_uuids:
            config.mounts.add(container_path=f"{_DEVICE_MOUNTS}/{uuid}", host_path="/dev/null", readonly=True)
    for key in _gpu_cdi_annotations(config):  # the leased GPUs come by CDI_devices and the variables above
        del config.annotations[key]
    for m in lease.mounts:
        config.mounts.add(container_path=m.container_path, host_path=m.host_path, readonly=m.readonly)
    config.annotations[LEASE_ANNOTATION] = lease.lease_id


def route(fabric: Fabric) -> Route:
    def create_container(request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            req = cri.CreateContainerRequest.FromString(request)
        except DecodeError as exc:
            # containerd may accept what protobuf refuses (it does not check UTF-8); a container of an
            # opted-in pod must never be created without weft placing it, so that one is refused.
            sandbox_id = string_field(request, SANDBOX_ID_FIELD)
            if sandbox_id and sandbox_id in fabric.opted_in:
                raise MalformedRequest(f"weft: CreateContainer in opted-in sandbox {sandbox_id[:13]} does not "
                                       f"parse ({exc}); weft places every container of an opted-in pod") from None
            return fabric.upstream.unary(PATH, request, context)
        note_pod(req.sandbox_config.metadata.name, req.sandbox_config.metadata.namespace)
        sandbox = fabric.opted_in.get(req.pod_sandbox_id)
        if sandbox is None:
            return fabric.upstream.unary(PATH, request, context)
        return _create_opted_in(fabric, req, sandbox, context)

    return Route(create_container)


def _create_opted_in(fabric: Fabric, req: cri.CreateContainerRequest, sandbox: SandboxRecord, context) -> bytes:
    config = req.config
    name, attempt = config.metadata.name, config.metadata.attempt
    pod_annotations = dict(req.sandbox_config.annotations) or sandbox.annotations
    cdi_names = [d.name for d in config.CDI_devices]
    # Only a CDI device whose name does not say which GPU it is sends weft to the node's CDI specs.
    claimed = claim_gpus(cdi_names, fabric.cdi_specs.gpus()) if any(
        not names_gpu_itself(n) for n in cdi_names) else {}
    ask = ContainerAsk(name, [d.host_path for d in config.devices], cdi_names,
                       {e.key: e.value for e in config.envs}, claimed)
    try:
        classification = classify(ask, pod_annotations)
    except StageAnnotationError as exc:
        raise BadAnnotation(str(exc)) from None
    placement = place(classification)
    key = f"{sandbox.id}/{name}/{attempt}"
    if classification.stage is not Stage.GPU:
        # Only weft writes this annotation; one a user set could name another container's lease.
        config.annotations.pop(LEASE_ANNOTATION, None)
    done = fabric.store.placement_by_key(key)
    if done is not None and done.state is PlacementState.CREATED and done.remote and done.container_id:
        # kubelet retrying a create whose answer it lost: the container is on its host already.
        return cri.CreateContainerResponse(container_id=done.container_id).SerializeToString()
    if done is not None and done.state is PlacementState.CREATED:
        # kubelet retrying a create that succeeded: containerd answers as it would without
        # weft (the name is taken); weft's records and the lease stay as they are.
        return fabric.upstream.unary(PATH, req.SerializeToString(), context)
    if not fabric.begin(key):
        raise CreateInProgress(f"a CreateContainer for {sandbox.namespace}/{sandbox.name}/{name} "
                               f"(attempt {attempt}) is already in progress")
    try:
        return _lease_and_create(fabric, CreateAttempt(req, sandbox, key, ask, pod_annotations, classification),
                                 placement, context)
    finally:
        fabric.end(key)


def _lease_and_create(fabric: Fabric, a: CreateAttempt, placement: Placement, context) -> bytes:
    req, sandbox, key, classification = a.req, a.sandbox, a.key, a.classification
    config, name, attempt = a.config, a.name, a.attempt
    if classification.stage is not Stage.GPU:
        taken = rewrite_without_gpus(config, a.ask.claim_gpus)
        if taken:
            _log.info("placement.gpu_access_removed", pod=sandbox.name, namespace=sandbox.namespace, container=name,
                      stage=classification.stage.value, taken=taken)
    if classification.stage is Stage.CPU and fabric.origin is not None:
        remote, local = fabric.origin.place(fabric, a, timeout_of(context))
        if remote is not None:
            fabric.metrics.placements.labels(classification.stage.value, "remote",
                                             PlacementReason.REROUTED.value).inc()
            _log.info("placement.decided", pod=sandbox.name, namespace=sandbox.namespace, container=name,
                      sandbox_id=sandbox.id, container_id=remote.id, stage=classification.stage.value,
                      stage_reason=classification.reason.value, placement=PLACEMENT_REMOTE + remote.node,
                      reason=PlacementReason.REROUTED.value)
            return cri.CreateContainerResponse(container_id=remote.id).SerializeToString()
        placement = Placement(classification.stage, LOCAL, local.reason, local.detail)
    lease: pb.Lease | None = None
    if classification.stage is Stage.GPU:
        with fabric.lease_gate:
            lease, share = _acquire(fabric, a)
        placement = Placement(placement.stage, placement.target, placement.reason, f"{placement.detail}; share {share}")
        by_index = {d.index: d.uuid for d in fabric.inventory().devices}
        rewrite_for_lease(config, lease, {n: resolve(g, by_index) for n, g in a.ask.claim_gpus.items()})
    config.annotations[PLACEMENT_ANNOTATION] = placement.target
    config.annotations[PLACEMENT_REASON_ANNOTATION] = placement.reason.value
    record = PlacementRecord(
        key=key, container_id=None, sandbox_id=sandbox.id, name=name, attempt=attempt,
        stage=classification.stage.value, stage_reason=classification.reason.value,
        stage_detail=classification.detail, placement=placement.target, reason=placement.reason.value,
        detail=placement.detail, lease_id=lease.lease_id if lease else "", state=PlacementState.PENDING,
        created_at=time.time())
    try:
        fabric.store.add_pending(record)
        failpoint.hit("create_container.pending")
        response = fabric.upstream.unary(PATH, req.SerializeToString(), context)
        failpoint.hit("create_container.created")
        container_id = cri.CreateContainerResponse.FromString(response).container_id
        fabric.store.mark_created(key, container_id)
    except BaseException:
        if lease is not None:
            fabric.release_quietly(lease.lease_id, "create-failed")
        # On a full disk even this may fail; a pending row left behind is settled by recovery.
        with contextlib.suppress(StateError):
            fabric.store.drop_placement(key)
        raise
    fabric.metrics.placements.labels(record.stage, record.placement, record.reason).inc()
    _log.info("placement.decided", pod=sandbox.name, namespace=sandbox.namespace, container=name,
              sandbox_id=sandbox.id, container_id=container_id, stage=record.stage, stage_reason=record.stage_reason,
              placement=record.placement, reason=record.reason, lease=record.lease_id or None)
    return response


def _acquire(fabric: Fabric, a: CreateAttempt) -> tuple[pb.Lease, str]:
    """The container's lease, and where its share came from (``shim.core.kai.ShareSource`` and what it read)."""
    sandbox, ask, name = a.sandbox, a.ask, a.name
    inventory = fabric.inventory()
    devices = list(inventory.devices)
    largest = max((d.memory_total for d in devices), default=None)
    count, allowed = requested_gpus(ask, [d.uuid for d in devices], {d.index: d.uuid for d in devices})
    envs = dict(ask.envs or {})
    weft_share = any(k + name in a.pod_annotations for k in (GPU_MEMORY_ANNOTATION, GPU_COMPUTE_ANNOTATION))
    try:
        if not weft_share and kai.is_kai_container(name, a.pod_annotations, envs):
            # KAI's share, on the GPU its binder reserved (weft's own annotations win where both are set).
            given = kai.gpus(envs)
            device = next((d for d in devices if given and d.uuid == given[0]), None)
            ks = kai.share(f"{sandbox.namespace}/{sandbox.name}", name, a.pod_annotations, envs,
                           device.memory_total if device is not None else (largest or 0))
            if len(given) != 1:
                visible = envs.get("NVIDIA_VISIBLE_DEVICES")
                raise BadAnnotation(f"pod {sandbox.namespace}/{sandbox.name}: KAI's share for {name} names "
                                    f"{len(given)} GPUs in NVIDIA_VISIBLE_DEVICES ({visible!r}); a share is on one GPU")
            gask, source = GpuAsk(ks.memory_bytes, ks.compute_percent), f"{ks.source.value}: {ks.detail}"
            count, allowed = 1, frozenset(given)
        else:
            gask = gpu_ask(name, a.pod_annotations, largest)
            source = (f"{ShareSource.WEFT_ANNOTATION.value}: {gask.memory_bytes >> 20} MiB, "
                      f"{gask.compute_percent}% compute") if gask.memory_bytes is not None or weft_share else \
                ShareSource.WHOLE_DEVICE.value
    except AnnotationError as exc:
        raise BadAnnotation(str(exc)) from None
    lease = fabric.require_broker().acquire(pb.AcquireRequest(
        key=a.key, namespace=sandbox.namespace, pod=sandbox.name, pod_uid=sandbox.uid, container=name,
        sandbox_id=sandbox.id, memory_bytes=gask.memory_bytes or 0, compute_percent=gask.compute_percent,
        count=count, allowed_uuids=sorted(allowed) if allowed else []))
    failpoint.hit("create_container.leased")
    return lease, source
