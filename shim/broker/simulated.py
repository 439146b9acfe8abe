"""A GPU backend with no GPU: configured devices whose processes and usage tests drive.

It lets the broker, its watchdog and the fleet benchmark run on machines without
a driver (CI, laptops), and it is the reference the contract tests hold the NVML
backend to. Devices come from a spec such as ``2x80Gi,1x40Gi``
(``--simulated-devices``); tests then say which processes hold how much memory
and how busy each device is.
"""

from __future__ import annotations

import re
import threading

from shim.broker.backend import GpuDevice, GpuProcess

_FLAG = "--simulated-devices"
_UNITS = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
# Kubernetes writes "80Gi"; people write "80GiB". Both mean the same, so the
# trailing B is optional. Decimal units (GB) are refused rather than guessed.
_PART = re.compile(r"(?P<count>\d+)\s*[xX]\s*(?P<size>\d+)\s*(?P<unit>Ki|Mi|Gi|Ti)?(?P<b>B)?")


def parse_spec(spec: str) -> list[int]:
    """``"2x80GiB,1x40GiB"`` -> the memory of each device in bytes, in index order."""
    if not spec.strip():
        raise ValueError(f"{_FLAG}: empty; expected COUNTxSIZE[,COUNTxSIZE...] such as 2x80Gi")
    sizes: list[int] = []
    for part in spec.split(","):
        match = _PART.fullmatch(part.strip())
        if match is None:
            raise ValueError(
                f"{_FLAG}: {part.strip()!r} is not COUNTxSIZE (such as 2x80Gi; sizes take Ki, Mi, Gi or Ti)"
            )
        count, size = int(match["count"]), int(match["size"]) * _UNITS[match["unit"] or ""]
        if count == 0:
            raise ValueError(f"{_FLAG}: {part.strip()!r} has a count of zero")
        if size == 0:
            raise ValueError(f"{_FLAG}: {part.strip()!r} has a size of zero")
        sizes.extend([size] * count)
    return sizes


def simulated_uuid(index: int) -> str:
    # Same shape as NVML's "GPU-" + RFC 4122 UUID, and stable by index so a
    # restarted broker sees the same devices its stored leases name.
    return f"GPU-5e1a0000-0000-4000-8000-{index:012d}"


class SimulatedBackend:
    name = "simulated"

    def __init__(self, spec: str) -> None:
        self._devices = [
            GpuDevice(
                index=i, uuid=simulated_uuid(i), name="Simulated GPU", memory_total=size, mig_enabled=False, minor=None
            )
            for i, size in enumerate(parse_spec(spec))
        ]
        self._known = {d.uuid for d in self._devices}
        # The broker's watchdog thread reads while gRPC threads (and tests) write.
        self._lock = threading.Lock()
        # Keyed by (pid, device): one process may hold memory on several devices.
        self._processes: dict[tuple[int, str], GpuProcess] = {}
        self._utilization: dict[str, int] = {}
        self._process_utilization: dict[int, int] = {}

    # -- Backend ---------------------------------------------------------

    def devices(self) -> list[GpuDevice]:
        return list(self._devices)

    def processes(self) -> list[GpuProcess]:
        with self._lock:
            return list(self._processes.values())

    def utilization(self) -> dict[str, int]:
        with self._lock:
            return dict(self._utilization)

    def process_utilization(self) -> dict[int, int]:
        with self._lock:
            return dict(self._process_utilization)

    def device_nodes(self, uuid: str) -> list[str]:
        self._check(uuid)
        return []

    def control_nodes(self) -> list[str]:
        return []

    def close(self) -> None:
        pass

    # -- what tests drive --------------------------------------------------

    def set_process(self, pid: int, device_uuid: str, used_memory: int, mps_client: bool | None = None) -> None:
        """``pid`` now holds ``used_memory`` bytes on the device (replacing what it held there before)."""
        self._check(device_uuid)
        if used_memory < 0:
            raise ValueError(f"used_memory must be at least 0, got {used_memory}")
        with self._lock:
            self._processes[pid, device_uuid] = GpuProcess(pid=pid, device_uuid=device_uuid, used_memory=used_memory,
                                                           mps_client=mps_client)

    def clear_process(self, pid: int) -> None:
        """The process exited: it holds no memory and uses no SM time any more."""
        with self._lock:
            for key in [k for k in self._processes if k[0] == pid]:
                del self._processes[key]
            self._process_utilization.pop(pid, None)

    def set_utilization(self, device_uuid: str, percent: int) -> None:
        self._check(device_uuid)
        _check_percent(percent)
        with self._lock:
            self._utilization[device_uuid] = percent

    def set_process_utilization(self, pid: int, percent: int) -> None:
        _check_percent(percent)
        with self._lock:
            self._process_utilization[pid] = percent

    def _check(self, uuid: str) -> None:
        if uuid not in self._known:
            raise ValueError(f"unknown device {uuid!r} (simulated devices: {', '.join(sorted(self._known))})")


def _check_percent(percent: int) -> None:
    if not 0 <= percent <= 100:
        raise ValueError(f"percent must be within 0..100, got {percent}")
