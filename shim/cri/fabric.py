"""What the intercepted verbs share: upstream, state, broker, metrics, the opted-in set, and the origin side.

The opted-in sandboxes are kept in memory (loaded from the state store at
start) so that a CreateContainer of a pod that did not opt in costs a dict
lookup, not a query. The GPU inventory is fetched from the broker once and
kept: devices do not come and go under a running broker.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shim import log
from shim._pb import broker_pb2 as pb
from shim.broker.client import BrokerClient
from shim.cri.cdi import CdiSpecs
from shim.cri.passthrough import Upstream
from shim.crishared.mark import ShadowsSeen
from shim.crishared.remote import RemoteContainers
from shim.crishared.sides import OriginSide
from shim.errors import BrokerUnavailable, WeftError
from shim.metrics import Metrics
from shim.state.agent import AgentStore, SandboxRecord

if TYPE_CHECKING:
    from shim.mesh.node import MeshNode

WEFT_HANDLER = "weft"
ReservationOf = Callable[[str], "dict | None"]
_log = log.get("weft.cri")


class Fabric:
    """What every intercepted verb has, complete once made: the agent builds it once, with its origin side when
    the node is on the mesh (``origin`` makes it from the fabric: the stitched network's loop reads the opted-in
    pods and remote containers kept here)."""

    def __init__(self, upstream: Upstream, store: AgentStore, broker: BrokerClient | None, metrics: Metrics, *,
                 cdi_specs: CdiSpecs | None = None, shadows: ShadowsSeen | None = None,
                 reservation_of: ReservationOf | None = None,
                 origin: Callable[[Fabric], OriginSide] | None = None) -> None:
        self.upstream = upstream
        self.store = store
        self.broker = broker
        self.metrics = metrics
        self.opted_in: dict[str, SandboxRecord] = {s.id: s for s in store.sandboxes() if s.opted_in}
        metrics.opted_in.set(len(self.opted_in))
        self._inventory: pb.DevicesResponse | None = None
        # The node's CDI specs (agent.cdi_spec_dirs): what names the GPUs of a DRA claim's CDI devices.
        self.cdi_specs = cdi_specs if cdi_specs is not None else CdiSpecs([])
        # Containers this node rerouted to peers (virtual IDs), and what they need for it.
        self.remotes = RemoteContainers(store)
        # This node's mark on the shadows it hosts, and whether containerd holds any: what the list verbs hide.
        self.shadows = shadows if shadows is not None else ShadowsSeen()
        # A shadow's reservation pod (name, state) by its key, on a host (weft status).
        self.reservation_of = reservation_of
        # The agent's last look at weft's place in containerd's configuration (None: not installed by weft install).
        self.host_config: dict[str, Any] | None = None
        # CreateContainer calls between their lease and their answer: recovery must not
        # take their pending rows (or their leases) for leftovers of a crash.
        self._inflight: set[str] = set()
        # Held while a GPU lease is acquired, and while the reconciler tells the broker
        # which keys are live: no lease can be granted between the list and the release.
        self.lease_gate = threading.Lock()
        self._lock = threading.Lock()
        # Last: the origin side's parts hold this fabric.
        self.origin: OriginSide | None = origin(self) if origin is not None else None

    @property
    def mesh(self) -> MeshNode | None:
        """This node's peer mesh (its origin side's); None on a node without one."""
        return self.origin.mesh if self.origin is not None else None

    def begin(self, key: str) -> bool:
        """Mark a CreateContainer in flight; False if one for the same key already is."""
        with self._lock:
            if key in self._inflight:
                return False
            self._inflight.add(key)
            return True

    def end(self, key: str) -> None:
        with self._lock:
            self._inflight.discard(key)

    def inflight(self) -> set[str]:
        with self._lock:
            return set(self._inflight)

    def pod_of(self, field: str, value: str) -> tuple[str, str] | None:
        """(pod, namespace) of an opted-in sandbox, or of a remote container's sandbox; None for anything else.

        Only what is in memory: the log line of every intercepted call asks.
        """
        sandbox_id = value
        if field == "container_id":
            r = self.remotes.get(value)
            if r is None:
                return None
            sandbox_id = r.sandbox_id
        rec = self.opted_in.get(sandbox_id)
        return (rec.name, rec.namespace) if rec is not None else None

    def remember(self, rec: SandboxRecord) -> None:
        self.store.add_sandbox(rec)
        with self._lock:
            self.opted_in[rec.id] = rec
            self.metrics.opted_in.set(len(self.opted_in))

    def forget(self, sandbox_id: str) -> None:
        with self._lock:
            self.opted_in.pop(sandbox_id, None)
            self.metrics.opted_in.set(len(self.opted_in))

    def require_broker(self) -> BrokerClient:
        if self.broker is None:
            raise BrokerUnavailable("weft: this agent has no GPU broker configured (--broker-socket)")
        return self.broker

    def release_quietly(self, lease_id: str, reason: str) -> None:
        """Release a lease; if the broker is away, its reconcile releases it later."""
        try:
            self.require_broker().release(lease_id, reason)
        except WeftError as exc:  # the caller's own outcome matters more than this
            _log.warning("lease.release_failed", lease=lease_id, error=exc.message)

    def inventory(self) -> pb.DevicesResponse:
        if self._inventory is None:
            self._inventory = self.require_broker().devices()
        return self._inventory
