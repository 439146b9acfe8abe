"""Where a classified container runs, and why.

On a node without a peer mesh every container of an opted-in pod runs
locally; the reason says which rule kept it here, so ``weft explain`` can
answer "why is my CPU stage still on the GPU node". GPU containers run
locally on leased devices. The GPU ask (memory, compute, devices) is read from
the pod's annotations here, so its errors name the annotation.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

from shim.core.classify import Classification, Stage
from shim.core.quantity import parse_compute, parse_memory

GPU_MEMORY_ANNOTATION = "weft.io/gpu-memory."
GPU_COMPUTE_ANNOTATION = "weft.io/gpu-compute."
PLACEMENT_ANNOTATION = "weft.io/placement"
PLACEMENT_REASON_ANNOTATION = "weft.io/placement-reason"
LEASE_ANNOTATION = "weft.io/lease"
LOCAL = "local"


class PlacementReason(enum.Enum):
    GPU_LEASED = "gpu-leased"  # gpu stage: runs here on devices the broker leased
    PINNED_LOCAL = "pinned-local"  # weft.io/stage.<c>: local
    NO_MESH = "no-mesh"  # cpu stage, but this node has no peer mesh: runs here
    # A CPU stage on a node with a mesh (shim.core.reroute decides; shim.origin.place asks the peers):
    REROUTED = "rerouted"  # runs on a peer (target "remote:<node>")
    NO_PEERS = "no-peers"  # no fresh, healthy CPU host known: runs here
    NO_PEER_FITS = "no-peer-fits"  # CPU hosts known, none with room: runs here
    UNSAFE = "unsafe"  # privileged, host namespace, host path, device, shared volume or no limits: runs here
    PEERS_REFUSED = "peers-refused"  # every candidate refused at Admit or failed to create it: runs here
    VOLUMES_TOO_LARGE = "volumes-too-large"  # its read-only volumes are too large (or unreadable) to copy
    CONFIG_TOO_LARGE = "config-too-large"  # kubelet's configs of it hold more than a mesh message carries
    INIT_CONTAINER = "init-container"  # the pod spec says it is an init container: it runs on the pod's node


class PlacementState(enum.Enum):
    """Where a placement record stands::

        PENDING --created--> CREATED

    A placement is written PENDING before containerd (or a host) creates the
    container, so a crash in between leaves a record that recovery settles
    (the container removed, the lease released); CREATED once kubelet has its
    container ID.
    """

    PENDING = "pending"
    CREATED = "created"


@dataclass(frozen=True)
class Placement:
    stage: Stage
    target: str  # "local", or "remote:<node>"
    reason: PlacementReason
    detail: str


def place(classification: Classification) -> Placement:
    stage = classification.stage
    if stage is Stage.GPU:
        return Placement(stage, LOCAL, PlacementReason.GPU_LEASED, "GPU stage runs on this node's leased GPUs")
    if stage is Stage.LOCAL:
        return Placement(stage, LOCAL, PlacementReason.PINNED_LOCAL, classification.detail)
    return Placement(stage, LOCAL, PlacementReason.NO_MESH, "no peer mesh on this node: the CPU stage runs locally")


@dataclass(frozen=True)
class GpuAsk:
    memory_bytes: int | None  # None: whole device(s)
    compute_percent: int  # 1..100


def gpu_ask(container: str, pod_annotations: Mapping[str, str], largest_device_bytes: int | None) -> GpuAsk:
    """Read ``weft.io/gpu-memory.<c>`` / ``weft.io/gpu-compute.<c>``; raises AnnotationError naming the bad one.

    A memory share without a compute share gets the same fraction of compute
    (20Gi of an 80Gi device: 25%), so packing by memory is not blocked by a
    default 100% compute reservation; no annotation at all means a whole device.
    """
    mem_key, cpu_key = GPU_MEMORY_ANNOTATION + container, GPU_COMPUTE_ANNOTATION + container
    memory = None
    if mem_key in pod_annotations:
        memory = parse_memory(mem_key, pod_annotations[mem_key], max_bytes=largest_device_bytes)
    if cpu_key in pod_annotations:
        compute = parse_compute(cpu_key, pod_annotations[cpu_key])
    elif memory is not None and largest_device_bytes:
        compute = max(1, min(100, math.ceil(memory * 100 / largest_device_bytes)))
    else:
        compute = 100
    return GpuAsk(memory, compute)
