"""Stand-ins for the GPU's software, shared by the broker's and ``weft gpu-check``'s tests.

``FakeNvml`` answers like pynvml over two devices (an A100 with MIG off, a T4
without MIG support). Its process list is what tests set, or, given a
``world`` directory, what the fake libcuda's live processes wrote there.
``enable_mig`` turns the A100's MIG on with the instances a test gives it (by
slot, so slots in between are empty), and ``write_mig_caps`` writes the
driver's capability files for them into a stand-in ``/proc``.

``FAKE_MPS`` is a stand-in ``nvidia-cuda-mps-control``: with ``-f`` it is the
daemon, listening on ``$CUDA_MPS_PIPE_DIRECTORY/control``; without it, it is
the control client, passing stdin's command to that daemon and failing when no
daemon listens. The limits a client sets (``set_default_...``) are kept in the
pipe directory, where ``get_default_...`` reads them back and the fake libcuda
finds them, as a real MPS server would hold its clients to them. The daemon
records its environment and the commands it receives in its log directory.
"""

# The fake library must use pynvml's camelCase names.
# ruff: noqa: N802

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml

GI = 1 << 30
A100 = "GPU-0c4a3b1e-8a61-4d0e-9a0e-1f6e2b7c9d01"
T4 = "GPU-7f2d9c44-51b3-4e8a-b1a2-6c0d3e9f8a02"
MIG_A = "MIG-3b1c0a52-7f0e-5d6b-9c41-2a8e6f1d0b11"
MIG_B = "MIG-9e07d2c4-1a35-5b8f-a6d2-7c4e0f3b9a22"
NO_INSTANCE = 0xFFFFFFFF  # NVML's instance ids of a process outside MIG


def nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def proc(pid: int, used: int | None, gi: int = NO_INSTANCE, ci: int = NO_INSTANCE) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=gi, computeInstanceId=ci)


@dataclass
class FakeMig:
    """One MIG instance of the fake A100."""

    uuid: str
    gpu_instance: int
    compute_instance: int
    memory: int
    sms: int | None = 14  # None: the driver lacks nvmlDeviceGetAttributes
    name: str = "NVIDIA A100-SXM4-80GB MIG 1g.10gb"
    used: int = 0


def two_instances() -> dict[int, FakeMig]:
    """A 1g.10gb instance in slot 0 and a 3g.40gb one in slot 2 (slot 1 empty)."""
    return {0: FakeMig(MIG_A, 7, 0, 10 * GI), 2: FakeMig(MIG_B, 2, 0, 40 * GI, sms=42,
                                                         name="NVIDIA A100-SXM4-80GB MIG 3g.40gb")}


def write_mig_caps(proc_root: Path, gpu_minor: int, gpu_instance: int, compute_instance: int, gi_cap: int,
                   ci_cap: int) -> None:
    """The driver's capability files of one MIG instance, as /proc/driver/nvidia/capabilities has them."""
    gi_dir = proc_root / "driver/nvidia/capabilities" / f"gpu{gpu_minor}" / "mig" / f"gi{gpu_instance}"
    for directory, minor in ((gi_dir, gi_cap), (gi_dir / f"ci{compute_instance}", ci_cap)):
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "access").write_text(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")


def sample(pid: int, ts: int, sm: int) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, timeStamp=ts, smUtil=sm, memUtil=0, encUtil=0, decUtil=0)


class FakeNvml:
    """Answers like pynvml over two devices: an A100 with MIG off (``enable_mig`` turns it on), a T4 without MIG."""

    NVMLError = pynvml.NVMLError

    def __init__(self, world: Path | None = None, *, mps_list: bool = False) -> None:
        self.init_error: int | None = None
        self.initialised = 0
        self.calls: list[tuple[str, tuple]] = []
        self.handles = {"h0": A100, "h1": T4}
        self.compute: dict[str, list] = {"h0": [], "h1": []}
        self.graphics: dict[str, list] = {"h0": [], "h1": []}
        self.mps: dict[str, list] = {"h0": [], "h1": []}
        self.samples: dict[str, list] = {"h0": [], "h1": []}
        self.broken: dict[str, int] = {}  # function name -> NVML error code it raises
        self.driver_version = "550.54.15"
        self.cuda_version = 12040
        self.compute_mode = {"h0": pynvml.NVML_COMPUTEMODE_DEFAULT, "h1": pynvml.NVML_COMPUTEMODE_DEFAULT}
        self.persistence = {"h0": pynvml.NVML_FEATURE_ENABLED, "h1": pynvml.NVML_FEATURE_ENABLED}
        self.mig = {"h0": [pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_DISABLE], "h1": None}
        self.capability = {"h0": (8, 0), "h1": (7, 5)}
        self.used = {"h0": 0, "h1": 0}
        self.max_mig = {"h0": 7}
        self.instances: dict[str, dict[int, FakeMig]] = {"h0": {}}  # GPU handle -> slot -> instance
        self.world_instance: tuple[int, int] = (NO_INSTANCE, NO_INSTANCE)  # the world's processes' instance ids
        # The world's processes are on the first device; the MPS list exists only with mps_list (newer drivers).
        self.world = world
        if mps_list or world is not None:
            self.nvmlDeviceGetMPSComputeRunningProcesses = self._mps_processes

    def __getattr__(self, name: str) -> Any:
        # Constants (NVML_ERROR_*, NVML_DEVICE_MIG_ENABLE) come from the real module.
        if name.startswith("NVML_"):
            return getattr(pynvml, name)
        raise AttributeError(name)

    def enable_mig(self, instances: dict[int, FakeMig] | None = None, *, world_slot: int | None = None) -> None:
        """The A100 with MIG on (now and after a reset) and these instances by slot; the world's processes on
        the instance in ``world_slot``."""
        self.mig["h0"] = [pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE]
        self.instances["h0"] = dict(instances or {})
        if world_slot is not None:
            mig = self.instances["h0"][world_slot]
            self.world_instance = (mig.gpu_instance, mig.compute_instance)

    def _mig_on(self, h: str) -> bool:
        return self.mig.get(h) is not None and self.mig[h][0] == pynvml.NVML_DEVICE_MIG_ENABLE

    def _instance(self, h: str) -> FakeMig | None:
        """The instance a MIG handle (``h0/mig<slot>``) stands for; None for a GPU's handle."""
        if "/mig" not in h:
            return None
        parent, slot = h.split("/mig")
        return self.instances[parent][int(slot)]

    def _enter(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))
        if name in self.broken:
            raise nvml_error(self.broken[name])

    def _world(self) -> list[tuple[int, int, bool]]:
        """(pid, bytes, MPS client) of each live process the fake libcuda recorded."""
        out = []
        for entry in sorted(self.world.iterdir()) if self.world else []:
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            if not _alive(pid):
                continue
            try:
                used, mps = entry.read_text().split()
            except (OSError, ValueError):
                continue
            out.append((pid, int(used), mps == "1"))
        return out

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise nvml_error(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion_v2")
        return self.cuda_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.handles)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"h{index}"

    def nvmlDeviceGetUUID(self, h: str) -> str | bytes:
        if (mig := self._instance(h)) is not None:
            return mig.uuid
        # Older nvidia-ml-py releases hand back bytes.
        return self.handles[h].encode() if h == "h0" else self.handles[h]

    def nvmlDeviceGetName(self, h: str) -> str | bytes:
        if (mig := self._instance(h)) is not None:
            return mig.name.encode()
        return b"NVIDIA A100-SXM4-80GB" if h == "h0" else "Tesla T4"

    def nvmlDeviceGetMemoryInfo(self, h: str) -> SimpleNamespace:
        if (mig := self._instance(h)) is not None:
            return SimpleNamespace(total=mig.memory, used=mig.used, free=mig.memory - mig.used)
        total = 80 * GI if h == "h0" else 16 * GI
        return SimpleNamespace(total=total, used=self.used[h], free=total - self.used[h])

    # -- MIG: the GPU's instances, each a handle of its own -----------------------------------
    def nvmlDeviceGetMaxMigDeviceCount(self, h: str) -> int:
        self._enter("nvmlDeviceGetMaxMigDeviceCount", h)
        if h not in self.max_mig:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.max_mig[h] if self._mig_on(h) else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: str, index: int) -> str:
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex", h, index)
        if not self._mig_on(h):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not 0 <= index < self.max_mig[h]:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if index not in self.instances[h]:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return f"{h}/mig{index}"

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, h: str) -> str:
        if self._instance(h) is None:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return h.split("/mig")[0]

    def nvmlDeviceIsMigDeviceHandle(self, h: str) -> bool:
        return self._instance(h) is not None

    def nvmlDeviceGetGpuInstanceId(self, h: str) -> int:
        self._enter("nvmlDeviceGetGpuInstanceId", h)
        if (mig := self._instance(h)) is None:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return mig.gpu_instance

    def nvmlDeviceGetComputeInstanceId(self, h: str) -> int:
        self._enter("nvmlDeviceGetComputeInstanceId", h)
        if (mig := self._instance(h)) is None:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return mig.compute_instance

    def nvmlDeviceGetAttributes(self, h: str) -> SimpleNamespace:
        self._enter("nvmlDeviceGetAttributes", h)
        mig = self._instance(h)
        if mig is None or mig.sms is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED if mig is None else pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return SimpleNamespace(multiprocessorCount=mig.sms, memorySizeMB=mig.memory >> 20, gpuInstanceSliceCount=1,
                               computeInstanceSliceCount=1)

    def nvmlDeviceGetMigMode(self, h: str) -> list[int]:
        self._enter("nvmlDeviceGetMigMode", h)
        if self.mig[h] is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.mig[h]

    def nvmlDeviceGetComputeMode(self, h: str) -> int:
        self._enter("nvmlDeviceGetComputeMode", h)
        return self.compute_mode[h]

    def nvmlDeviceGetPersistenceMode(self, h: str) -> int:
        self._enter("nvmlDeviceGetPersistenceMode", h)
        return self.persistence[h]

    def nvmlDeviceGetCudaComputeCapability(self, h: str) -> tuple[int, int]:
        self._enter("nvmlDeviceGetCudaComputeCapability", h)
        return self.capability[h]

    def nvmlDeviceGetMinorNumber(self, h: str) -> int:
        return {"h0": 0, "h1": 3}[h]

    def nvmlDeviceGetComputeRunningProcesses(self, h: str) -> list:
        self._enter("nvmlDeviceGetComputeRunningProcesses", h)
        if h == "h0" and self.world is not None:
            return [proc(pid, used, *self.world_instance) for pid, used, mps in self._world() if not mps] \
                + self.compute[h]
        return self.compute[h]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: str) -> list:
        self._enter("nvmlDeviceGetGraphicsRunningProcesses", h)
        return self.graphics[h]

    def _mps_processes(self, h: str) -> list:
        self._enter("nvmlDeviceGetMPSComputeRunningProcesses", h)
        if h == "h0" and self.world is not None:
            return [proc(pid, used, *self.world_instance) for pid, used, mps in self._world() if mps] + self.mps[h]
        return self.mps[h]

    def nvmlDeviceGetUtilizationRates(self, h: str) -> SimpleNamespace:
        self._enter("nvmlDeviceGetUtilizationRates", h)
        if self._mig_on(h):  # as the driver: no whole-GPU utilization under MIG
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=42 if h == "h0" else 7, memory=0)

    def nvmlDeviceGetProcessUtilization(self, h: str, since: int) -> list:
        self._enter("nvmlDeviceGetProcessUtilization", h, since)
        if self._mig_on(h):
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        newer = [s for s in self.samples[h] if s.timeStamp > since]
        if not newer:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return newer


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][:1]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


FAKE_MPS = f"""#!{sys.executable}
import fcntl, json, os, re, sys

pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
logs = os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")
control = os.path.join(pipe, "control")
state_path = os.path.join(pipe, "fake-state.json")

if sys.argv[1:] == ["-f"]:
    with open(os.path.join(logs, "fake-env.json"), "w") as f:
        json.dump({{"env": dict(os.environ), "pid": os.getpid(), "sid": os.getsid(0), "nice": os.nice(0)}}, f)
    if os.path.isdir("/dev/shm"):
        # Named by its pipe directory too: a daemon run without a private /dev/shm leaves its file in the host's,
        # where a later daemon with the same PID must not find it.
        with open(os.path.join("/dev/shm", "fake-mps-%d-%s" % (os.getpid(), pipe.replace("/", "_"))), "w") as f:
            f.write("the daemon's /dev/shm\\n")
    if os.environ.get("FAKE_MPS_EXIT_AT_START"):
        sys.exit(3)
    if not os.path.exists(control):
        os.mkfifo(control)
    # Held for this daemon's life (named by its PID, so a daemon started again in its place is another): what
    # tells a client in a PID namespace of its own that its server lives.
    lock = os.open(os.path.join(pipe, "fake-daemon-%d.lock" % os.getpid()), os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)
    with open(os.path.join(pipe, "fake-daemon.pid"), "w") as f:  # the fake libcuda's "server"
        f.write("%d\\n" % os.getpid())
    # Read-write, so the daemon holds a writer too and never sees end-of-file
    # between one client and the next.
    fifo = os.fdopen(os.open(control, os.O_RDWR), "r")
    while True:
        command = fifo.readline().strip()
        with open(os.path.join(logs, "fake-commands.log"), "a") as f:
            f.write(command + "\\n")
        if command == "quit" and not os.environ.get("FAKE_MPS_IGNORE_QUIT"):
            for name in ("fake-state.json", "fake-limits"):
                try:
                    os.unlink(os.path.join(pipe, name))
                except OSError:
                    pass
            os.unlink(control)
            sys.exit(0)
else:
    command = sys.stdin.read().strip()
    try:
        fd = os.open(control, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no FIFO, or nobody reading it
        print("Cannot find MPS control daemon process", file=sys.stderr)
        sys.exit(1)
    os.write(fd, (command + "\\n").encode())
    os.close(fd)
    if command == "quit":
        sys.exit(0)
    # The broker sends commands side by side: one client at a time reads and writes the daemon's state.
    state_lock = os.open(os.path.join(pipe, "fake-state.lock"), os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(state_lock, fcntl.LOCK_EX)
    try:
        with open(state_path) as f:
            state = json.load(f)
    except OSError:
        state = {{"threads": "100.0", "memory": {{}}}}
    words = command.split()
    ignore = os.environ.get("FAKE_MPS_IGNORE_LIMITS")
    if words[:1] == ["set_default_active_thread_percentage"] and len(words) == 2:
        if not ignore:
            state["threads"] = "%.1f" % float(words[1])
    elif words[:1] == ["set_default_device_pinned_mem_limit"] and len(words) == 3:
        if not ignore:
            state["memory"][words[1]] = words[2]
    elif words == ["get_default_active_thread_percentage"]:
        print(state["threads"])
    elif words[:1] == ["get_default_device_pinned_mem_limit"] and len(words) == 2:
        shown = state["memory"].get(words[1], "0M")
        mib = int(shown[:-1]) * (1024 if shown.endswith("G") else 1)
        # As some drivers do: a limit of a GiB or more shown in whole GiB.
        print("%dG" % (mib // 1024) if mib >= 1024 else "%dM" % mib)
    else:
        print("100")
    with open(state_path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(state_path + ".tmp", state_path)
    memory = state["memory"].get("0", "0M")
    with open(os.path.join(pipe, "fake-limits"), "w") as f:
        f.write("%d %d\\n" % (int(memory[:-1]) * (1024 if memory.endswith("G") else 1), float(state["threads"])))
"""


def install_fake_mps(directory: Path) -> str:
    """Write the fake ``nvidia-cuda-mps-control`` (and a server beside it) into ``directory``; returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "nvidia-cuda-mps-control"
    path.write_text(FAKE_MPS)
    path.chmod(0o755)
    server = directory / "nvidia-cuda-mps-server"
    server.write_text("#!/bin/sh\nexit 0\n")  # never started: no fake client connects through a server
    server.chmod(0o755)
    return str(path)


def dead_pid() -> int:
    """A PID no process has now (a child that exited and was reaped)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid
