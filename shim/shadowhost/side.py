"""A host's side of rerouting: shadow sandboxes and containers run for an origin's pod.

``HostSide`` makes the parts once, for the agent, and keeps them up (log
caps, emptyDir limits, CPU quotas, reservations); the mesh server hands each
of an origin's requests to the part that answers it (``hosting``, the mesh's
``ShadowHosting``). Each idea lives in a module of its own:

- ``lifecycle``: RunShadow, StartShadow, ShadowStatus, RemoveShadow and
  SyncVolumes, and what a host refuses to run;
- ``prepare``: shadow sandboxes made before a container asks, and the sweep
  of those no container uses;
- ``watch``: Watch and StreamLog, what the origin sees of its shadows;
- ``calls``: ShadowCall, the CRI calls an origin may make on a shadow, and the
  tunnels into it;
- ``fence``: at most one live copy, shadows of a silent origin killed;
- ``capacity``: the host's own requests and its shadows' limits, for Hellos;
- ``runtime``: this host's containerd, as all of them ask it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from cri_api.v1 import api_pb2 as cri

from shim import log
from shim.core.reservation import Verdict
from shim.crishared.labels import KEY_ANNOTATION, KEY_LABEL
from shim.errors import UpstreamError, WeftError
from shim.kube.access import ApiAccess
from shim.mesh.hosting import ShadowHosting
from shim.periodic import Periodic
from shim.shadowhost import logs as shadow_logs
from shim.shadowhost import volumes as shadow_volumes
from shim.shadowhost.calls import Calls
from shim.shadowhost.capacity import HostedCapacity
from shim.shadowhost.context import HostContext
from shim.shadowhost.fence import Fencer
from shim.shadowhost.group_weight import ShadowGroupWeight
from shim.shadowhost.lifecycle import Lifecycle
from shim.shadowhost.prepare import Preparer
from shim.shadowhost.reservations import Reservations, ReservationStore
from shim.shadowhost.runtime import RT, ShadowRuntime, label
from shim.shadowhost.watch import Watcher

_log = log.get("weft.shadows")
LOG_CAP_S = 5.0


class HostSide:
    def __init__(self, ctx: HostContext, state_dir: Path, *, fence_timeout: float = 8.0,
                 heartbeat_interval: float = 1.0, cgroup_parent: str = "/weft-shadows",
                 prepared_sandbox_ttl: float = 60.0) -> None:
        self.rt = ShadowRuntime(ctx)
        self.fencer = Fencer(self.rt, ctx, fence_timeout)
        self.capacity = HostedCapacity(self.rt, ctx.metrics)
        self.lifecycle = Lifecycle(self.rt, ctx, self.capacity, state_dir, cgroup_parent)
        self.preparer = Preparer(self.lifecycle, prepared_sandbox_ttl)
        self.watcher = Watcher(self.rt, self.lifecycle, heartbeat_interval)
        self.calls = Calls(self.rt, self.capacity, self.lifecycle.limiter)
        # What the mesh server calls for each of an origin's requests.
        self.hosting = ShadowHosting(fence=self.fencer, lifecycle=self.lifecycle, preparer=self.preparer,
                                     watcher=self.watcher, calls=self.calls, capacity=self.capacity)
        self.reservations: Reservations | None = None
        # Logs no origin reads now (it is away) are kept to their backlog cap all the same; emptyDirs to theirs.
        self._upkeep = Periodic("weft-shadow-upkeep", LOG_CAP_S, self.upkeep, failed="shadow.upkeep_failed")

    # -- the agent's ---------------------------------------------------------------
    def reserve_with(self, api: ApiAccess, node: str, namespace: str, pause_image: str | Callable[[], str], *,
                     grace: float,
                     metrics: Any = None, store: ReservationStore | None = None) -> None:
        """Give every shadow a reservation pod on this host (``reservations``), through the Kubernetes API; their
        records kept in ``store`` (the agent's state store) across restarts."""
        self.reservations = Reservations(api, node, namespace, pause_image, self._reservation_lost,
                                         self._live_keys, grace=grace, metrics=metrics, store=store)
        self.lifecycle.reservations = self.reservations
        # Shadows on Kubernetes' books run at their requests' weight, and their cgroup weighs the sum of those
        # (shim.shadowhost.group_weight); without, each runs at the floor and the group is left as it is.
        self.capacity.group = ShadowGroupWeight(self.lifecycle.cgroup_parent)

    def open(self) -> None:
        self.settle_limits()
        self.fencer.open()
        self.preparer.open()
        self._upkeep.start()
        if self.reservations is not None:
            self.reservations.start()

    def close(self) -> None:
        self._upkeep.stop()
        self.lifecycle.limiter.close()
        self.fencer.close()
        self.preparer.close()
        if self.reservations is not None:
            self.reservations.stop()

    def upkeep(self) -> None:
        self.cap_logs()
        self.check_empty_dirs()
        self.settle_limits()

    def settle_limits(self) -> None:
        """Every running shadow has its CPU quota (shim.shadowhost.cpu_limit); containerd away: the next round."""
        try:
            self.lifecycle.limiter.settle(self.lifecycle.mark.is_container)
        except WeftError as exc:
            _log.warning("shadow.limit_settle_failed", error=exc.message)

    def cap_logs(self) -> None:
        """Every shadow log on this host kept to the backlog cap (``shim.shadowhost.logs.cap``)."""
        for path in self.lifecycle.log_root.rglob("*.log"):
            try:
                freed = shadow_logs.cap(path)
            except OSError:
                continue  # removed meanwhile
            if freed:
                _log.info("shadow.log_capped", path=str(path), freed=freed)

    def check_empty_dirs(self) -> None:
        """A shadow whose emptyDir holds more than its ``sizeLimit`` is stopped, as kubelet evicts such a pod."""
        for limit_file in self.lifecycle.volume_root.glob("*/*/empty-*.limit"):
            try:
                limit = json.loads(limit_file.read_text())
                used = shadow_volumes.used_bytes(limit_file.with_suffix(""))
            except (OSError, ValueError):
                continue  # removed meanwhile
            if used <= limit["bytes"]:
                continue
            detail = f"Usage of emptyDir volume at {limit['path']} exceeds its sizeLimit of {limit['bytes']} bytes"
            for c in self.rt.find({KEY_LABEL: limit_file.parent.name}, containers=True):
                if c.state != cri.CONTAINER_RUNNING or not self.lifecycle.mark.is_container(c.labels):
                    continue
                self.rt.reasons[c.id] = ("Evicted", detail)
                self.rt.stop(c.id)
                self.capacity.forget()
                _log.warning("shadow.evicted", container_id=c.id, key=c.annotations.get(KEY_ANNOTATION, ""),
                             used=used, detail=detail)

    def _live_keys(self) -> list[str]:
        """The keys of the shadows that hold CPU now (created or running): each should have a reservation."""
        return [c.annotations[KEY_ANNOTATION] for c in self.rt.containers()
                if self.lifecycle.mark.is_container(c.labels) and KEY_ANNOTATION in c.annotations
                and c.state in (cri.CONTAINER_CREATED, cri.CONTAINER_RUNNING)]

    def _reservation_lost(self, key: str, v: Verdict) -> None:
        """Kubernetes took the stage's reservation away: its shadow stops now, with the reason for the origin.

        Its sandbox stops too once no other shadow of it is made or running (a drained host keeps nothing of
        the pod running; the stopped container stays for its origin to read and remove, and a later stage
        of the pod here gets a new sandbox)."""
        sandboxes = set()
        for c in self.rt.find({KEY_LABEL: label(key)}, containers=True):
            if c.state not in (cri.CONTAINER_CREATED, cri.CONTAINER_RUNNING):
                continue
            self.rt.reasons[c.id] = (v.reason.value if v.reason else "ReservationLost", v.detail)
            self.rt.stop(c.id)
            self.capacity.forget()
            sandboxes.add(c.pod_sandbox_id)
            _log.warning("shadow.reservation_lost", key=key, container_id=c.id,
                         reason=v.reason.value if v.reason else "", detail=v.detail)
        for sandbox_id in sandboxes:
            with self.lifecycle.lock:  # no RunShadow puts a container in it meanwhile
                # Another stage of the pod keeps it; this one's made shadow does not (its start is refused now).
                if any(c.pod_sandbox_id == sandbox_id and c.state in (cri.CONTAINER_CREATED, cri.CONTAINER_RUNNING)
                       and c.labels.get(KEY_LABEL) != label(key) for c in self.rt.containers()):
                    continue
                try:
                    self.rt.call(RT + "StopPodSandbox", cri.StopPodSandboxRequest(pod_sandbox_id=sandbox_id),
                                 cri.StopPodSandboxResponse)
                except UpstreamError as exc:
                    if exc.code is not grpc.StatusCode.NOT_FOUND:
                        _log.warning("shadow.sandbox_stop_failed", key=key, sandbox_id=sandbox_id, error=exc.message)
                    continue
            _log.info("shadow.sandbox_stopped", key=key, sandbox_id=sandbox_id, why="reservation lost")

    def reservation(self, key: str) -> dict | None:
        """For ``weft status``: the shadow's reservation (name, state), when this host makes them."""
        return None if self.reservations is None else self.reservations.state(key)
