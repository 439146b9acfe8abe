"""What a pod asks of the cluster in each mode, decided once per pod by the agent's own rules.

The weft run must make the decisions the agent would make, so this is where
the simulator calls the pure decision code of ``shim.core`` rather than
restating it: each container is described as the ``ContainerAsk`` kubelet's
CreateContainer would give (the GPU stage carries ``NVIDIA_VISIBLE_DEVICES``
from the device plugin, the CPU stage nothing), classified by
:func:`~shim.core.classify.classify`, given its reason by
:func:`~shim.core.placement.place`, and the GPU stage's lease is read from the
pod's annotations by :func:`~shim.core.placement.gpu_ask` and
:func:`~shim.core.classify.requested_gpus`. What depends on the cluster's
state at the time (which device, which peer) is left to the engine, which
asks :func:`~shim.core.packing.pack` and :func:`~shim.core.reroute.decide`.

A bundled pod is what Kubernetes does without weft: every container's
requests and whole GPUs on one node. A pod under KAI's GPU fractions
(``Mode.KAI``) is bundled the same way, but its GPU stage asks for a share
of one GPU: the share it declares, read and packed by the very code that
sizes and packs weft's leases (:func:`gpu_share_ask`), so that the two differ
only in what enforces the share (the engine: nothing under KAI).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from shim.core.classify import ContainerAsk, Stage, StageAnnotationError, classify, requested_gpus
from shim.core.packing import Ask
from shim.core.placement import gpu_ask, place
from shim.core.quantity import AnnotationError
from shim.core.reroute import Resources
from shim.sim.model import SPLIT_REQUEST, Mode, PodSpec

BUNDLED_REASON = "bundled"
KAI_REASON = "kai-fraction"
SCHEDULED_REASON = "scheduled"


@dataclass(frozen=True)
class Plan:
    needs_gpu_node: bool
    node_request: Resources  # what the scheduler books on the node it binds the pod to
    ask: Ask | None  # the GPU ask handed to pack(); None for a pod without a GPU stage
    gpu_container: str
    # CPU-stage containers weft tries to move: (name, limits the peer admits, request booked on the GPU node)
    reroutes: tuple[tuple[str, Resources, Resources], ...]
    # Containers that stay where the pod is bound, with their reason: (name, reason)
    stays: tuple[tuple[str, str], ...]
    error: str  # non-empty: no cluster could run this pod as declared (a bad annotation, say)

    @property
    def shape(self) -> tuple:
        """Everything that decides whether the pod fits a node: pods of one shape fit or fail together."""
        ask = self.ask
        return (self.needs_gpu_node, self.node_request.cpu_cores, self.node_request.memory_bytes,
                None if ask is None else (ask.memory_bytes, ask.compute_percent, ask.count))


def _sum(parts: list[Resources]) -> Resources:
    return Resources(sum(p.cpu_cores for p in parts), sum(p.memory_bytes for p in parts))


def visible_devices(gpus: int) -> str:
    """``NVIDIA_VISIBLE_DEVICES`` as the NVIDIA device plugin sets it for ``gpus`` devices."""
    return ",".join(str(k) for k in range(gpus))


def plan_pod(pod: PodSpec, mode: Mode, device_bytes: int) -> Plan:
    if pod.gpu is None:
        # A plain CPU pod: not a GPU pod, so not weft's to split; the scheduler puts it on a CPU node.
        stays = tuple((c.name, SCHEDULED_REASON) for c in pod.cpu)
        return Plan(False, pod.total_cpu, None, "", (), stays, "")
    gpu = pod.gpu
    if mode is Mode.BUNDLED:
        stays = tuple((name, BUNDLED_REASON) for name in [c.name for c in pod.cpu] + [gpu.name])
        return Plan(True, pod.total_cpu, Ask(None, count=gpu.gpus), gpu.name, (), stays, "")
    try:
        if mode is Mode.KAI:
            # Bundled as the scheduler books it; the GPU stage's share as weft would lease it, unenforced.
            stays = (*((c.name, BUNDLED_REASON) for c in pod.cpu), (gpu.name, KAI_REASON))
            return Plan(True, pod.total_cpu, gpu_share_ask(gpu.name, pod.annotations, device_bytes, gpu.gpus),
                        gpu.name, (), stays, "")
        return _plan_weft(pod, mode, device_bytes)
    except (StageAnnotationError, AnnotationError) as exc:
        return Plan(True, pod.total_cpu, None, gpu.name, (), (), str(exc))


def gpu_share_ask(container: str, annotations: Mapping[str, str], device_bytes: int, count: int) -> Ask:
    """The ask handed to ``pack()`` for a GPU stage: its declared memory share (``placement.gpu_ask``) on one GPU,
    or ``count`` whole devices where it declares none or needs several GPUs (a share is one device's worth)."""
    share = gpu_ask(container, annotations, device_bytes)
    if share.memory_bytes is not None and count == 1:
        return Ask(share.memory_bytes, share.compute_percent)
    return Ask(None, count=count)


def _plan_weft(pod: PodSpec, mode: Mode, device_bytes: int) -> Plan:
    gpu = pod.gpu
    assert gpu is not None
    annotations = pod.annotations
    gpu_container = ContainerAsk(gpu.name, envs={"NVIDIA_VISIBLE_DEVICES": visible_devices(gpu.gpus)})
    classification = classify(gpu_container, annotations)
    count, _domain = requested_gpus(gpu_container, (), {})
    booked = [gpu.host]
    stays: list[tuple[str, str]] = []
    reroutes: list[tuple[str, Resources, Resources]] = []
    if classification.stage is Stage.GPU:
        ask = gpu_share_ask(gpu.name, annotations, device_bytes, count)
    elif classification.stage is Stage.LOCAL:
        ask = Ask(None, count=count)  # forwarded untouched: the device plugin's whole GPUs
    else:
        return Plan(True, pod.total_cpu, None, gpu.name, (), (), f"{classification.detail}: the GPU stage "
                    "cannot run on a CPU node in this model")
    stays.append((gpu.name, place(classification).reason.value))
    for container in pod.cpu:
        cls = classify(ContainerAsk(container.name, envs={}), annotations)
        if cls.stage is Stage.CPU:
            request = container.need if mode is Mode.WEFT_FULL else Resources(
                min(SPLIT_REQUEST.cpu_cores, container.vcpu), min(SPLIT_REQUEST.memory_bytes, container.memory_bytes))
            booked.append(request)
            reroutes.append((container.name, container.need, request))
        elif cls.stage is Stage.LOCAL:
            booked.append(container.need)
            stays.append((container.name, place(cls).reason.value))
        else:
            return Plan(True, pod.total_cpu, None, gpu.name, (), (), f"{cls.detail}: container {container.name} "
                        "has no GPU profile in this model")
    return Plan(True, _sum(booked), ask, gpu.name, tuple(reroutes), tuple(stays), "")
