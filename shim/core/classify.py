"""Which stage a container of an opted-in pod is: cpu, gpu or local.

In this order: the pod annotation ``weft.io/stage.<container>``; then whether
the container asks for a GPU (a GPU device node, a CDI device of a DRA claim
whose spec names a GPU, a CDI device of a GPU vendor, or
``NVIDIA_VISIBLE_DEVICES``/``CUDA_VISIBLE_DEVICES`` set to something other
than ``void``/``none``); otherwise cpu. The outcome is a value
with a reason, so logs, crictl annotations and ``weft explain`` all say why.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shim.core.cdi import GPU_CDI as _GPU_CDI
from shim.core.cdi import resolve

STAGE_ANNOTATION = "weft.io/stage."
VISIBLE_DEVICE_VARS = ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
# Values that mean "no GPU" for the NVIDIA runtime and CUDA.
_NO_GPU_VALUES = frozenset({"", "void", "none", "-1"})
_GPU_DEVICE = re.compile(r"^/dev/(nvidia\d+|nvidia-caps/.*|dri/(card|renderD)\d+)$")


class Stage(enum.Enum):
    CPU = "cpu"
    GPU = "gpu"
    LOCAL = "local"


class StageReason(enum.Enum):
    ANNOTATION = "annotation"
    GPU_DEVICE = "gpu-device"
    CDI_DEVICE = "cdi-device"
    DRA_CLAIM = "dra-claim"
    VISIBLE_DEVICES_ENV = "visible-devices-env"
    NO_GPU_REQUEST = "no-gpu-request"


class StageAnnotationError(ValueError):
    """``weft.io/stage.<container>`` holds something other than cpu, gpu or local."""

    def __init__(self, annotation: str, value: str) -> None:
        super().__init__(f"{annotation}: {value!r} is not a stage (cpu, gpu or local)")
        self.annotation, self.value = annotation, value


@dataclass(frozen=True)
class Classification:
    stage: Stage
    reason: StageReason
    detail: str


@dataclass(frozen=True)
class ContainerAsk:
    """What classification reads from a CreateContainer request."""

    name: str
    device_host_paths: Sequence[str] = ()
    cdi_devices: Sequence[str] = ()
    envs: Mapping[str, str] | None = None
    # The CDI devices of a DRA claim among cdi_devices, each with the GPUs its CDI spec names: UUIDs, or
    # device nodes (shim.core.cdi.claim_gpus; read from the node's specs outside the core).
    claim_gpus: Mapping[str, frozenset[str]] = field(default_factory=dict)


def classify(ask: ContainerAsk, pod_annotations: Mapping[str, str]) -> Classification:
    key = STAGE_ANNOTATION + ask.name
    if key in pod_annotations:
        value = pod_annotations[key].strip().lower()
        try:
            stage = Stage(value)
        except ValueError:
            raise StageAnnotationError(key, pod_annotations[key]) from None
        return Classification(stage, StageReason.ANNOTATION, f"{key}={value}")
    for path in ask.device_host_paths:
        if _GPU_DEVICE.match(path):
            return Classification(Stage.GPU, StageReason.GPU_DEVICE, f"device {path}")
    for name in ask.cdi_devices:
        if name in ask.claim_gpus:
            return Classification(Stage.GPU, StageReason.DRA_CLAIM,
                                  f"CDI device {name} of a DRA claim ({', '.join(sorted(ask.claim_gpus[name]))})")
    for name in ask.cdi_devices:
        if _GPU_CDI.match(name):
            return Classification(Stage.GPU, StageReason.CDI_DEVICE, f"CDI device {name}")
    envs = ask.envs or {}
    for var in VISIBLE_DEVICE_VARS:
        if var in envs and envs[var].strip().lower() not in _NO_GPU_VALUES:
            return Classification(Stage.GPU, StageReason.VISIBLE_DEVICES_ENV, f"{var}={envs[var]}")
    return Classification(Stage.CPU, StageReason.NO_GPU_REQUEST, "no GPU device, CDI device or visible-devices env")


def requested_gpus(ask: ContainerAsk, all_uuids: Sequence[str], uuid_of_index: Mapping[int, str]) -> tuple[
        int, frozenset[str] | None]:
    """How many whole GPUs the container asked for, and which (the packing domain).

    Read from what the device plugin or DRA driver gave it: a DRA claim's CDI
    devices (the UUIDs their specs name), GPU device nodes, CDI device names,
    or the visible-devices variable (indices, UUIDs, ``all``). Returns (count,
    allowed UUIDs or None for any).

    A claim's devices are the domain whatever this node's broker has: a claim
    naming a GPU the broker does not know is refused by the broker rather
    than leased on another GPU, which the claim did not give the pod.
    """
    claimed = resolve(frozenset().union(*ask.claim_gpus.values()), uuid_of_index) if ask.claim_gpus else frozenset()
    if claimed:
        return len(claimed), claimed
    allowed: set[str] = set()
    count = 0
    for path in ask.device_host_paths:
        m = re.match(r"^/dev/nvidia(\d+)$", path)
        if m:
            count += 1
            uuid = uuid_of_index.get(int(m.group(1)))
            if uuid:
                allowed.add(uuid)
    for name in ask.cdi_devices:
        if _GPU_CDI.match(name):
            ident = name.split("=", 1)[1]
            if ident == "all":
                return len(all_uuids), None
            count += 1
            if ident.isdigit() and int(ident) in uuid_of_index:
                allowed.add(uuid_of_index[int(ident)])
            elif ident in all_uuids:
                allowed.add(ident)
    if count == 0:
        envs = ask.envs or {}
        for var in VISIBLE_DEVICE_VARS:
            value = envs.get(var, "").strip()
            if value.lower() in _NO_GPU_VALUES:
                continue
            if value.lower() == "all":
                return len(all_uuids), None
            for ident in (v.strip() for v in value.split(",") if v.strip()):
                count += 1
                if ident.isdigit() and int(ident) in uuid_of_index:
                    allowed.add(uuid_of_index[int(ident)])
                elif ident in all_uuids:
                    allowed.add(ident)
            break
    count = max(count, 1)
    # A domain narrower than the count would make the ask impossible: the
    # identifiers did not name this node's devices, so any device may be used.
    return count, (frozenset(allowed) if len(allowed) >= count else None)
