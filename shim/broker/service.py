"""The broker's lease logic behind ``proto/broker.proto``: acquire, bind, release, list.

Decisions come from ``shim.core.packing`` (where a lease goes) and
``shim.core.leases`` (which transitions are allowed); this module applies them
to the store, the backend and the MPS daemons under one lock, so two
concurrent Acquires never see the same free memory. Each fact is in the
store before the call returns; the service keeps a copy of the live leases in
memory (loaded at start, changed only together with the store) so an Acquire
does not re-read and re-decode every lease from SQLite.

A MIG-enabled GPU is never leased, whole or shared: CUDA runs only on its MIG
instances, which the backend lists as devices of their own and which are
leased by their UUIDs like any GPU.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from shim import failpoint, log
from shim.broker.backend import Backend, DeviceNodesUnknown, GpuDevice
from shim.broker.mps import MpsError, MpsLimits
from shim.core import packing
from shim.core.leases import LeaseConflict, LeaseState, check_bind
from shim.errors import BadAnnotation, LeaseConflictError, LeaseNotFound, LeaseRefused
from shim.state.leases import LeaseRecord, LeaseStore, new_lease_id, replace

_log = log.get("weft.broker")

# Where a shared lease's MPS pipe directory appears inside the container.
MPS_PIPE_IN_CONTAINER = "/run/weft-mps"
# MPS's own default pipe directory: a client that unsets CUDA_MPS_PIPE_DIRECTORY
# looks here, and must find its lease's daemon, not run outside MPS.
MPS_DEFAULT_PIPE = "/tmp/nvidia-mps"


class MpsLike(Protocol):
    """What the service needs of an MPS supervisor (the real one: ``shim.broker.mps``)."""

    # The daemon has .pipe_dir and .shm_dir; private_shm says whether its clients must share .shm_dir as /dev/shm.
    private_shm: bool

    def ensure(self, key: str, device_uuid: str, limits: MpsLimits | None = None) -> Any: ...

    # A daemon for a new lease, its key the lease's ID (one started ahead where the supervisor keeps a pool).
    def take(self, device_uuid: str, limits: MpsLimits) -> Any: ...

    def warm(self, device_uuids: Iterable[str]) -> None: ...

    def idle(self) -> list[Any]: ...  # the pool's daemons no lease has taken (each has .device_uuid)

    def stop(self, key: str) -> None: ...


class LeaseService:
    def __init__(self, backend: Backend, store: LeaseStore, mps: MpsLike | None = None) -> None:
        self.backend = backend
        self.store = store
        self.mps = mps
        self._lock = threading.Lock()
        self._devices = backend.devices()
        self._by_uuid = {d.uuid: d for d in self._devices}
        self._leasable = [d for d in self._devices if d.leasable]
        self._live: dict[str, LeaseRecord] = {r.lease_id: r for r in store.all()}
        self._dead_since: dict[str, float] = {}  # lease -> when its container was first seen gone

    @property
    def devices(self) -> list[GpuDevice]:
        return self._devices

    # -- acquire ---------------------------------------------------------------
    def acquire(self, *, key: str, namespace: str, pod: str, pod_uid: str, container: str, sandbox_id: str,
                memory_bytes: int, compute_percent: int, count: int, allowed: Iterable[str]) -> LeaseRecord:
        if not key:
            raise BadAnnotation("Acquire: key is required (<sandbox id>/<container>/<attempt>)")
        compute = compute_percent or 100
        if not 1 <= compute <= 100:
            raise BadAnnotation(f"Acquire: compute_percent {compute_percent} is outside 1..100")
        allowed_set = frozenset(allowed) or None
        unknown = sorted((allowed_set or frozenset()) - self._by_uuid.keys())
        if unknown:
            raise BadAnnotation(f"Acquire: allowed devices {', '.join(unknown)} are not on this node")
        allowed_set = self._without_mig_gpus(allowed_set, key, namespace, pod, container)
        largest = max((d.memory_total for d in self._leasable), default=0)
        if memory_bytes > largest:
            raise BadAnnotation(f"Acquire: {memory_bytes} bytes is larger than any device ({largest} bytes)")
        ask = packing.Ask(memory_bytes=memory_bytes or None, compute_percent=compute,
                          count=1 if memory_bytes else max(count, 1), allowed=allowed_set)
        with self._lock:
            existing = next((r for r in self._live.values() if r.key == key), None)
            if existing is not None:  # a retried CreateContainer: the same lease, never a second one
                return existing
            capacities = [packing.DeviceCapacity(d.uuid, d.index, d.memory_total) for d in self._leasable]
            decision = packing.pack(ask, capacities, self._held())
            if not decision.ok:
                _log.info("lease.refused", key=key, pod=pod, namespace=namespace, container=container,
                          reason=decision.reason.value, detail=decision.detail)
                raise LeaseRefused(f"no GPU for {namespace}/{pod}/{container}: {decision.detail}")
            record = self._record(key, namespace, pod, pod_uid, container, sandbox_id, ask, decision)
            try:
                self.store.insert(record)
            except BaseException:
                if record.shared and self.mps is not None:
                    self.mps.stop(record.lease_id)  # a daemon no stored lease names would serve no one
                raise
            self._live[record.lease_id] = record
            failpoint.hit("broker.lease.stored")
        _log.info("lease.acquired", lease=record.lease_id, pod=pod, namespace=namespace, container=container,
                  devices=list(record.device_uuids), memory_bytes=record.memory_bytes,
                  compute_percent=record.compute_percent, shared=record.shared, reason=decision.reason.value)
        return record

    def _without_mig_gpus(self, allowed: frozenset[str] | None, key: str, namespace: str, pod: str,
                          container: str) -> frozenset[str] | None:
        """The packing domain less MIG-enabled GPUs; LeaseRefused where that leaves nothing, saying why."""
        mig_gpus = [d for d in self._devices if d.mig_enabled and (allowed is None or d.uuid in allowed)]
        if not mig_gpus:
            return allowed
        left = None if allowed is None else frozenset(u for u in allowed if self._by_uuid[u].leasable)
        if (left is None and self._leasable) or left:
            return left
        parts = []
        for gpu in mig_gpus:
            instances = [d.uuid for d in self._devices if d.parent_uuid == gpu.uuid]
            parts.append(f"GPU {gpu.uuid} has MIG on: " + (
                f"the broker leases its MIG instances ({', '.join(instances)}) by their own UUIDs, not the GPU"
                if instances else "it has no MIG instances, so there is nothing on it to lease"))
        _log.info("lease.refused", key=key, pod=pod, namespace=namespace, container=container, reason="mig-gpu",
                  detail="; ".join(parts))
        raise LeaseRefused(f"no GPU for {namespace}/{pod}/{container}: {'; '.join(parts)}")

    def _held(self) -> list[packing.Held]:
        held = []
        for rec in self._live.values():
            for dev in rec.device_uuids:
                device = self._by_uuid.get(dev)
                if device is None:  # a lease on a device this node no longer shows: it holds nothing here
                    continue
                held.append(packing.Held(dev, rec.memory_bytes if rec.shared else device.memory_total,
                                         rec.compute_percent if rec.shared else 100, exclusive=not rec.shared))
        return held

    def _record(self, key, namespace, pod, pod_uid, container, sandbox_id, ask: packing.Ask,
                decision: packing.PackDecision) -> LeaseRecord:
        devices = [self._by_uuid[u] for u in decision.devices]
        uuids = ",".join(d.uuid for d in devices)
        lease_id = new_lease_id()
        env = {"NVIDIA_VISIBLE_DEVICES": uuids, "CUDA_VISIBLE_DEVICES": uuids}
        mounts: list[tuple[str, str, bool]] = []
        memory = ask.memory_bytes or 0
        # Before the MPS daemon starts: a device whose nodes cannot be named must not leave a daemon behind.
        try:
            nodes = [n for d in devices for n in self.backend.device_nodes(d.uuid)]
        except DeviceNodesUnknown as exc:
            raise LeaseRefused(f"no GPU for {namespace}/{pod}/{container}: {exc}") from exc
        if nodes:
            nodes += self.backend.control_nodes()
        if decision.shared:
            device = devices[0]
            env["CUDA_MPS_PIPE_DIRECTORY"] = MPS_PIPE_IN_CONTAINER
            # What the lease's MPS server already holds every client to (see shim.broker.mps); a client that
            # keeps these gains nothing, one that drops them loses nothing. MPS takes the limit per device
            # ordinal as the client sees it: one device, ordinal 0.
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={math.ceil(memory / (1 << 20))}M"
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(ask.compute_percent)
            if self.mps is not None:
                daemon = self.mps.take(device.uuid, MpsLimits(memory, ask.compute_percent))
                lease_id = daemon.key  # its directory's name
                mounts.append((str(daemon.pipe_dir), MPS_PIPE_IN_CONTAINER, False))
                mounts.append((str(daemon.pipe_dir), MPS_DEFAULT_PIPE, False))
                if self.mps.private_shm:
                    mounts.append((str(daemon.shm_dir), "/dev/shm", False))
        return LeaseRecord(
            lease_id=lease_id, key=key, namespace=namespace, pod=pod, pod_uid=pod_uid,
            container=container, sandbox_id=sandbox_id, device_uuids=tuple(d.uuid for d in devices),
            device_indices=tuple(d.index for d in devices),
            memory_bytes=memory if decision.shared else sum(d.memory_total for d in devices),
            compute_percent=ask.compute_percent if decision.shared else 100, shared=decision.shared,
            state=LeaseState.ACQUIRED, env=env, mounts=tuple(mounts), device_nodes=tuple(nodes),
            created_at=time.time(), reason=decision.reason.value, detail=decision.detail,
        )

    # -- bind / release ----------------------------------------------------------
    def bind(self, lease_id: str, container_id: str, pid: int, cgroup: str,
             owner: tuple[str, str] | None = None) -> LeaseRecord:
        if pid <= 0 or not container_id:
            raise BadAnnotation(f"Bind of {lease_id}: needs the container's id and pid (got {container_id!r}, {pid})")
        with self._lock:
            rec = self._live.get(lease_id)
            if rec is None:
                raise LeaseNotFound(f"lease {lease_id} does not exist (released, or never granted on this node)")
            _check_owner(rec, owner)
            try:
                check = check_bind(rec.state, rec.container_id, container_id)
            except LeaseConflict as exc:
                raise LeaseConflictError(f"lease {lease_id}: {exc}") from exc
            rec = replace(rec, state=check.next_state, container_id=container_id or rec.container_id,
                          pid=pid, cgroup=cgroup, bound_at=time.time())
            self.store.update(rec)
            self._live[lease_id] = rec
        _log.info("lease.bound", lease=lease_id, container_id=container_id, pid=pid, cgroup=cgroup,
                  pod=rec.pod, namespace=rec.namespace, container=rec.container)
        return rec

    def release(self, lease_id: str, reason: str = "", *, only_if: Callable[[LeaseRecord], bool] | None = None,
                owner: tuple[str, str] | None = None) -> bool:
        """Release a lease; False when it is gone already, or ``only_if`` no longer holds for it.

        ``only_if`` is checked under the lock, so a decision made on a snapshot
        (reconcile, dead-container sweep) cannot release a lease that changed
        since. ``owner`` (sandbox id, container name), from the hook, must match.
        """
        with self._lock:
            rec = self._live.get(lease_id)
            if rec is None or (only_if is not None and not only_if(rec)):
                return False
            _check_owner(rec, owner)
            self.store.delete(lease_id)
            del self._live[lease_id]
            if rec.shared and self.mps is not None:
                self.mps.stop(lease_id)  # its server, and with it any client still attached
        _log.info("lease.released", lease=lease_id, reason=reason or "requested", pod=rec.pod,
                  namespace=rec.namespace, container=rec.container, container_id=rec.container_id)
        return True

    def reconcile(self, live_keys: Iterable[str]) -> list[str]:
        """Release unbound leases whose key the agent no longer knows."""
        live = set(live_keys)
        stale = [r.lease_id for r in self.leases() if r.state is LeaseState.ACQUIRED and r.key not in live]
        return [lease_id for lease_id in stale
                if self.release(lease_id, reason="unknown-to-agent",
                                only_if=lambda r: r.state is LeaseState.ACQUIRED and r.key not in live)]

    def release_dead(self, grace: float = 0.0) -> list[str]:
        """Release bound leases whose container is gone (the poststop hook may never have run).

        With ``grace``, a lease is released only once its container has been seen gone for that
        long across calls: the poststop hook, which runs when containerd deletes the task, stays
        the normal path and this sweep the fallback.
        """
        now = time.monotonic()
        dead = [r for r in self.leases() if r.state is LeaseState.BOUND and not _alive(r.pid, r.cgroup)]
        first = {r.lease_id: self._dead_since.get(r.lease_id, now) for r in dead}
        self._dead_since = first
        dead = [r for r in dead if now - first[r.lease_id] >= grace]
        return [r.lease_id for r in dead
                if self.release(r.lease_id, reason="container-gone",
                                only_if=lambda now, was=r: now.state is LeaseState.BOUND and now.pid == was.pid)]

    def restore_mps(self) -> list[str]:
        """Start (or restart) the MPS daemon of every shared lease; returns the leases left without one.

        Run when the broker starts and at every watchdog tick: a shared lease
        without its daemon would let its container's next CUDA client run
        outside MPS. A daemon that cannot start is logged and tried again at
        the next tick; the lease stays, as its container still runs.
        """
        missing: list[str] = []
        if self.mps is None:
            return missing
        # Under the lock, like Acquire and Release: a lease released meanwhile must not get its daemon back.
        with self._lock:
            for rec in sorted(self._live.values(), key=lambda r: r.created_at):
                if not rec.shared:
                    continue
                try:
                    self.mps.ensure(rec.lease_id, rec.device_uuids[0],
                                    MpsLimits(rec.memory_bytes, rec.compute_percent))
                except (MpsError, OSError) as exc:
                    _log.error("mps.restore_failed", lease=rec.lease_id, device=rec.device_uuids[0], error=str(exc))
                    missing.append(rec.lease_id)
        return missing

    def mps_pool(self) -> dict[str, int]:
        """Idle MPS daemons started ahead, per device (none without a supervisor or a pool)."""
        idle: dict[str, int] = {}
        for daemon in self.mps.idle() if self.mps is not None else []:
            idle[daemon.device_uuid] = idle.get(daemon.device_uuid, 0) + 1
        return idle

    def warm_mps(self) -> None:
        """Have the MPS supervisor start daemons ahead for the devices a share can be leased on."""
        if self.mps is not None:
            self.mps.warm(d.uuid for d in self._leasable)

    def leases(self) -> list[LeaseRecord]:
        with self._lock:
            return sorted(self._live.values(), key=lambda r: (r.created_at, r.lease_id))


def _check_owner(rec: LeaseRecord, owner: tuple[str, str] | None) -> None:
    """A hook may only bind or release the lease of its own container (sandbox id, container name)."""
    if owner is None or not all(owner):
        return
    if owner != (rec.sandbox_id, rec.container):
        raise LeaseConflictError(f"lease {rec.lease_id} belongs to {rec.namespace}/{rec.pod}/{rec.container} "
                                 f"(sandbox {rec.sandbox_id[:12]}), not to container {owner[1]!r} of sandbox "
                                 f"{owner[0][:12]}")


def _alive(pid: int, cgroup: str) -> bool:
    """The bound process still runs in the cgroup it was bound with (PIDs get reused)."""
    if pid <= 0:
        return False
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False
    return not cgroup or cgroup in text
