"""Enforcement: sample per-process GPU memory, map processes to leases by cgroup, act on violators only.

Every interval the watchdog reads the backend's processes, finds each one's
cgroup (``/proc/<pid>/cgroup``) and the bound lease whose container cgroup
holds it, and sums its memory per lease and device. A lease over its memory,
or a process on a device its lease does not include, is a violation: logged
(``lease.violation``), counted, and with ``action="kill"`` that container's
processes (and only those: the lease's own cgroup) get SIGKILL. It also
releases bound leases whose container is gone, restarts MPS daemons that
died, and accumulates held and active GPU-seconds for the metrics.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from shim import log
from shim.broker.metrics import BrokerMetrics
from shim.broker.service import LeaseService
from shim.core.leases import LeaseState
from shim.state.leases import LeaseRecord

_log = log.get("weft.broker.watchdog")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# How long a bound lease's container must have been gone before the watchdog releases it:
# long enough for the poststop hook (the normal path) to do it first.
DEAD_GRACE_S = 5.0


@dataclass(frozen=True)
class Violation:
    lease_id: str
    device_uuid: str
    used_bytes: int
    limit_bytes: int
    pids: tuple[int, ...]
    why: str


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
                    foreign: dict[str, list[tuple[str, int]]], device_memory: dict[str, int]) -> list[Violation]:
    """usage: (lease, device) -> (bytes, pids); foreign: lease -> [(device, pid)] on devices outside the lease."""
    by_id = {r.lease_id: r for r in leases}
    out = []
    for (lease_id, dev), (used, pids) in usage.items():
        rec = by_id[lease_id]
        limit = rec.memory_bytes if rec.shared else device_memory.get(dev, rec.memory_bytes)
        if used > limit:
            out.append(Violation(lease_id, dev, used, limit, tuple(pids), "over its memory lease"))
    for lease_id, items in foreign.items():
        for dev, pid in items:
            out.append(Violation(lease_id, dev, 0, 0, (pid,), "on a device outside its lease"))
    return out


class Watchdog:
    def __init__(self, service: LeaseService, metrics: BrokerMetrics, *, interval: float = 1.0,
                 action: str = "log", mps=None) -> None:
        if action not in ("log", "kill"):
            raise ValueError(f"enforcement action {action!r} is not log or kill")
        self.service, self.metrics, self.interval, self.action = service, metrics, interval, action
        # MPS daemons are checked every tick: a shared lease without its daemon runs without limits.
        self.mps = mps
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weft-watchdog", daemon=True)
        self._last = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - one bad sample must not end enforcement
                _log.exception("watchdog.failed")

    def tick(self) -> list[Violation]:
        now = time.monotonic()
        elapsed, self._last = now - self._last, now
        self.service.release_dead(grace=DEAD_GRACE_S)
        if self.mps is not None:
            self.mps.check()
        leases = [r for r in self.service.leases() if r.state is LeaseState.BOUND and r.cgroup]
        backend = self.service.backend
        usage: dict[tuple[str, str], tuple[int, list[int]]] = {}
        foreign: dict[str, list[tuple[str, int]]] = defaultdict(list)
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
            busy[owner.lease_id] += sm.get(proc.pid, 0)
            used, pids = usage.get((owner.lease_id, proc.device_uuid), (0, []))
            usage[(owner.lease_id, proc.device_uuid)] = (used + proc.used_memory, [*pids, proc.pid])
        device_memory = {d.uuid: d.memory_total for d in self.service.devices}
        violations = find_violations(leases, usage, foreign, device_memory)
        by_id = {r.lease_id: r for r in leases}
        for v in violations:
            rec = by_id[v.lease_id]
            self.metrics.violations.labels(v.device_uuid, rec.pod, rec.namespace, rec.container, self.action).inc()
            _log.warning("lease.violation", lease=v.lease_id, device=v.device_uuid, used_bytes=v.used_bytes,
                         limit_bytes=v.limit_bytes, why=v.why, action=self.action, pod=rec.pod,
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
