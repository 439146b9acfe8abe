"""A GPU share as KAI scheduler gave it: the fraction or memory a pod asked for, on the GPU KAI's binder reserved.

KAI (``kai-scheduler/KAI-Scheduler``, its v0.17.0 release is what is followed here) places a pod that asks for a
GPU share by annotations, not by a resource: ``gpu-fraction: "0.5"`` or ``gpu-memory: "2000"`` (MiB), for the
container ``gpu-fraction-container-name`` names (its first container otherwise). Its binder reserves a whole GPU
with a reservation pod of its own (which holds the device plugin's ``nvidia.com/gpu``), then hands the fraction
container that GPU's UUID and the portion it got through a ConfigMap that kubelet turns into the container's
``NVIDIA_VISIBLE_DEVICES`` and ``GPU_PORTION`` (two decimals, of each GPU), and marks the pod
``received-resource-type: Fraction``. KAI enforces no memory limit between the pods it puts on one GPU (its own
documentation says so); weft's broker does: the share becomes a lease, memory as a hard limit and compute by the
portion, on exactly the GPU KAI chose (the variable's UUID is the packing domain).

Pure: the caller reads the annotations, the container's environment and the device's memory.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

from shim.core.quantity import AnnotationError

FRACTION = "gpu-fraction"
MEMORY = "gpu-memory"  # MiB, a whole number
CONTAINER = "gpu-fraction-container-name"
NUM_DEVICES = "gpu-fraction-num-devices"
RECEIVED = "received-resource-type"
PORTION_ENV = "GPU_PORTION"
MIB = 1 << 20


class ShareSource(enum.Enum):
    """Where a GPU container's share came from: what ``weft explain`` shows beside the lease."""

    WHOLE_DEVICE = "whole-device"  # no share asked: whole devices
    WEFT_ANNOTATION = "weft-annotation"  # weft.io/gpu-memory.<c> / weft.io/gpu-compute.<c> (these win)
    KAI_FRACTION = "kai-fraction"  # KAI's gpu-fraction
    KAI_MEMORY = "kai-memory"  # KAI's gpu-memory


@dataclass(frozen=True)
class KaiShare:
    memory_bytes: int  # a hard limit, on one GPU
    compute_percent: int  # 1..100
    source: ShareSource
    detail: str


def asks(pod_annotations: Mapping[str, str]) -> bool:
    """Whether the pod asked KAI for a GPU share."""
    return FRACTION in pod_annotations or MEMORY in pod_annotations


def is_kai_container(container: str, pod_annotations: Mapping[str, str], envs: Mapping[str, str]) -> bool:
    """Whether ``container`` is the one KAI gave the share to: the one its annotation names, else the one KAI's
    binder gave ``GPU_PORTION`` (KAI's default, the pod's first container, is not said in a CRI request)."""
    if not asks(pod_annotations):
        return False
    named = pod_annotations.get(CONTAINER, "").strip()
    return container == named if named else PORTION_ENV in envs


def gpus(envs: Mapping[str, str]) -> list[str]:
    """The GPUs KAI's binder gave the container: the UUIDs in its ``NVIDIA_VISIBLE_DEVICES``, which hold CDI names
    (``k8s.device-plugin.nvidia.com/gpu=GPU-...``) where the device plugin uses CDI."""
    raw = envs.get("NVIDIA_VISIBLE_DEVICES", "")
    return [item.strip().rsplit("=", 1)[-1] for item in raw.split(",") if item.strip()]


def share(pod: str, container: str, pod_annotations: Mapping[str, str], envs: Mapping[str, str],
          device_bytes: int) -> KaiShare:
    """The share KAI gave ``container`` of a GPU of ``device_bytes``; raises AnnotationError naming the pod and
    the value for what no lease can honour: a fraction outside (0, 1], memory that is no positive whole number
    of MiB or larger than the GPU, a share on several GPUs (weft leases a share on one)."""
    where = f"pod {pod}"
    devices = pod_annotations.get(NUM_DEVICES, "1").strip() or "1"
    if devices != "1":
        raise AnnotationError(NUM_DEVICES, devices, f"of {where}: a share on several GPUs is not something weft's "
                                                    "broker leases (a share is on one GPU); ask for one device, or for "
                                                    "whole GPUs")
    portion = _portion(where, envs.get(PORTION_ENV))
    if FRACTION in pod_annotations:
        raw = pod_annotations[FRACTION].strip()
        fraction = _of_one_gpu(FRACTION, raw, where, "a fraction of one GPU (more than 0, at most 1)")
        memory = max(MIB, int(device_bytes * fraction) // MIB * MIB)
        compute = _percent(portion if portion is not None else fraction)
        return KaiShare(memory, compute, ShareSource.KAI_FRACTION,
                        f"{FRACTION}={raw} of a {device_bytes / (1 << 30):.1f} GiB GPU: {memory // MIB} MiB as a hard "
                        f"limit, {compute}% compute" + (f" ({PORTION_ENV}={envs[PORTION_ENV]})" if portion else ""))
    raw = pod_annotations[MEMORY].strip()
    if not raw.isdigit() or int(raw) <= 0:
        raise AnnotationError(MEMORY, raw, f"of {where} is not a positive whole number of MiB")
    memory = int(raw) * MIB
    if memory > device_bytes:
        raise AnnotationError(MEMORY, raw, f"MiB of {where} is larger than the GPU it was given "
                                           f"({device_bytes // MIB} MiB)")
    compute = _percent(portion if portion is not None else memory / device_bytes)
    return KaiShare(memory, compute, ShareSource.KAI_MEMORY,
                    f"{MEMORY}={raw} MiB as a hard limit, {compute}% compute"
                    + (f" ({PORTION_ENV}={envs[PORTION_ENV]})" if portion else ""))


def _portion(where: str, raw: str | None) -> float | None:
    """KAI's binder's portion of the GPU ("0.50"); None where it gave none."""
    if raw is None or not raw.strip():
        return None
    return _of_one_gpu(PORTION_ENV, raw, where, "a portion of one GPU")


def _of_one_gpu(key: str, raw: str, where: str, what: str) -> float:
    """``raw`` as a share of one GPU, more than 0 and at most 1; AnnotationError on ``key`` if it is not a
    number, or is not ``what``."""
    try:
        value = float(raw)
    except ValueError:
        raise AnnotationError(key, raw, f"of {where} is not a number") from None
    if not (0 < value <= 1) or math.isnan(value):
        raise AnnotationError(key, raw, f"of {where} is not {what}")
    return value


def _percent(portion: float) -> int:
    return max(1, min(100, math.ceil(round(portion * 100, 6))))
