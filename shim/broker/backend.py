"""The broker's window on the GPUs: a small Protocol with two implementations.

``nvml`` reads real devices through nvidia-ml-py; ``simulated`` is configured
devices whose processes and usage tests drive. One contract test suite runs
against both (``tests/broker/test_backend_contract.py``).

A MIG-enabled GPU is listed with ``mig_enabled`` and is never leased: CUDA
runs only on its MIG instances, which are devices of their own (their own
``MIG-`` UUID, memory and device nodes), each naming the GPU in
``parent_uuid``, and are leased whole or shared like any GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class GpuDevice:
    index: int
    uuid: str
    name: str
    memory_total: int  # bytes
    # A GPU with MIG on: not leasable itself, its instances are (those whose parent_uuid is this uuid).
    mig_enabled: bool
    # /dev/nvidia<minor>; None where there is no device node (simulated). A MIG instance has its GPU's.
    minor: int | None
    # Set on a MIG instance only: the UUID of the GPU it is part of.
    parent_uuid: str | None = None

    @property
    def leasable(self) -> bool:
        """A lease may take this device (whole or a share): anything but a MIG-enabled GPU."""
        return not self.mig_enabled


@dataclass(frozen=True)
class GpuProcess:
    pid: int  # as the host's PID namespace sees it
    device_uuid: str
    used_memory: int  # bytes; 0 when the driver does not say
    # True: a client of an MPS server (held to that server's limits); False: a
    # context of its own, outside MPS; None: the backend cannot tell.
    mps_client: bool | None = None


class DeviceNodesUnknown(Exception):
    """The backend cannot say which device nodes a device needs (a MIG instance's capability file is missing)."""


class Backend(Protocol):
    name: str

    def devices(self) -> list[GpuDevice]:
        """Every device, in index order."""
        ...

    def processes(self) -> list[GpuProcess]:
        """Every process using a device now, with its memory on that device."""
        ...

    def utilization(self) -> dict[str, int]:
        """Device UUID -> percent of the last sample period the device was busy."""
        ...

    def process_utilization(self) -> dict[int, int]:
        """PID -> percent of SM time it used in the last sample period (where known)."""
        ...

    def device_nodes(self, uuid: str) -> list[str]:
        """Device nodes a container needs for this device (without the shared control nodes).

        Raises ValueError for a device the backend does not have, DeviceNodesUnknown where it cannot tell.
        """
        ...

    def control_nodes(self) -> list[str]:
        """Shared device nodes every GPU container needs (nvidiactl, nvidia-uvm, ...)."""
        ...

    def close(self) -> None:
        ...
