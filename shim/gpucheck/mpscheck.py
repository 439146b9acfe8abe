"""Is CUDA MPS usable here, the way the broker uses it?

The broker starts one control daemon per shared lease and sets that lease's
limits on it; so does this check, with a private daemon in a directory of its
own: it starts, takes a memory and a compute limit, reads them back and quits.
No MPS server starts (no client connects) and no device setting changes. It
also lists MPS daemons that are not weft's (a device plugin's MPS sharing, an
operator's own), whose clients share the GPU under limits weft did not set.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import psutil

from shim.broker.mps import MpsError, MpsLimits, MpsSupervisor
from shim.gpucheck.report import Check, fail, ok, warn

PROBE_KEY = "weft-gpu-check-probe"
PROBE_LIMITS = MpsLimits(memory_bytes=1 << 30, compute_percent=50)
# The kernel keeps 15 characters of a process's name: both daemons show as "nvidia-cuda-mps".
_MPS_PREFIX = "nvidia-cuda-mps"


def checks(binary: str, device_uuid: str | None, *, timeout: float = 10.0, ours: frozenset[int] = frozenset(),
           private_shm: bool = True) -> list[Check]:
    out = []
    found = shutil.which(binary)
    if found is None:
        return [fail("mps-control", f"{binary} is not on PATH: the broker cannot start MPS daemons, so shared "
                                    "leases have no limits. Change: install the NVIDIA driver's utilities (Debian: "
                                    "nvidia-cuda-mps; Ubuntu: nvidia-compute-utils-<version>)")]
    if device_uuid is None:
        out.append(warn("mps-control", f"{found} is there, but there is no GPU to start a daemon for"))
    else:
        out.append(_probe(found, device_uuid, timeout, private_shm))
    server = shutil.which("nvidia-cuda-mps-server") or (Path(found).parent / "nvidia-cuda-mps-server")
    out.append(ok("mps-server", f"{server}") if Path(server).exists() else
               warn("mps-server", "nvidia-cuda-mps-server is not on PATH nor beside the control binary: the daemon "
                                  "cannot start a server when a client connects. Change: install it with the "
                                  "driver's utilities"))
    out.append(_others(ours))
    return out


def _probe(binary: str, device_uuid: str, timeout: float, private_shm: bool) -> Check:
    with tempfile.TemporaryDirectory(prefix="weft-gpu-check-mps-") as tmp:
        sup = MpsSupervisor(Path(tmp), binary, ready_timeout=timeout, stop_timeout=timeout, private_shm=private_shm)
        started = time.monotonic()
        try:
            sup.ensure(PROBE_KEY, device_uuid, PROBE_LIMITS)
        except (MpsError, OSError) as exc:
            detail = exc.message if isinstance(exc, MpsError) else str(exc)
            return fail("mps-control", f"a private MPS control daemon for {device_uuid} did not start or did not "
                                       f"take its limits: {detail}. Change: see its control.log; MPS needs the "
                                       "driver's MPS support and, for memory limits, CUDA 11.5 or newer")
        finally:
            sup.stop_all()
        return ok("mps-control", f"{binary} runs: a private daemon for {device_uuid} took a "
                                 f"{PROBE_LIMITS.memory_mib} MiB memory and {PROBE_LIMITS.compute_percent}% "
                                 f"compute limit and read them back ({time.monotonic() - started:.1f}s)")


def _others(ours: frozenset[int]) -> Check:
    found = []
    for p in psutil.process_iter(["pid", "name", "ppid"]):
        name = p.info["name"] or ""
        if not name.startswith(_MPS_PREFIX) or p.info["pid"] in ours or p.info["ppid"] in ours or _brokers(p):
            continue
        try:
            pipe = p.environ().get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
        except (psutil.Error, OSError):
            pipe = "unreadable"
        found.append(f"{name} pid {p.info['pid']} (pipe directory {pipe})")
    if not found:
        return ok("other-mps", "no other MPS daemon runs")
    return warn("other-mps", "MPS daemons weft did not start: " + "; ".join(found) + ". Their clients share the GPUs "
                             "under limits weft did not set. Change: let weft's broker be the only MPS "
                             "user of the GPUs it leases (turn off the device plugin's sharing.mps; use its "
                             "time-slicing replicas instead)")


def _brokers(p: psutil.Process) -> bool:
    """Started by a weft broker (a lease's daemon, or the server that daemon started)."""
    try:
        for parent in p.parents():
            words = parent.cmdline()
            if "broker" in words and any(w.endswith(("weft", "shim")) for w in words):
                return True
    except (psutil.Error, OSError):
        return False
    return False
