"""Settling what a crash left half-done, at start and then periodically.

First it notes whether containerd holds shadows (the list verbs hide them, ``verbs.listing``). A
placement still ``pending`` means the agent died between leasing and
answering kubelet: if containerd has the container (matched by sandbox, name
and attempt), the record is completed; if not, the lease is released and the
record dropped. Then the broker is told which lease keys the agent still
knows, and releases unbound leases with any other key (an Acquire whose
CreateContainer never happened). Keys of CreateContainer calls still in
flight are left alone: this runs every 30 s beside live traffic. Nothing is
leaked and nothing is granted twice, whichever process was killed and when.
"""

from __future__ import annotations

from cri_api.v1 import api_pb2 as cri

from shim import failpoint, log
from shim.core.placement import PlacementState
from shim.cri.fabric import Fabric
from shim.crishared.labels import ORIGIN_LABEL
from shim.errors import WeftError
from shim.periodic import Periodic

_log = log.get("weft.recovery")
_LIST = "/runtime.v1.RuntimeService/ListContainers"


def find_shadows(fabric: Fabric) -> None:
    """Note whether containerd holds shadow sandboxes, so the List verbs hide them (or pass through)."""
    list_sandboxes = fabric.upstream.channel.unary_unary(
        "/runtime.v1.RuntimeService/ListPodSandbox", request_serializer=cri.ListPodSandboxRequest.SerializeToString,
        response_deserializer=cri.ListPodSandboxResponse.FromString)
    since = fabric.shadows.looking()
    items = list_sandboxes(cri.ListPodSandboxRequest(), timeout=10).items
    mark = fabric.shadows.mark  # a tenant's pod may carry the label: only what this node marked counts
    present = any(ORIGIN_LABEL in sb.labels and (mark is None or mark.is_sandbox(sb.labels, sb.metadata.uid))
                  for sb in items)
    if fabric.shadows.looked(present, since):
        _log.info("shadows.present" if fabric.shadows.present else "shadows.none")


def settle(fabric: Fabric) -> None:
    failpoint.pause("recovery.settle")  # a reconciler that comes late, as on a loaded node (tests)
    find_shadows(fabric)
    inflight = fabric.inflight()
    pending = [p for p in fabric.store.placements() if p.state is PlacementState.PENDING and p.key not in inflight]
    if pending:
        list_containers = fabric.upstream.channel.unary_unary(
            _LIST, request_serializer=cri.ListContainersRequest.SerializeToString,
            response_deserializer=cri.ListContainersResponse.FromString)
        for p in pending:
            found = list_containers(cri.ListContainersRequest(filter=cri.ContainerFilter(pod_sandbox_id=p.sandbox_id)),
                                    timeout=10).containers
            match = next((c for c in found if c.metadata.name == p.name and c.metadata.attempt == p.attempt), None)
            if match is not None:
                fabric.store.mark_created(p.key, match.id)
                _log.info("recovery.completed", key=p.key, container_id=match.id, lease=p.lease_id or None)
            else:
                fabric.store.drop_placement(p.key)
                if p.lease_id and fabric.broker is not None:
                    fabric.broker.release(p.lease_id, "create-never-finished")
                _log.info("recovery.dropped", key=p.key, lease=p.lease_id or None)
    if fabric.broker is not None:
        # Keys of calls still in flight count as live: their lease may not be on record yet;
        # the gate keeps a new lease from being granted between this list and the broker's release.
        with fabric.lease_gate:
            live = sorted({p.key for p in fabric.store.placements()} | fabric.inflight())
            released = fabric.broker.reconcile(live)
        if released:
            _log.info("recovery.leases_released", leases=released)


class Reconciler:
    """Runs ``settle`` now and every ``interval`` seconds; a broker or containerd away is retried later."""

    def __init__(self, fabric: Fabric, interval: float = 30.0) -> None:
        self.fabric, self.interval = fabric, interval
        self._loop = Periodic("weft-reconcile", interval, self._round, failed="recovery.crashed", first=True)

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    def _round(self) -> None:
        try:
            settle(self.fabric)
        except (WeftError, OSError) as exc:
            _log.warning("recovery.deferred", error=getattr(exc, "message", str(exc)))
        except Exception:  # noqa: BLE001 - e.g. containerd away (grpc.RpcError): try again later
            _log.warning("recovery.deferred", exc_info=True)
