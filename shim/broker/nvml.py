"""The GPU backend for real devices, read through NVML (``nvidia-ml-py``, ``import pynvml``).

NVML is the driver's own account of devices, processes and usage, the same one
nvidia-smi and dcgm-exporter read, so what the broker enforces agrees with what
operators see. This module turns NVML's C-shaped answers (bytes, missing values,
error codes) into the broker's ``GpuDevice``/``GpuProcess`` values and its
failures into two exceptions that name the call::

    NvmlError            an NVML call failed (the NVMLError is chained)
    └── NvmlUnavailable  no NVML library or no driver on this host

It runs in the broker process only, never in the agent: a hung NVML call must
not stall CRI.

MIG: a GPU with MIG on is listed (``mig_enabled``) but never leased; each of
its MIG instances is a device of its own, after every GPU in the list, with
its ``MIG-`` UUID and memory, the GPU's ``/dev/nvidia<minor>`` and the
instance's capability nodes (``/dev/nvidia-caps/nvidia-cap<N>``, N read from
``<proc>/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>[/ci<C>]/access``).
NVML lists a MIG GPU's processes on the GPU with their GPU and compute
instance ids; each is reported on its instance. The MIG layout is read once,
when the backend starts (as the broker reads its devices once): a GPU
re-partitioned since needs a broker restart. Nothing here sets anything.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from shim.broker.backend import DeviceNodesUnknown, GpuDevice, GpuProcess

try:
    import pynvml
except ImportError:  # a broken install; NvmlBackend() says so when it is asked for
    pynvml = None

# Nodes every GPU container needs besides its own /dev/nvidia<minor>; which of
# them exist depends on the driver's modules (uvm for CUDA, modeset for display).
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")


# A process NVML lists outside any MIG instance carries this as its instance ids (NVML_VALUE_NOT_AVAILABLE).
_NO_INSTANCE = 0xFFFFFFFF
_CAP_MINOR = re.compile(r"^DeviceFileMinor:\s*(\d+)\s*$", re.MULTILINE)

# nvmlComputeMode_t, named as nvidia-smi names them.
_COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}


@dataclass(frozen=True)
class MigInstance:
    """One MIG instance of a MIG-enabled GPU, as NVML showed it when the backend started."""

    device: GpuDevice  # its own MIG- UUID and memory; parent_uuid names the GPU
    gpu_instance_id: int
    compute_instance_id: int
    multiprocessors: int | None  # its SMs; None where the driver does not say


@dataclass(frozen=True)
class InstanceInfo:
    instance: MigInstance
    memory_used: int  # bytes


@dataclass(frozen=True)
class DeviceInfo:
    device: GpuDevice
    memory_used: int  # bytes
    mig_pending: bool  # MIG on after the next GPU reset
    compute_mode: str  # Default, Exclusive_Process, Prohibited, ...
    persistence: bool | None  # None: not supported (e.g. Windows)
    compute_capability: tuple[int, int]
    instances: tuple[InstanceInfo, ...] = ()  # a MIG-enabled GPU's instances, which the broker leases


@dataclass(frozen=True)
class NodeInventory:
    driver_version: str  # e.g. "550.54.15"
    cuda_driver_version: int | None  # CUDA's encoding: 12040 is 12.4; None where the driver cannot say
    devices: tuple[DeviceInfo, ...]


class NvmlError(Exception):
    """An NVML call failed; the message names the call and the device."""


class NvmlUnavailable(NvmlError):
    """This host has no NVML library or no loaded NVIDIA driver: there is nothing to read."""


class NvmlBackend:
    name = "nvml"

    def __init__(self, library: ModuleType | Any | None = None, *, proc_root: Path = Path("/proc")) -> None:
        # ``library`` stands in for pynvml in tests; it must offer pynvml's
        # functions, NVMLError and NVML_* constants. ``proc_root`` is where the
        # driver's MIG capability files are read (a fake tree in tests).
        if library is None:
            if pynvml is None:
                raise NvmlUnavailable("import pynvml: nvidia-ml-py is not installed")
            library = pynvml
        self._nv = library
        nv = library
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            if exc.value in (nv.NVML_ERROR_LIBRARY_NOT_FOUND, nv.NVML_ERROR_DRIVER_NOT_LOADED):
                raise NvmlUnavailable(f"nvmlInit: {exc} (is the NVIDIA driver installed and loaded?)") from exc
            raise NvmlError(f"nvmlInit: {exc}") from exc
        self._closed = False
        self._proc_root = proc_root
        # GPU UUID -> its MIG instances (an empty list: MIG on, no instance made yet), in slot order.
        self._mig: dict[str, list[MigInstance]] = {}
        self._instance_handles: dict[str, Any] = {}
        self._lock = threading.Lock()
        # NVML timestamps (microseconds) of the newest process sample seen per
        # device, so each process_utilization() call reads only newer samples.
        self._last_seen: dict[str, int] = {}
        try:
            # Handles are stable while NVML is initialised; UUIDs are what
            # leases name, so look handles up by UUID, kept in index order.
            self._handles: dict[str, Any] = {}
            for index in range(self._call("nvmlDeviceGetCount")):
                handle = self._call("nvmlDeviceGetHandleByIndex", index, on=f"index {index}")
                self._handles[_text(self._call("nvmlDeviceGetUUID", handle, on=f"index {index}"))] = handle
            for uuid, handle in self._handles.items():
                if self._mig_mode(uuid, handle)[0]:
                    self._mig[uuid] = self._read_instances(uuid, handle, len(self._handles)
                                                           + len(self._instance_handles))
            # (GPU UUID, GPU instance id, compute instance id) -> instance UUID, for the process lists.
            self._by_ids = {(i.device.parent_uuid, i.gpu_instance_id, i.compute_instance_id): i.device.uuid
                            for instances in self._mig.values() for i in instances}
        except NvmlError:
            self.close()
            raise

    def devices(self) -> list[GpuDevice]:
        out = []
        for index, (uuid, handle) in enumerate(self._handles.items()):
            out.append(
                GpuDevice(
                    index=index,
                    uuid=uuid,
                    name=_text(self._call("nvmlDeviceGetName", handle, on=uuid)),
                    memory_total=int(self._call("nvmlDeviceGetMemoryInfo", handle, on=uuid).total),
                    mig_enabled=uuid in self._mig,
                    minor=self._minor(uuid, handle),
                )
            )
        # After every GPU, so a GPU's index stays its NVML index (what /dev/nvidia<N> and device plugins name).
        out.extend(i.device for instances in self._mig.values() for i in instances)
        return out

    def mig_instances(self, uuid: str) -> list[MigInstance]:
        """The MIG instances of GPU ``uuid`` (none where MIG is off, or on with no instance made)."""
        self._handle(uuid)
        return list(self._mig.get(uuid, ()))

    def _mig_mode(self, uuid: str, handle: Any) -> tuple[bool, bool]:
        """(MIG on now, MIG on after the next reset); both False where the GPU or driver has no MIG."""
        nv = self._nv
        # Devices without MIG (pre-Ampere, consumer boards) answer NotSupported;
        # drivers older than MIG lack the function altogether.
        mig = self._call("nvmlDeviceGetMigMode", handle, on=uuid,
                         tolerate=(nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND))
        if mig is None:
            return False, False
        return mig[0] == nv.NVML_DEVICE_MIG_ENABLE, mig[1] == nv.NVML_DEVICE_MIG_ENABLE

    def _read_instances(self, uuid: str, handle: Any, first_index: int) -> list[MigInstance]:
        nv = self._nv
        parent_minor = self._minor(uuid, handle)
        out = []
        for slot in range(int(self._call("nvmlDeviceGetMaxMigDeviceCount", handle, on=uuid))):
            where = f"{uuid} MIG slot {slot}"
            # NotFound: no instance in this slot.
            mig_handle = self._call("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot, on=where,
                                    tolerate=(nv.NVML_ERROR_NOT_FOUND,))
            if mig_handle is None:
                continue
            mig_uuid = _text(self._call("nvmlDeviceGetUUID", mig_handle, on=where))
            attributes = self._call("nvmlDeviceGetAttributes", mig_handle, on=mig_uuid,
                                    tolerate=(nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND))
            device = GpuDevice(
                index=first_index + len(out), uuid=mig_uuid,
                name=_text(self._call("nvmlDeviceGetName", mig_handle, on=mig_uuid)),
                memory_total=int(self._call("nvmlDeviceGetMemoryInfo", mig_handle, on=mig_uuid).total),
                mig_enabled=False, minor=parent_minor, parent_uuid=uuid)
            out.append(MigInstance(
                device=device,
                gpu_instance_id=int(self._call("nvmlDeviceGetGpuInstanceId", mig_handle, on=mig_uuid)),
                compute_instance_id=int(self._call("nvmlDeviceGetComputeInstanceId", mig_handle, on=mig_uuid)),
                multiprocessors=None if attributes is None else int(attributes.multiprocessorCount)))
            self._instance_handles[mig_uuid] = mig_handle
        return out

    def processes(self) -> list[GpuProcess]:
        nv = self._nv
        found: dict[tuple[int, str], GpuProcess] = {}
        # Drivers older than the MPS process list lack the function: then whether a process is an MPS
        # client is unknown (None), never guessed.
        mps_call = "nvmlDeviceGetMPSComputeRunningProcesses"
        knows_mps = hasattr(nv, mps_call)
        calls = ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses",
                 *((mps_call,) if knows_mps else ()))
        tolerate = (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND)
        for uuid, handle in self._handles.items():
            lists = {call: self._call(call, handle, on=uuid, tolerate=tolerate) or [] for call in calls}
            mps_pids = {int(p.pid) for p in lists.get(mps_call, [])}
            # A process that does both compute and graphics is in both lists;
            # it is one process on that device, holding the larger figure.
            for listed in lists.values():
                for proc in listed:
                    # None where the driver cannot say (e.g. under MIG or WDDM).
                    used = int(proc.usedGpuMemory or 0)
                    key = (int(proc.pid), self._instance_of(uuid, proc))
                    if key not in found or used > found[key].used_memory:
                        found[key] = GpuProcess(pid=key[0], device_uuid=key[1], used_memory=used,
                                                mps_client=(key[0] in mps_pids) if knows_mps else None)
        return list(found.values())

    def _instance_of(self, uuid: str, proc: Any) -> str:
        """The device a process listed on GPU ``uuid`` is on: its MIG instance where it names a known one."""
        if uuid not in self._mig:
            return uuid
        # Older process structures lack the ids. A process on an instance made after the backend started stays
        # on the GPU, a device no lease holds: the watchdog then sees a leased process outside its lease.
        ids = (uuid, getattr(proc, "gpuInstanceId", _NO_INSTANCE), getattr(proc, "computeInstanceId", _NO_INSTANCE))
        return self._by_ids.get(ids, uuid)

    def inventory(self) -> NodeInventory:
        """What an operator checks before opting a node in: driver, CUDA driver and each device's settings."""
        nv = self._nv
        cuda = self._call("nvmlSystemGetCudaDriverVersion_v2", tolerate=(nv.NVML_ERROR_FUNCTION_NOT_FOUND,))
        out = []
        for device in self.devices():
            if device.parent_uuid is not None:  # listed under its GPU
                continue
            handle = self._handles[device.uuid]
            _, mig_pending = self._mig_mode(device.uuid, handle)
            instances = tuple(
                InstanceInfo(i, int(self._call("nvmlDeviceGetMemoryInfo", self._instance_handles[i.device.uuid],
                                               on=i.device.uuid).used))
                for i in self._mig.get(device.uuid, ()))
            capability = self._call("nvmlDeviceGetCudaComputeCapability", handle, on=device.uuid)
            persistence = self._call("nvmlDeviceGetPersistenceMode", handle, on=device.uuid,
                                     tolerate=(nv.NVML_ERROR_NOT_SUPPORTED,))
            out.append(DeviceInfo(
                device=device,
                memory_used=int(self._call("nvmlDeviceGetMemoryInfo", handle, on=device.uuid).used),
                mig_pending=mig_pending,
                compute_mode=_COMPUTE_MODES.get(int(self._call("nvmlDeviceGetComputeMode", handle, on=device.uuid)),
                                                "unknown"),
                persistence=None if persistence is None else persistence == nv.NVML_FEATURE_ENABLED,
                compute_capability=(int(capability[0]), int(capability[1])),
                instances=instances,
            ))
        return NodeInventory(driver_version=_text(self._call("nvmlSystemGetDriverVersion")),
                             cuda_driver_version=None if cuda is None else int(cuda), devices=tuple(out))

    def utilization(self) -> dict[str, int]:
        nv = self._nv
        out = {}
        for uuid, handle in self._handles.items():
            # MIG-enabled devices do not report whole-device utilization.
            rates = self._call(
                "nvmlDeviceGetUtilizationRates", handle, on=uuid, tolerate=(nv.NVML_ERROR_NOT_SUPPORTED,)
            )
            if rates is not None:
                out[uuid] = int(rates.gpu)
        return out

    def process_utilization(self) -> dict[int, int]:
        nv = self._nv
        # NotFound: no sample newer than the last one we saw. NotSupported: the
        # device keeps no per-process samples. Both mean "nothing new known".
        # NVML_SUCCESS (0) arrives as an error from pynvml when the first,
        # sizing call already finds no samples.
        nothing = (nv.NVML_ERROR_NOT_FOUND, nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_SUCCESS)
        out: dict[int, int] = {}
        with self._lock:
            for uuid, handle in self._handles.items():
                since = self._last_seen.get(uuid, 0)
                samples = self._call("nvmlDeviceGetProcessUtilization", handle, since, on=uuid, tolerate=nothing)
                newest: dict[int, Any] = {}
                for sample in samples or []:
                    if sample.pid not in newest or sample.timeStamp > newest[sample.pid].timeStamp:
                        newest[sample.pid] = sample
                for pid, sample in newest.items():
                    self._last_seen[uuid] = max(self._last_seen.get(uuid, 0), int(sample.timeStamp))
                    # Out-of-range values are the driver's "not available" marker.
                    if 0 <= sample.smUtil <= 100:
                        # A process on several devices: report its busiest one,
                        # since the watchdog compares against a per-device share.
                        out[int(pid)] = max(out.get(int(pid), 0), int(sample.smUtil))
        return out

    def device_nodes(self, uuid: str) -> list[str]:
        instance = self._instance(uuid)
        if instance is None:
            minor = self._minor(uuid, self._handle(uuid))
            return [] if minor is None else [f"/dev/nvidia{minor}"]
        parent_minor = instance.device.minor
        if parent_minor is None:
            raise DeviceNodesUnknown(f"MIG instance {uuid}: its GPU {instance.device.parent_uuid} has no minor "
                                     "number, so neither its device node nor its capability files can be named")
        gi_dir = (self._proc_root / "driver/nvidia/capabilities" / f"gpu{parent_minor}" / "mig"
                  / f"gi{instance.gpu_instance_id}")
        # A process needs the GPU's node and both capabilities (its GPU instance, its compute instance) to use it.
        return [f"/dev/nvidia{parent_minor}",
                *(f"/dev/nvidia-caps/nvidia-cap{_cap_minor(uuid, path)}"
                  for path in (gi_dir / "access", gi_dir / f"ci{instance.compute_instance_id}" / "access"))]

    def control_nodes(self) -> list[str]:
        return [node for node in CONTROL_NODES if os.path.exists(node)]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._call("nvmlShutdown")

    def _handle(self, uuid: str) -> Any:
        try:
            return self._handles[uuid]
        except KeyError:
            known = [*self._handles, *self._instance_handles]
            raise ValueError(f"unknown device {uuid!r} (NVML devices: {', '.join(known)})") from None

    def _instance(self, uuid: str) -> MigInstance | None:
        """The MIG instance ``uuid``; None for a GPU; ValueError for neither."""
        if uuid not in self._instance_handles:
            self._handle(uuid)
            return None
        return next(i for instances in self._mig.values() for i in instances if i.device.uuid == uuid)

    def _minor(self, uuid: str, handle: Any) -> int | None:
        minor = self._call("nvmlDeviceGetMinorNumber", handle, on=uuid, tolerate=(self._nv.NVML_ERROR_NOT_SUPPORTED,))
        return None if minor is None else int(minor)

    def _call(self, name: str, *args: Any, on: str = "", tolerate: tuple[int, ...] = ()) -> Any:
        """Call NVML's ``name``; an error code in ``tolerate`` reads as None, any other raises NvmlError."""
        try:
            return getattr(self._nv, name)(*args)
        except self._nv.NVMLError as exc:
            if exc.value in tolerate:
                return None
            where = f" on {on}" if on else ""
            raise NvmlError(f"{name}{where}: {exc}") from exc


def _cap_minor(uuid: str, path: Path) -> int:
    """The minor of the /dev/nvidia-caps node a MIG capability file names (its ``DeviceFileMinor:`` line)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise DeviceNodesUnknown(f"MIG instance {uuid}: cannot read {path} ({exc.strerror or exc}): is the "
                                 "instance still there, and is /proc the host's?") from exc
    match = _CAP_MINOR.search(text)
    if match is None:
        raise DeviceNodesUnknown(f"MIG instance {uuid}: {path} has no 'DeviceFileMinor: N' line")
    return int(match[1])


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py releases return char buffers as bytes.
    return value.decode() if isinstance(value, bytes) else value
