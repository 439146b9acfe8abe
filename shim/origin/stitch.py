"""The origin's side of the stitched pod network: a rerouted container on localhost, both ways.

For every origin sandbox with running remote containers (one thread looks
every ``POLL_S``, and at once when a host reports a change):

* what listens in the origin sandbox's namespace is read by sock_diag
  (``shim.crishared.netns``), weft's own listeners left out by inode, unless the
  pod declares its local containers' ports (``weft.io/ports.<name>``);
* each host says, over a ``Stitch`` stream per remote container, what its
  shadow listens on (or the declared ports of that container);
* where the pod network is flat, the kernel carries 127.0.0.1:<port> of a
  shadow's port to the shadow's pod IP (``kernel_path``: nftables rules in
  the origin sandbox's namespace, chosen port by port by
  ``shim.core.datapath``); the mirror below still carries ::1, the pod IP
  and every port the kernel path does not;
* ``shim.core.stitch.plan`` decides: each port of a shadow gets a listener on
  every address of the origin sandbox, IPv4 and IPv6 (so localhost, ::1 and
  the pod IP reach it, and so does containerd's PortForward, which dials
  localhost in the sandbox), or on 127.0.0.1 and ::1 alone where the shadow
  serves it on loopback alone (``Link.loopback``, from the host), each
  accepted connection a tunnel to the port in the shadow (TLS with the mesh
  certificates unless both sides turned ``mesh.tunnel_tls`` off)
  (``OpenTunnel``); every port of the pod (local containers' and the other
  shadows' mirrors) is listened on by the host in the shadow, and a
  connection there comes back on the stream as a token, which the origin
  dials and joins to 127.0.0.1:<port> here (::1 for a server that listens
  there only).

The pod's shadows on one host share a namespace, so each of their streams
reports all that listens there; ``shim.core.stitch.attribute`` puts each such
port down to one of them before the plan.

A port held both here and in a shadow is a collision: not mirrored, logged
once (``stitch.port_collision``) with the port, the rerouted container and
the local process holding it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import ssl
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from cri_api.v1 import api_pb2 as cri

from shim import log
from shim.core.stitch import PORTS_ANNOTATION, Collision, HeldBy, attribute, declared_ports, plan
from shim.crishared.containerd import Containerd
from shim.crishared.kernel_path import KernelForwards
from shim.crishared.kernel_path import sweep as sweep_kernel_rules
from shim.crishared.netns import Netns, owner_of, sandbox_netns
from shim.crishared.remote import HostStream, Remote, RemoteContainers, host_client
from shim.errors import WeftError
from shim.mesh.tunnel import CONNECT_TIMEOUT_S, Pipes, SocketEnd, dial, tune
from shim.mesh.tunnel.accept import NotTaken, accept_loop, closed
from shim.origin.settings import OriginSettings
from shim.periodic import Periodic
from shim.state.agent import SandboxRecord

# Connections to stitched ports being opened to their hosts at once (each holds a thread until its tunnel
# is up): more are closed at once, so a pod cannot take every thread of the agent.
MAX_OPENING = 256
_OPENING = threading.BoundedSemaphore(MAX_OPENING)

if TYPE_CHECKING:
    from shim.mesh.node import MeshNode

_log = log.get("weft.stitch")

POLL_S = 0.5
RETRY_S = 1.0


class Link(HostStream):
    """One remote container's Stitch stream: the ports its shadow listens on, and connections from it."""

    def __init__(self, pod: PodNet, r: Remote) -> None:
        super().__init__()
        self.pod, self.r = pod, r
        self.name = r.config.metadata.name
        self.listening: frozenset[int] = frozenset()
        self.loopback: frozenset[int] = frozenset()  # of those, the ports the shadow serves on loopback alone
        self.pod_ip = ""  # the shadow's, as its host tells it: where the kernel path forwards
        self.want: frozenset[int] | None = None
        self._lock = threading.Lock()
        self.declared: frozenset[int] | None = None
        try:
            self.declared = declared_ports(pod.annotations, self.name)
        except ValueError as exc:
            _log.warning("stitch.bad_annotation", container=self.name, sandbox_id=r.sandbox_id, error=str(exc))
        if self.declared is not None:
            self.listening = self.declared
        self.thread = threading.Thread(target=self._run, name=f"weft-stitch-{r.id[:12]}", daemon=True)

    def set_want(self, ports: frozenset[int]) -> None:
        """The ports the host should listen on in the shadow; the stream is opened again when they change."""
        with self._lock:
            if ports == self.want:
                return
            first = self.want is None
            self.want = ports
            call = self._call
        if first:
            self.thread.start()
        elif call is not None:
            call.cancel()

    def _run(self) -> None:
        mesh = self.pod.net.mesh
        while not self._stop.is_set():
            try:
                client = host_client(mesh, self.r)
                with self._lock:
                    want = self.want or frozenset()
                    self._call = call = client.stitch(mesh.node, self.r.key, want, self.declared,
                                                      origin_pod_ip=self.pod.pod_ip)
                for ev in call:
                    if ev.ports:
                        self.listening = frozenset(ev.listening)
                        self.loopback = frozenset(ev.loopback_only)
                        self.pod_ip = ev.pod_ip or self.pod_ip
                        self.pod.net.loop.wake()
                    if ev.token:
                        threading.Thread(target=self.pod.reverse, args=(self, ev), name="weft-stitch-in",
                                         daemon=True).start()
                    if ev.problem:
                        _log.error("stitch.port_collision", container=self.name, sandbox_id=self.r.sandbox_id,
                                   node=self.r.node, side="shadow", detail=ev.problem)
            except grpc.RpcError as exc:
                if exc.code() is grpc.StatusCode.CANCELLED:
                    continue  # our own cancel: the ports changed, or we stop
                _log.info("stitch.stream_ended", container=self.name, node=self.r.node, code=exc.code().name,
                          error=exc.details())
            except WeftError as exc:
                _log.info("stitch.stream_ended", container=self.name, node=self.r.node, error=exc.message)
            self._stop.wait(RETRY_S)


@dataclass
class Mirror:
    """A shadow's port listened on in the origin sandbox: on every address, or on loopback alone as the server."""

    socks: list[socket.socket]
    name: str  # the rerouted container
    loopback: bool


class PodNet:
    """One origin sandbox: its namespace, the mirrors of its shadows' ports, a Link per remote container."""

    def __init__(self, net: OriginNet, sandbox_id: str, ns: Netns, annotations: dict[str, str]) -> None:
        self.net, self.sandbox_id, self.ns, self.annotations = net, sandbox_id, ns, annotations
        self.pod_ip = ""  # this sandbox's: where a host's kernel path sends the shadow's localhost (set by OriginNet)
        self.links: dict[str, Link] = {}
        self.mirrors: dict[int, Mirror] = {}  # by port
        self.kernel = KernelForwards(ns, sandbox_id, enabled=net.settings.stitch_kernel_path)
        self._reported: set[tuple[int, str]] = set()
        self._lock = threading.Lock()

    def local_ports(self) -> frozenset[int]:
        names = {link.name for link in self.links.values()}
        declared: set[int] = set()
        found_any = False
        for key in self.annotations:
            if key.startswith(PORTS_ANNOTATION) and key[len(PORTS_ANNOTATION):] not in names:
                with contextlib.suppress(ValueError):
                    declared |= declared_ports(self.annotations, key[len(PORTS_ANNOTATION):]) or set()
                    found_any = True
        if found_any:
            return frozenset(declared)
        with self._lock:
            own = {os.fstat(s.fileno()).st_ino for m in self.mirrors.values() for s in m.socks if s.fileno() >= 0}
        self._listening = self.ns.listening()
        return frozenset(p for p, inodes in self._listening.items() if inodes - own)

    def tick(self) -> None:
        local = self.local_ports()
        links = {link.name: link for link in self.links.values()}
        current = {port: m.name for port, m in self.mirrors.items()}
        # The pod's shadows on one host share a namespace (its shadow sandbox's): each stream reports it all.
        spaces = {name: f"{link.r.node}/{link.r.shadow_sandbox_id or link.r.key}" for name, link in links.items()}
        p = plan(attribute({name: link.listening for name, link in links.items()}, spaces, current), local, current)
        for c in p.collisions:
            self._collision(c)
        # A mirror goes when its port goes to another container, or when the server's address changes scope.
        for port in [port for port, m in self.mirrors.items() if p.into_origin.get(port) != m.name
                     or m.loopback != (port in links[m.name].loopback)]:
            with self._lock:
                m = self.mirrors.pop(port)
            for sock in m.socks:
                _close_listener(sock)
            _log.info("stitch.unmirrored", sandbox_id=self.sandbox_id, container=m.name, port=port)
        for port, name in p.into_origin.items():
            if port in self.mirrors:
                continue
            loopback = port in links[name].loopback
            try:
                socks = self.ns.listen_loopback(port) if loopback else [self.ns.listen_any(port)]
            except OSError as exc:
                self._collision(Collision(port, name, HeldBy.LOCAL), str(exc))
                continue
            with self._lock:
                self.mirrors[port] = Mirror(socks, name, loopback)
            for sock in socks:
                threading.Thread(target=self._accept, args=(sock, port, links[name]), name=f"weft-mirror-{port}",
                                 daemon=True).start()
            _log.info("stitch.mirrored", sandbox_id=self.sandbox_id, container=name, node=links[name].r.node,
                      port=port, on="loopback" if loopback else "every address")
        for name, link in links.items():
            link.set_want(p.into_shadow.get(name, frozenset()))
        # Only a port mirrored here (no local listener holds it) may be forwarded by the kernel; connections to
        # a shadow whose host does not answer the mesh are reset, as a tunnel's are.
        healthy = {v.node for v in self.net.mesh.views() if v.healthy}
        self.kernel.update({port: (links[m.name].pod_ip, m.name) for port, m in self.mirrors.items()
                            if m.name in links},
                           frozenset(link.pod_ip for link in links.values() if link.r.node not in healthy))

    def _collision(self, c: Collision, error: str = "") -> None:
        if (c.port, c.container) in self._reported:
            return
        self._reported.add((c.port, c.container))
        holder = owner_of(getattr(self, "_listening", {}).get(c.port, set()))
        held = c.held_by.value
        if c.holder:
            held += f" ({c.holder})"
        _log.error("stitch.port_collision", sandbox_id=self.sandbox_id, container=c.container, port=c.port,
                   side="origin", held_by=held, holder=holder, error=error,
                   detail=f"port {c.port} of rerouted container {c.container} is not reachable on localhost: "
                          f"{held}{f' ({holder})' if holder else ''} already listens on it")

    def _accept(self, sock: socket.socket, port: int, link: Link) -> None:
        def handle(conn: socket.socket, _peer: tuple) -> None:
            if not _OPENING.acquire(blocking=False):
                # As many connections as may be are being opened to hosts: this one is closed at once.
                _log.warning("stitch.busy", container=link.name, port=port)
                conn.close()
                return
            try:
                threading.Thread(target=self._forward, args=(conn, port, link), name="weft-stitch-out",
                                 daemon=True).start()
            except RuntimeError as exc:  # no thread to be had: this connection is dropped
                _OPENING.release()
                conn.close()
                raise NotTaken(str(exc)) from exc

        # Out of descriptors, memory or threads: waited out, the listener stays.
        def failed(exc: Exception) -> None:
            _log.warning("stitch.accept_failed", container=link.name, port=port, side="origin", error=str(exc))

        accept_loop(sock.accept, handle, failed, ended=functools.partial(closed, sock))

    def _forward(self, conn: socket.socket, port: int, link: Link) -> None:
        """A connection to a shadow's port here: a tunnel to that port in the shadow."""
        mesh = self.net.mesh
        tune(conn, tunnel=False)
        try:
            client = host_client(mesh, link.r)
            grant = client.open_tunnel(mesh.node, link.r.key, port=port)
            end = dial(grant.address, grant.token, tls=self._tls(grant.tls), node=link.r.node,
                       known=client.address)
        except WeftError as exc:
            _log.warning("stitch.connect_failed", container=link.name, node=link.r.node, port=port,
                         error=exc.message)
            SocketEnd(conn).abort()
            return
        finally:
            _OPENING.release()
        self.net.pipe(SocketEnd(conn), end, f"{link.name}:{port}")

    def _tls(self, asked: bool):
        """The client context for a pod-network tunnel where the host asked for TLS or this origin wants it."""
        net = self.net
        return net.tunnel_tls if asked or net.settings.encrypt_pod_tunnels else None

    def reverse(self, link: Link, ev) -> None:
        """A connection in a shadow to a port of the pod: dial the host's token, join it to the port here."""
        try:
            end = dial(ev.address, ev.token, tls=self._tls(ev.tls), node=link.r.node,
                       known=host_client(self.net.mesh, link.r).address)
        except WeftError as exc:
            _log.warning("stitch.connect_failed", container=link.name, node=link.r.node, port=ev.accepted_port,
                         error=exc.message, direction="to-origin")
            return
        try:
            local = self.ns.connect_loopback(ev.accepted_port, CONNECT_TIMEOUT_S)
        except OSError as exc:
            _log.info("stitch.local_refused", container=link.name, port=ev.accepted_port, error=str(exc))
            end.abort()
            return
        tune(local, tunnel=False)
        local.settimeout(None)
        self.net.pipe(end, SocketEnd(local), f"{link.name}<-:{ev.accepted_port}")

    def close(self) -> None:
        for link in self.links.values():
            link.stop()
        for m in self.mirrors.values():
            for sock in m.socks:
                _close_listener(sock)
        self.mirrors.clear()
        self.kernel.close()
        self.ns.close()


def _close_listener(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class OriginNet:
    """Keeps a PodNet per origin sandbox with running remote containers; one thread."""

    def __init__(self, remotes: RemoteContainers, opted_in: dict[str, SandboxRecord], containerd: Containerd,
                 mesh: MeshNode, settings: OriginSettings, tunnel_tls: ssl.SSLContext | None) -> None:
        # Of the verbs' fabric, what the loop reads: the remote containers, the opted-in pods (the same dict, kept
        # up to date there) and containerd, for a pod's namespace and IP.
        self.remotes, self.opted_in, self.containerd = remotes, opted_in, containerd
        self.mesh, self.settings, self.tunnel_tls = mesh, settings, tunnel_tls
        self.pods: dict[str, PodNet] = {}
        self.pipes = Pipes()
        # At once, then every POLL_S, and at once when a host reports a change (``loop.wake``).
        self.loop = Periodic("weft-stitch", POLL_S, self.round, failed="stitch.round_failed", first=True)
        self._swept = False

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()
        for pod in self.pods.values():
            pod.close()
        self.pods.clear()
        self.pipes.abort_all()

    def pipe(self, a, b, name: str) -> None:
        self.pipes.start(a, b, name)

    def round(self) -> None:
        running: dict[str, list[Remote]] = {}
        for r in self.remotes.all():
            if r.state == cri.CONTAINER_RUNNING and not r.lost:
                running.setdefault(r.sandbox_id, []).append(r)
        for sid in [s for s in self.pods if s not in running]:
            self.pods.pop(sid).close()
        if not self._swept:  # once, at start: kernel rules a killed agent left in pods with nothing to forward
            self._swept = True
            self._sweep([sid for sid in self.opted_in if sid not in running])
        for sid, remotes in running.items():
            pod = self.pods.get(sid)
            if pod is None:
                try:
                    path = sandbox_netns(self._call, sid)
                except WeftError as exc:
                    _log.warning("stitch.no_netns", sandbox_id=sid, error=exc.message)
                    continue
                rec = self.opted_in.get(sid)
                pod = self.pods[sid] = PodNet(self, sid, Netns(path), dict(rec.annotations) if rec else {})
                pod.pod_ip = self._pod_ip(sid)
            ids = {r.id for r in remotes}
            for rid in [rid for rid in pod.links if rid not in ids]:
                pod.links.pop(rid).stop()
            for r in remotes:
                if r.id not in pod.links:
                    pod.links[r.id] = Link(pod, r)
            pod.tick()

    def _sweep(self, sandbox_ids: list[str]) -> None:
        for sid in sandbox_ids:
            try:
                path = sandbox_netns(self._call, sid)
            except WeftError:
                continue  # gone, or stopped: its namespace, and any rules in it, went with it
            ns = Netns(path, workers=1)
            try:
                sweep_kernel_rules(ns, sid)
            finally:
                ns.close()

    def _pod_ip(self, sandbox_id: str) -> str:
        try:
            return self._call("/runtime.v1.RuntimeService/PodSandboxStatus",
                              cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id),
                              cri.PodSandboxStatusResponse).status.network.ip
        except WeftError:
            return ""  # the host's side then keeps the tunnel

    def paths_of(self, container_id: str) -> dict[int, dict[str, str]]:
        """Port -> the data path that carries it into the origin pod, for a remote container (``weft explain``)."""
        for pod in list(self.pods.values()):
            link = pod.links.get(container_id)
            if link is None:
                continue
            return {port: {"path": d.path, "reason": d.reason.value, "detail": d.detail}
                    for port, (name, d) in sorted(pod.kernel.paths().items()) if name == link.name}
        return {}

    def _call(self, path: str, request, response_type):
        try:
            raw = self.containerd.channel.unary_unary(path)(request.SerializeToString(), timeout=10)
        except grpc.RpcError as exc:
            raise self.containerd.translate(exc) from None
        return response_type.FromString(raw)

