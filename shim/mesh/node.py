"""This agent's place in the mesh: serve it, find peers, and keep a fresh view of each.

Started by the agent when ``mesh.address`` is set. Peers come from a static
peers file or from Kubernetes (the DaemonSet's EndpointSlices); every
``hello_interval`` the node says Hello to each peer over mutual TLS and
keeps what the peer answers (role, free capacity, health) as a
``shim.core.reroute.PeerView``: what placement reads. A peer that stops
answering is marked unhealthy at once and logged once (``peer.lost``), and
logged again when it is back (``peer.up``).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shim import log
from shim._pb import mesh_pb2 as pb
from shim.core.reroute import PeerView, Resources
from shim.errors import WeftError
from shim.kube.access import ApiAccess
from shim.mesh.capacity import DRAINING, CapacityProbe, fixed_host
from shim.mesh.client import PeerClient
from shim.mesh.discovery import (
    Discovery,
    DiscoveryError,
    EndpointSliceDiscovery,
    Peer,
    StaticDiscovery,
    load_peers_file,
)
from shim.mesh.identity import PeerPolicy
from shim.mesh.server import MeshServer
from shim.mesh.tlsreload import NodeTls
from shim.periodic import Periodic

_log = log.get("weft.mesh")


@dataclass
class PeerRecord:
    peer: Peer
    role: str = ""
    state: pb.PeerState | None = None
    seen_at: float = 0.0  # monotonic
    healthy: bool = False
    error: str = ""


class MeshNode:
    def __init__(self, *, node: str, role: str, address: str, peers: str, tls_dir: str, hello_interval: float,
                 namespace: str, service: str, metrics: Any, host: Any = None, fixed_capacity: str = "",
                 drain_file: Path | None = None, api: ApiAccess | None = None) -> None:
        self.node, self.role, self.hello_interval, self.metrics = node, role, hello_interval, metrics
        self.tls = NodeTls(tls_dir, node)  # reloaded when the keeper renews the certificate
        self.discovery: Discovery
        declared: dict[str, str] = {}
        if peers == "kubernetes" and api is not None and api.available:
            self.discovery = EndpointSliceDiscovery(namespace, service, self_node=node, client_factory=api.client)
        elif peers == "kubernetes":
            # No API to find peers through: the node runs alone (everything placed locally) rather than not at all,
            # and says why once; the node's kubelet keeps its runtime either way.
            _log.warning("mesh.no_api", detail="mesh.peers is \"kubernetes\" but the agent has no Kubernetes API "
                         "configuration (--kubeconfig, [kubernetes] kubeconfig, or in-cluster): no peers")
            self.discovery = StaticDiscovery([])
        else:
            found, declared = load_peers_file(peers, self_node=node)
            self.discovery = StaticDiscovery(found)
        # A host's books: its own pods' requests and what it hosts, from its containerd (cached there).
        books = {} if host is None else {"own_requests": host.own_requests, "hosted_limits": host.hosted_limits}
        self.probe = CapacityProbe(role, host=fixed_host(fixed_capacity), **books)
        # A drain outlives a restart of the agent: it ends with ``weft drain --undo``.
        self._drain_file = drain_file
        self.probe.draining = drain_file is not None and drain_file.exists()
        self.policy = PeerPolicy(set())
        # A node that offers CPU runs shadows for its peers' pods.
        self.server = MeshServer(node, address, self.tls, self.policy, self.probe,
                                 host=host if "cpu" in role.split(",") else None)
        self._declared = declared
        self._lock = threading.Lock()
        self._records: dict[str, PeerRecord] = {}
        self._clients: dict[str, PeerClient] = {}
        self._stop = threading.Event()
        self._hellos = Periodic("weft-mesh-hello", hello_interval, self.hello_all, failed="mesh.hello_failed",
                               first=True)
        # Last time each peer was heard from (monotonic); a restarted origin gives every host the loss timeout.
        self._contact: dict[str, float] = {}
        self._started = time.monotonic()

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        try:
            self._set_peers(self.discovery.list())
        except DiscoveryError as exc:  # the API away, or its credentials not written yet: the watch keeps asking
            _log.warning("mesh.discovery.deferred", error=exc.message)
            self._set_peers([])
        self.server.start()
        self._hellos.start()
        threading.Thread(target=self.discovery.watch, args=(self._set_peers, self._stop),
                         name="weft-mesh-discovery", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self._hellos.stop()
        self.server.stop()
        for c in self._clients.values():
            c.close()

    def _set_peers(self, peers: list[Peer]) -> None:
        with self._lock:
            wanted = {p.node: p for p in peers}
            for node in set(self._records) - set(wanted):
                self._records.pop(node)
                client = self._clients.pop(node, None)
                if client is not None:
                    client.close()
            for node, peer in wanted.items():
                rec = self._records.get(node)
                if rec is None or rec.peer != peer:
                    self._records[node] = PeerRecord(peer, role=self._declared.get(node, ""))
                    old = self._clients.pop(node, None)
                    if old is not None:
                        old.close()
                    self._clients[node] = PeerClient(node, peer.target, self.tls)
            # Only nodes we know may talk to us.
            self.policy.set_known(set(wanted))
        _log.info("mesh.peers", peers=sorted(wanted))

    # -- hello ---------------------------------------------------------------------
    def hello_all(self) -> None:
        mine = self.probe.sample()
        mine.node = self.node
        with self._lock:
            targets = list(self._clients.items())
        for node, client in targets:
            try:
                state = client.hello(mine)
            except WeftError as exc:
                self._mark(node, None, exc.message)
            else:
                self._mark(node, state, "")

    def _mark(self, node: str, state: pb.PeerState | None, error: str) -> None:
        with self._lock:
            rec = self._records.get(node)
            if rec is None:
                return
            was = rec.healthy
            if state is not None:
                rec.state, rec.seen_at, rec.role, rec.error = state, time.monotonic(), state.role, ""
                self._contact[node] = rec.seen_at
                rec.healthy = state.healthy
            else:
                rec.healthy, rec.error = False, error
        if was and not rec.healthy:
            _log.warning("peer.lost", peer=node, error=error)
        elif rec.healthy and not was:
            _log.info("peer.up", peer=node, role=rec.role)
        self.metrics.mesh_peer_up.labels(node).set(1 if rec.healthy else 0)

    # -- what the origin's remote containers use ----------------------------------------
    def client(self, node: str) -> PeerClient | None:
        with self._lock:
            return self._clients.get(node)

    def hosts(self) -> list[str]:
        """Peers that may host containers: CPU hosts as they said or as declared, and those not yet heard."""
        with self._lock:
            return sorted(n for n, rec in self._records.items() if not rec.role or "cpu" in rec.role.split(","))

    def heard(self, node: str) -> None:
        """A message from ``node`` arrived (a Watch heartbeat or state): it is alive."""
        now = time.monotonic()
        with self._lock:
            self._contact[node] = now

    def silent_for(self, node: str) -> float:
        """Seconds since ``node`` was last heard from (by Hello or Watch); counted from start at first."""
        with self._lock:
            return time.monotonic() - self._contact.get(node, self._started)

    # -- drain --------------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        return self.probe.draining

    def set_draining(self, on: bool) -> None:
        """Stop (or resume) admitting new shadows; peers learn it with the next Hello, Admit at once."""
        if self._drain_file is not None:
            if on:
                self._drain_file.parent.mkdir(parents=True, exist_ok=True)
                self._drain_file.touch()
            else:
                self._drain_file.unlink(missing_ok=True)
        was, self.probe.draining = self.probe.draining, on
        if was != on:
            _log.info("mesh.draining" if on else "mesh.undrained", node=self.node)

    # -- what placement and status read -----------------------------------------------
    def views(self) -> list[PeerView]:
        now = time.monotonic()
        with self._lock:
            out = []
            for node, rec in self._records.items():
                free = rec.state.free if rec.state is not None else None
                # A peer's numbers are only claims: one that is not a finite, non-negative amount counts as none.
                cpu = free.cpu_cores if free is not None and math.isfinite(free.cpu_cores) else 0.0
                out.append(PeerView(
                    node=node, cpu_host="cpu" in rec.role.split(","), healthy=rec.healthy,
                    free=Resources(max(0.0, cpu), free.memory_bytes if free is not None else 0),
                    sampled_age_s=(now - rec.seen_at) if rec.seen_at else float("inf"),
                    draining=rec.state is not None and rec.state.health_detail == DRAINING))
            return sorted(out, key=lambda v: v.node)

    def status(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        with self._lock:
            return [{
                "node": node, "address": rec.peer.target, "role": rec.role, "healthy": rec.healthy,
                "draining": rec.state is not None and rec.state.health_detail == DRAINING,
                "free_cpu_cores": round(rec.state.free.cpu_cores, 3) if rec.state else None,
                "free_memory_bytes": rec.state.free.memory_bytes if rec.state else None,
                "last_seen_s": round(now - rec.seen_at, 1) if rec.seen_at else None,
                "error": rec.error or None,
            } for node, rec in sorted(self._records.items())]
