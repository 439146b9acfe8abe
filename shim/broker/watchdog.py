"""Enforcement: sample per-process GPU memory, map processes to leases by cgroup, act on violators only.

Every interval the watchdog reads the backend's processes, finds each one's
cgroup (``/proc/<pid>/cgroup``) and the bound lease whose container cgroup
holds it, and sums its memory per lease and device. A violation is a lease
over its memory, a process on a device its lease does not include, or a
process of a shared lease that runs outside MPS (a context of its own, which
no MPS server limits: the one way a container escapes its compute share and
its server-side memory limit). Each is logged (``lease.violation``, with its
reason), counted, and with ``action="kill"`` (the default) that container's
processes, and only those (the lease's own cgroup), get SIGKILL. It also
releases bound leases whose container is gone, keeps every shared lease's MPS
daemon running, and accumulates held and active GPU-seconds for the metrics.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections import defaultdict
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from shim import log
from shim.broker.metrics import BrokerMetrics
from shim.broker.service import LeaseService
from shim.core.leases import LeaseState
from shim.periodic import Periodic
from shim.state.leases import LeaseRecord

_log = log.get("weft.broker.watchdog")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# How long a bound lease's container must have been gone before the watchdog releases it:
# long enough for the poststop hook (the normal path) to do it first.
DEAD_GRACE_S = 5.0


class ViolationReason(StrEnum):
    OVER_MEMORY = "over its memory lease"
    FOREIGN_DEVICE = "on a device outside its lease"
    OUTSIDE_MPS = "outside its lease's MPS server"


@dataclass(frozen=True)
class Violation:
    lease_id: str
    device_uuid: str
    used_bytes: int
    limit_bytes: int
    pids: tuple[int, ...]
    why: ViolationReason


def cgroup_of(pid: int) -> str:
    """The process's cgroup path: the memory controller's on v1, the unified one on v2.

    ``hooks/weft_oci_hook.py`` keeps its own copy of this on purpose: the hook
    imports nothing from weft, to start in a few milliseconds.
    """
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return ""
    unified = ""
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path
        if controllers == "":
            unified = path
    return unified


def find_violations(leases: list[LeaseRecord], usage: dict[tuple[str, str], tuple[int, list[int]]],
                    foreign: dict[str, list[tuple[str, int]]], device_memory: dict[str, int],
                    outside_mps: dict[str, list[tuple[str, int, int]]] | None = None) -> list[Violation]:
    """usage: (lease, device) -> (bytes, pids); foreign: lease -> [(device, pid)] on devices outside the lease;
    outside_mps: shared lease -> [(device, pid, bytes)] of processes with a context of their own."""
    by_id = {r.lease_id: r for r in leases}
    out = []
    for (lease_id, dev), (used, pids) in usage.items():
        rec = by_id[lease_id]
        limit = rec.memory_bytes if rec.shared else device_memory.get(dev, rec.memory_bytes)
        if used > limit:
            out.append(Violation(lease_id, dev, used, limit, tuple(pids), ViolationReason.OVER_MEMORY))
    for lease_id, items in foreign.items():
        for dev, pid in items:
            out.append(Violation(lease_id, dev, 0, 0, (pid,), ViolationReason.FOREIGN_DEVICE))
    for lease_id, procs in (outside_mps or {}).items():
        for dev, pid, used in procs:
            out.append(Violation(lease_id, dev, used, by_id[lease_id].memory_bytes, (pid,),
                                 ViolationReason.OUTSIDE_MPS))
    return out


class Watchdog:
    def __init__(self, service: LeaseService, metrics: BrokerMetrics, *, interval: float = 1.0,
                 action: str = "kill", mps=None) -> None:
        if action not in ("log", "kill"):
            raise ValueError(f"enforcement action {action!r} is not log or kill")
        self.service, self.metrics, self.interval, self.action = service, metrics, interval, action
        # MPS daemons are checked every tick: a shared lease without its daemon runs without limits.
        self.mps = mps
        self._loop = Periodic("weft-watchdog", interval, self.tick, failed="watchdog.failed")
        self._last = time.monotonic()

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    def tick(self) -> list[Violation]:
        now = time.monotonic()
        elapsed, self._last = now - self._last, now
        self.service.release_dead(grace=DEAD_GRACE_S)
        if self.mps is not None:
            self.service.restore_mps()
        leases = [r for r in self.service.leases() if r.state is LeaseState.BOUND and r.cgroup]
        backend = self.service.backend
        usage: dict[tuple[str, str], tuple[int, list[int]]] = {}
        foreign: dict[str, list[tuple[str, int]]] = defaultdict(list)
        outside_mps: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
        sm = backend.process_utilization()
        busy: dict[str, int] = defaultdict(int)
        for proc in backend.processes():
            cg = cgroup_of(proc.pid)
            owner = next((r for r in leases if cg == r.cgroup or cg.startswith(r.cgroup.rstrip("/") + "/")), None)
            if owner is None:
                continue
            if proc.device_uuid not in owner.device_uuids:
                foreign[owner.lease_id].append((proc.device_uuid, proc.pid))
                continue
            if owner.shared and proc.mps_client is False:
                outside_mps[owner.lease_id].append((proc.device_uuid, proc.pid, proc.used_memory))
            busy[owner.lease_id] += sm.get(proc.pid, 0)
            used, pids = usage.get((owner.lease_id, proc.device_uuid), (0, []))
            usage[(owner.lease_id, proc.device_uuid)] = (used + proc.used_memory, [*pids, proc.pid])
        device_memory = {d.uuid: d.memory_total for d in self.service.devices}
        violations = find_violations(leases, usage, foreign, device_memory, outside_mps)
        by_id = {r.lease_id: r for r in leases}
        for v in violations:
            rec = by_id[v.lease_id]
            self.metrics.violations.labels(v.device_uuid, rec.pod, rec.namespace, rec.container, self.action).inc()
            _log.warning("lease.violation", lease=v.lease_id, device=v.device_uuid, used_bytes=v.used_bytes,
                         limit_bytes=v.limit_bytes, why=v.why.value, reason=v.why.name.lower().replace("_", "-"),
                         pids=list(v.pids), action=self.action, pod=rec.pod,
                         namespace=rec.namespace, container=rec.container, container_id=rec.container_id)
            if self.action == "kill":
                killed = kill_cgroup(rec.cgroup)
                _log.warning("lease.enforced", lease=v.lease_id, container_id=rec.container_id, killed=killed)
        self.metrics.account(self.service.leases(), self.service.devices, backend.utilization(), elapsed, busy)
        return violations


def kill_cgroup(cgroup: str) -> list[int]:
    """SIGKILL every process in the container's cgroup, and nothing outside it."""
    pids: set[int] = set()
    for controller in ("memory", "pids", "cpu,cpuacct", "unified", ""):
        procs = CGROUP_ROOT / controller / cgroup.lstrip("/") / "cgroup.procs"
        with contextlib.suppress(OSError):
            pids.update(int(p) for p in procs.read_text().split())
        if pids:
            break
    for pid in sorted(pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return sorted(pids)
