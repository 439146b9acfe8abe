"""This agent's place in the mesh: serve it, find peers, and keep a fresh view of those it deals with.

Started by the agent when ``mesh.address`` is set. Peers come from a static
peers file or from Kubernetes (the DaemonSet's EndpointSlices); every
``hello_interval`` the node says Hello over mutual TLS to the peers
``shim.core.tracking`` picks (every peer in a small fleet; in a large one,
those it has business with, and on a node that places containers a bounded
set of candidate CPU hosts plus a few probes rotating through the fleet), and
keeps what each answers (role, free capacity, health) as a
``shim.core.reroute.PeerView``: what placement reads. When placement needs
more room than the candidates have, ``views`` asks cold hosts at once
(``refresh``). Connections are made on first use and closed when idle. A
peer that stops answering is marked unhealthy at once and logged once
(``peer.lost``), and logged again when it is back (``peer.up``).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shim import log
from shim._pb import mesh_pb2 as pb
from shim.core import tracking
from shim.core.reroute import PeerView, Resources
from shim.core.tracking import (
    ANY_ROOM,
    BUSINESS_S,
    NO_ROOM_HOLD_S,
    REFRESH_BATCH,
    REFRESH_BUDGET_S,
    Known,
    TrackReason,
)
from shim.errors import WeftError
from shim.kube.access import ApiAccess, KubeconfigNotYet
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
from shim.mesh.hosting import ShadowHosting
from shim.mesh.identity import PeerPolicy
from shim.mesh.server import MeshServer
from shim.mesh.tlsreload import NodeTls
from shim.metrics import Metrics
from shim.periodic import Periodic

_log = log.get("weft.mesh")

# A connection nothing has used for this long is closed (the next call opens it again).
IDLE_S = 10.0
# A discovery change logs the peers' names only for a fleet this small (their count always).
LOGGED_NAMES = 64


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
                 namespace: str, service: str, metrics: Metrics, host: ShadowHosting | None = None,
                 fixed_capacity: str = "", drain_file: Path | None = None, api: ApiAccess | None = None) -> None:
        self.node, self.role, self.hello_interval, self.metrics = node, role, hello_interval, metrics
        self.tls = NodeTls(tls_dir, node)  # reloaded when the keeper renews the certificate
        metrics.mesh_cert_expiry.set_function(self.tls.not_after)
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
        books = {} if host is None else {"own_requests": host.capacity.own_requests,
                                            "hosted_limits": host.capacity.hosted_limits}
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
        self.peer_addresses: frozenset[str] = frozenset()  # the peers' addresses (_set_peers)
        self._clients: dict[str, PeerClient] = {}
        self._stop = threading.Event()
        self._hellos = Periodic("weft-mesh-hello", hello_interval, self.hello_all, failed="mesh.hello_failed",
                               first=True)
        # Who gets Hellos (shim.core.tracking): candidates on a node that places, business, probes.
        self.limit = tracking.TRACKED_PEERS
        self.placing = "gpu" in role.split(",")  # a host-only node starts placing once placement asks
        self._candidates: set[str] = set()
        self._tracked: dict[str, TrackReason] = {}
        self._cursor = ""
        self._round = 0
        self._used: dict[str, float] = {}  # node -> monotonic time this node last used its client
        self._last_need: Resources | None = None
        self._no_room: tuple[float, Resources] | None = None
        self._refresh_lock = threading.Lock()
        self._known_cache: list[Known] | None = None
        self._pool = ThreadPoolExecutor(max_workers=REFRESH_BATCH, thread_name_prefix="weft-mesh-hello")
        # Last time each peer was heard from (monotonic); a restarted origin gives every host the loss timeout.
        self._contact: dict[str, float] = {}
        # Hosts whose open Watch pushes their state (``pushed``): their Hellos are left out while it is open.
        self._pushing: set[str] = set()
        self._started = time.monotonic()

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        try:
            self._set_peers(self.discovery.list())
        except DiscoveryError as exc:  # the API away, or its credentials not written yet: the watch keeps asking
            if isinstance(exc.__cause__, KubeconfigNotYet):  # as on every install: no cause for a warning
                _log.info("mesh.discovery.waiting", error=exc.message)
            else:
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
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            clients = list(self._clients.values())
        for c in clients:
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
                        old.close()  # made again, to the new address, on first use
            self._candidates &= set(wanted)
            self._known_cache = None
            # Only nodes we know may talk to us.
            self.policy.set_known(set(wanted))
            # Where their connections come from: the tunnel port keeps handshake slots for these.
            self.peer_addresses = frozenset(p.address for p in peers)
        names = sorted(wanted)
        _log.info("mesh.peers", peers=names if len(names) <= LOGGED_NAMES else names[:LOGGED_NAMES], count=len(names))

    # -- hello ---------------------------------------------------------------------
    def _client(self, node: str) -> PeerClient | None:
        """The peer's client, made on first use; None for a node that is not a peer. Call with the lock held."""
        client = self._clients.get(node)
        if client is None:
            rec = self._records.get(node)
            if rec is None:
                return None
            client = self._clients[node] = PeerClient(node, rec.peer.target, self.tls)
            client.on_admit = self._admitted
        return client

    def _known(self) -> list[Known]:
        """Every peer and whether it may host, by node name (kept until the peers or a role change). Call with
        the lock held."""
        if self._known_cache is None:
            self._known_cache = [Known(node, not rec.role or "cpu" in rec.role.split(","))
                                 for node, rec in sorted(self._records.items())]
        return self._known_cache

    def business(self) -> set[str]:
        """Peers with a call or stream open from here (Watch aside), or used within ``BUSINESS_S``."""
        now = time.monotonic()
        with self._lock:
            for n in [n for n, t in self._used.items() if now - t > BUSINESS_S]:
                del self._used[n]
            busy = {n for n, c in self._clients.items() if c.busy}
            return busy | {n for n in self._used if n in self._records}

    def hello_all(self) -> None:
        # A renewed certificate is taken within a round (its files checked, ``mesh.tls.reloaded``) even when
        # every peer pushes its state on a Watch and no Hello opens a client, which is where it was checked.
        self.tls.current()
        mine = self.probe.sample()
        mine.node = self.node
        business = self.business()
        with self._lock:
            known = self._known()
            if not self._cursor:  # each origin starts its rotation somewhere of its own, not all at the first name
                self._cursor = tracking.start_cursor(known, self.node)
            plan = tracking.plan_round(known, self._candidates, business, placing=self.placing,
                                       limit=self.limit, cursor=self._cursor,
                                       candidates_due=self._round % tracking.candidate_every(self.hello_interval) == 0)
            self._round += 1
            self._cursor = plan.cursor
            self._tracked = dict(plan.hello)
            # A host that pushes its state on this node's Watch is heard from and its room known without them.
            asked = [n for n in plan.nodes if n not in self._pushing]
        self._hello(asked, mine)
        probed = {n for n, why in plan.hello if why is TrackReason.PROBE}
        with self._lock:
            if self.placing:
                self._candidates = set(tracking.choose_candidates(
                    self._views(self._candidates | probed), limit=self.limit))
            keep = (set(plan.nodes) | self._candidates) - (probed - self._candidates)
        self._let_go(keep)
        self._count()

    def _hello(self, nodes: list[str], mine: pb.PeerState) -> None:
        """Hello to each of ``nodes`` (at most ``REFRESH_BATCH`` at once), marking what each answers."""
        def one(node: str) -> None:
            with self._lock:
                client = self._client(node)
            if client is None:
                return
            try:
                state = client.hello(mine)
            except WeftError as exc:
                self._mark(node, None, exc.message)
            else:
                self._mark(node, state, "")

        if len(nodes) == 1:
            one(nodes[0])
            return
        for f in [self._pool.submit(one, n) for n in nodes]:
            f.result()

    def _let_go(self, keep: set[str]) -> None:
        """Close the idle connections of peers no longer said Hello to, and forget their gauge."""
        with self._lock:
            gone = [(n, c) for n, c in self._clients.items() if n not in keep]
        for node, client in gone:
            if client.release(0.0 if node not in self._used else IDLE_S):
                with self._lock:  # forgotten too: what the node holds stays bounded by what it deals with
                    if self._clients.get(node) is client:
                        del self._clients[node]
                with contextlib.suppress(KeyError):
                    self.metrics.mesh_peer_up.remove(node)

    def _count(self) -> None:
        counts = {why: 0 for why in TrackReason}
        with self._lock:
            for why in self._tracked.values():
                counts[why] += 1
            if counts[TrackReason.FLEET] == 0:
                counts[TrackReason.CANDIDATE] = len(self._candidates)  # said Hello to every few rounds
            open_now = sum(1 for c in self._clients.values() if c.connected)
        for why, n in counts.items():
            self.metrics.mesh_tracked_peers.labels(why.value).set(n)
        self.metrics.mesh_connections.set(open_now)

    def _admitted(self, node: str, request: pb.AdmitRequest, answer: pb.AdmitResponse) -> None:
        """An Admit answered: what placement asked is the need to refresh for; a refusal tells the peer's room."""
        need = Resources(request.limits.cpu_cores, request.limits.memory_bytes)
        with self._lock:
            self._last_need = need
            rec = self._records.get(node)
            # A refusal in a large fleet says the host is fuller than its last Hello: the next placement then
            # looks further (refresh) rather than at it again. A small fleet reads its Hellos only, as before.
            if (answer.admitted or rec is None or rec.state is None or not answer.HasField("free_after")
                    or tracking.small_fleet(self._records, self.limit)):
                return
            state = pb.PeerState()
            state.CopyFrom(rec.state)
            state.free.CopyFrom(answer.free_after)
            rec.state, rec.seen_at = state, time.monotonic()

    # -- on demand ----------------------------------------------------------------------
    def refresh(self, need: Resources) -> list[str]:
        """Ask cold CPU hosts, in rotation, until one has room for ``need`` (or the budget is spent); those with
        room become candidates. The hosts found with room, by name."""
        with self._refresh_lock:
            now = time.monotonic()
            business = self.business()
            with self._lock:
                if tracking.fits(need, self._views(self._candidates | business)):
                    return []  # another placement refreshed while this one waited
                held = self._no_room
                if held is not None and now - held[0] < NO_ROOM_HOLD_S and held[1].fits_in(need):
                    return []
                order = tracking.refresh_order(self._known(), self._candidates | set(self._tracked),
                                               start=self._cursor)
            mine = self.probe.sample()
            mine.node = self.node
            found: list[str] = []
            asked = 0
            deadline = now + REFRESH_BUDGET_S
            for i in range(0, len(order), REFRESH_BATCH):
                batch = list(order[i:i + REFRESH_BATCH])
                self._hello(batch, mine)
                asked += len(batch)
                with self._lock:
                    self._cursor = batch[-1]
                    views = self._views(set(batch))
                    found = [v.node for v in views if tracking.fits(need, [v])]
                    if found:
                        self._candidates = set(tracking.choose_candidates(
                            self._views(self._candidates | set(found)), limit=self.limit)) | set(found)
                        self._tracked.update({n: TrackReason.REFRESH for n in found})
                if found or time.monotonic() > deadline:
                    break
            self._no_room = None if found else (time.monotonic(), need)
            ms = round((time.monotonic() - now) * 1000, 1)
        self.metrics.mesh_refreshes.labels("found" if found else "none").inc()
        _log.info("mesh.refreshed", need=str(need), asked=asked, found=found, ms=ms)
        self._let_go(set(self._tracked) | set(found))
        return found

    def _mark(self, node: str, state: pb.PeerState | None, error: str) -> None:
        with self._lock:
            rec = self._records.get(node)
            if rec is None:
                return
            was = rec.healthy
            if state is not None:
                if rec.role != state.role:
                    self._known_cache = None
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
        """The client of peer ``node`` (connected on first use); None when ``node`` is not a peer. Using it makes
        ``node`` business for a while: it is said Hello to, and its connection kept."""
        with self._lock:
            client = self._client(node)
            if client is not None:
                self._used[node] = time.monotonic()
            return client

    def hosts(self) -> list[str]:
        """Peers that may host containers (CPU hosts as they said or as declared, and those not yet heard) that
        this node deals with: every one in a small fleet; in a large one, those it has business with (the
        origin's Watch goes to these, and to the hosts of its shadows)."""
        business = self.business()
        with self._lock:
            nodes = self._records if tracking.small_fleet(self._records, self.limit) else business
            return sorted(n for n in nodes if (rec := self._records.get(n)) is not None
                          and (not rec.role or "cpu" in rec.role.split(",")))

    def heard(self, node: str) -> None:
        """A message from ``node`` arrived (a Watch heartbeat or state), or its Watch that pushes state is still
        open: it is alive."""
        now = time.monotonic()
        with self._lock:
            self._contact[node] = now

    def pushed(self, node: str, state: pb.PeerState) -> None:
        """``node``'s Watch brought its state, as a Hello would: kept as its view, and no Hellos to it while that
        Watch stays open (``unwatched``)."""
        with self._lock:
            if node not in self._records:
                return
            self._pushing.add(node)
        self._mark(node, state, "")

    def unwatched(self, node: str) -> None:
        """``node``'s Watch ended: Hellos to it again, as to any peer."""
        with self._lock:
            self._pushing.discard(node)

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
    def unreachable(self, node: str, error: str) -> None:
        """A call to ``node`` found it silent (unreachable, past its deadline): unhealthy, as a failed Hello
        would make it, until a Hello reaches it again. In a partition, placements then stop asking the hosts
        cut off one after another."""
        self._mark(node, None, error)

    def spread(self, pod: str) -> str:
        """What placement draws its two choices with (``reroute.choose_peers``) for ``pod``: this node and the
        pod, so that its preparation and its containers draw alike, and other origins otherwise. A fleet no
        larger than the bound ranks by room alone (every origin sees every host; nothing herds)."""
        with self._lock:
            small = tracking.small_fleet(self._records, self.limit)
        return "" if small else f"{self.node}/{pod}"

    def views(self, need: Resources | None = None) -> list[PeerView]:
        """The peers this node keeps fresh (every peer in a small fleet), by node name.

        Placement asks here: when none of them would admit ``need`` (without one, the last Admit's limits, or
        any room at all), cold hosts are asked at once (``refresh``) and those with room join the views.
        """
        self.placing = True
        with self._lock:
            small = tracking.small_fleet(self._records, self.limit)
            views = self._views(set(self._records) if small else self._candidates | set(self._tracked))
            want = need or self._last_need or ANY_ROOM
        if small or tracking.fits(want, views):
            return views
        self.refresh(want)
        with self._lock:
            return self._views(self._candidates | set(self._tracked))

    def _views(self, nodes: set[str]) -> list[PeerView]:
        """The views of ``nodes`` that are peers, by node name. Call with the lock held."""
        now = time.monotonic()
        out = [v for n in nodes if (rec := self._records.get(n)) is not None
               and (v := self._view(n, rec, now)) is not None]
        return sorted(out, key=lambda v: v.node)

    @staticmethod
    def _view(node: str, rec: PeerRecord, now: float) -> PeerView:
        free = rec.state.free if rec.state is not None else None
        # A peer's numbers are only claims: one that is not a finite, non-negative amount counts as none.
        cpu = free.cpu_cores if free is not None and math.isfinite(free.cpu_cores) else 0.0
        return PeerView(
            node=node, cpu_host="cpu" in rec.role.split(","), healthy=rec.healthy,
            free=Resources(max(0.0, cpu), free.memory_bytes if free is not None else 0),
            sampled_age_s=(now - rec.seen_at) if rec.seen_at else float("inf"),
            draining=rec.state is not None and rec.state.health_detail == DRAINING)

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
