"""A host's side of the tunnels into its shadows: streaming sessions and the stitched pod network.

* ``issued``: the URLs this host's containerd returned for Exec and Attach of
  an origin's shadow (through ShadowCall) are remembered for a minute, as long
  as containerd keeps them; ``open_tunnel`` to a stream URL is granted only for
  one of those, to the origin it was issued to, over TLS.
* ``open_tunnel`` to a port: a tunnel to 127.0.0.1:<port> (or ::1) in the
  shadow sandbox's network namespace (the origin's mirror of that port
  accepted a connection), granted TLS-only, to the origin's certificate,
  while ``mesh.tunnel_tls`` is on (``tunnel_tls``; so are the tokens of the
  stream below).
* ``stitch``: the host listens on 127.0.0.1:<port> and [::1]:<port> in the
  shadow's namespace (loopback only: the origin pod's ports are not served on
  the shadow's own pod IP)
  for each port of the origin's pod; an accepted connection becomes a grant
  whose target is that very socket, offered to the origin on the stream,
  which dials it and joins it to the port in its own pod. The stream also
  pushes the ports the shadow listens on (sock_diag every ``POLL_S``, this
  host's own listeners left out by inode), which of them listen on loopback
  alone (the origin mirrors those on its loopback alone), with the shadow's
  pod IP, where the origin's kernel path forwards
  (``shim.crishared.kernel_path``). The
  listeners go when the last
  stream of the shadow ends; a connection the origin never claims is closed
  when its token expires.

The pod's shadows on this host share one namespace: their streams leave out
every mirror in it, not only their own, and a port that something there
listens on already is left to it (a sibling's mirror carries it just as well).

A port the host cannot listen on (the shadow took it in between) is logged
(``stitch.port_collision``) with the port and container, and told to the
origin as a problem.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import grpc
from cri_api.v1 import api_pb2 as cri

from shim import log
from shim._pb import mesh_pb2 as pb
from shim.core.stitch import loopback_only
from shim.crishared.kernel_path import KernelForwards, forget_connections
from shim.crishared.netns import Netns, owner_of, sandbox_netns
from shim.errors import WeftError
from shim.mesh.tunnel import CONNECT_TIMEOUT_S, TunnelServer
from shim.mesh.tunnel.accept import accept_loop, closed
from shim.shadowhost.runtime import ShadowRuntime

_log = log.get("weft.stitch")

URL_TTL_S = 60.0
POLL_S = 0.5
# Listeners outlive their last Stitch stream by this much (the origin reopens it with new ports).
GRACE_S = 2.0


class TunnelRefused(WeftError):
    """The origin asked for a tunnel to something that is not its own shadow's."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Mirrors:
    """The host's listeners in one shadow's namespace, for the ports of the origin's pod."""

    def __init__(self, net: ShadowNet, origin: str, key: str, name: str, ns: Netns, sandbox_id: str) -> None:
        self.net, self.origin, self.key, self.name, self.ns = net, origin, key, name, ns
        self.sandbox_id = sandbox_id
        self.listeners: dict[int, list[socket.socket]] = {}  # port -> its listeners (127.0.0.1, ::1)
        self.origin_pod_ip = ""  # where the kernel path sends this shadow's 127.0.0.1:<port> (ShadowNet.forward)
        self.refs = 0
        self.subscriber: queue.Queue | None = None
        self.wanted: set[int] = set()  # what the origin's stream asked for (some may be held by a sibling)
        self._lock = threading.Lock()

    def _sockets(self) -> list[socket.socket]:
        return [s for socks in self.listeners.values() for s in socks]

    def inodes(self) -> set[int]:
        with self._lock:
            return {os.fstat(s.fileno()).st_ino for s in self._sockets() if s.fileno() >= 0}

    def set_ports(self, ports: set[int]) -> list[str]:
        """Listen on ``ports`` in the shadow's namespace. The pod's shadows on this host share it: a port that
        something there listens on already (a sibling's mirror, or a server of a shadow, whose collisions the
        origin sees in what the stream reports) is left to it, and taken up when it frees (``retry``)."""
        problems = []
        with self._lock:
            self.wanted = set(ports)
            for port in set(self.listeners) - ports:
                for sock in self.listeners.pop(port):
                    _close_listener(sock)
            new = ports - set(self.listeners)
        held = {p for p, inodes in self.ns.listening().items() if inodes} if new else set()
        for port in sorted(new - held):
            try:
                socks = self.ns.listen_loopback(port)
            except OSError as exc:
                detail = f"port {port} of the pod cannot be mirrored into rerouted container {self.name}: {exc}"
                holder = owner_of(self.ns.listening().get(port, set()))
                if holder:
                    detail += f" (held there by {holder})"
                _log.error("stitch.port_collision", origin=self.origin, key=self.key, container=self.name, port=port,
                           side="shadow", detail=detail)
                problems.append(detail)
                continue
            with self._lock:
                self.listeners[port] = socks
            for sock in socks:
                threading.Thread(target=self._accept, args=(sock, port), name=f"weft-mirror-{port}",
                                 daemon=True).start()
        return problems

    def _accept(self, sock: socket.socket, port: int) -> None:
        def handle(conn: socket.socket, _peer: tuple) -> None:
            q = self.subscriber
            if q is None:
                conn.close()
                return
            tls = self.net.tunnel_tls
            token = self.net.tunnel.grants.add(self.origin, lambda c=conn: c, tls=tls,
                                               what=f"{self.name} <- :{port}", on_expire=conn.close)
            q.put(pb.StitchEvent(accepted_port=port, token=token, address=self.net.tunnel.address, tls=tls))

        # Out of descriptors or memory: waited out, the listener stays.
        def failed(exc: Exception) -> None:
            _log.warning("stitch.accept_failed", container=self.name, port=port, side="shadow", error=str(exc))

        accept_loop(sock.accept, handle, failed, ended=functools.partial(closed, sock))

    def ports(self) -> list[int]:
        with self._lock:
            return list(self.listeners)

    def close(self) -> None:
        with self._lock:
            socks = self._sockets()
            self.listeners.clear()
        for s in socks:
            _close_listener(s)


def _close_listener(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)  # wakes the thread in accept()
    sock.close()


class ShadowNet:
    def __init__(self, rt: ShadowRuntime, tunnel: TunnelServer) -> None:
        self.rt = rt
        self.tunnel = tunnel
        self._lock = threading.Lock()
        self._urls: dict[str, tuple[str, str, float]] = {}  # url -> (origin, key, expires)
        self._netns: dict[str, Netns] = {}  # shadow sandbox id -> its namespace
        self._mirrors: dict[tuple[str, str], Mirrors] = {}
        self.kernel_path = True  # mesh.stitch_kernel_path, set by the agent
        # mesh.tunnel_tls, set by the agent: pod-network tunnels granted TLS-only, to the origin's certificate.
        self.tunnel_tls = True
        # The way back through the kernel, one per shadow sandbox (its containers share the namespace).
        self._kernels: dict[str, KernelForwards] = {}
        self._kernel_lock = threading.Lock()
        # Each namespace's listening ports, read at most once a poll for all its containers' streams.
        self._listening: dict[str, tuple[float, dict[int, dict[int, str]]]] = {}  # by shadow sandbox id
        self._listening_lock = threading.Lock()

    # -- streams -----------------------------------------------------------------------
    def issued(self, origin: str, key: str, method: str, response: bytes) -> None:
        """containerd answered Exec or Attach of ``key`` with a URL: the origin may tunnel to it once."""
        resp_type = cri.ExecResponse if method == "Exec" else cri.AttachResponse
        url = resp_type.FromString(response).url
        now = time.monotonic()
        with self._lock:
            for old in [u for u, (_, _, t) in self._urls.items() if t < now]:
                del self._urls[old]
            self._urls[url] = (origin, key, now + URL_TTL_S)

    def open_tunnel(self, origin: str, req: pb.TunnelRequest) -> pb.TunnelGrant:
        c = self.rt.one(origin, req.key)
        name = c.metadata.name
        if req.WhichOneof("target") == "stream_url":
            with self._lock:
                found = self._urls.pop(req.stream_url, None)
            if found is None or found[:2] != (origin, req.key) or found[2] < time.monotonic():
                raise TunnelRefused(f"{req.stream_url!r} is no streaming URL this host issued for {req.key}")
            parts = urlsplit(req.stream_url)
            address = (parts.hostname or "127.0.0.1", parts.port or 80)
            token = self.tunnel.grants.add(
                origin, lambda: socket.create_connection(address, CONNECT_TIMEOUT_S), tls=True,
                what=f"{name} stream", interactive=True)
            return pb.TunnelGrant(address=self.tunnel.address, token=token, tls=True)
        if req.WhichOneof("target") == "port":
            port = req.port
            if not 1 <= port <= 65535:
                raise TunnelRefused(f"port {port} is not a TCP port")
            ns = self._ns(c.pod_sandbox_id)
            token = self.tunnel.grants.add(origin, lambda: ns.connect_loopback(port, CONNECT_TIMEOUT_S),
                                           tls=self.tunnel_tls, what=f"{name} :{port}")
            return pb.TunnelGrant(address=self.tunnel.address, token=token, tls=self.tunnel_tls)
        raise TunnelRefused("OpenTunnel names no target (stream_url or port)")

    def _ns(self, sandbox_id: str) -> Netns:
        with self._lock:
            ns = self._netns.get(sandbox_id)
        if ns is not None:
            return ns
        path = sandbox_netns(self.rt.call, sandbox_id)
        with self._lock:
            return self._netns.setdefault(sandbox_id, Netns(path))

    # -- the stitched network ------------------------------------------------------------
    def stitch(self, origin: str, req: pb.StitchRequest, context: grpc.ServicerContext) -> Iterator[pb.StitchEvent]:
        c = self.rt.one(origin, req.key)
        ns = self._ns(c.pod_sandbox_id)
        q: queue.Queue = queue.Queue()
        with self._lock:
            m = self._mirrors.get((origin, req.key))
            if m is None:
                m = self._mirrors[(origin, req.key)] = Mirrors(self, origin, req.key, c.metadata.name, ns,
                                                                c.pod_sandbox_id)
            m.refs += 1
            m.subscriber = q
        context.add_callback(lambda: q.put(None))
        try:
            for problem in m.set_ports(set(req.ports)):
                yield pb.StitchEvent(problem=problem)
            m.origin_pod_ip = req.origin_pod_ip or m.origin_pod_ip
            self.forward(m.sandbox_id)
            last: tuple[set[int], frozenset[int]] | None = None
            pod_ip = self._pod_ip(c.pod_sandbox_id)
            while context.is_active():
                own = self._own_inodes(c.pod_sandbox_id)  # every mirror in the namespace, siblings' too
                found = self._listening_in(c.pod_sandbox_id, ns)
                if req.has_declared:
                    listening = set(req.declared)
                else:
                    listening = {p for p, socks in found.items() if set(socks) - own}
                # A server on loopback alone is mirrored on loopback alone: never exposed on the origin's pod IP.
                now = (listening, loopback_only(found, own) & listening)
                if now != last:
                    last = now
                    yield pb.StitchEvent(listening=sorted(now[0]), loopback_only=sorted(now[1]), ports=True,
                                         pod_ip=pod_ip)
                deadline = time.monotonic() + POLL_S
                while (left := deadline - time.monotonic()) > 0:
                    try:
                        event = q.get(timeout=left)
                    except queue.Empty:
                        break
                    if event is None:
                        return
                    yield event
        finally:
            self._release(m, q)

    def forward(self, sandbox_id: str) -> None:
        """The pod's ports mirrored in a shadow sandbox, through the kernel to the origin pod's IP where it accepts
        them (``shim.crishared.kernel_path``, the origin's way, the other way round); all gone with its last
        stream, and their connections then end with a reset."""
        with self._kernel_lock:
            with self._lock:
                mirrors = [m for m in self._mirrors.values() if m.sandbox_id == sandbox_id]
            kernel = self._kernels.get(sandbox_id)
            if not mirrors:
                if kernel is not None:
                    del self._kernels[sandbox_id]
                    ips = {ip for ip, _, _ in kernel.decisions.values() if ip}
                    kernel.close()
                    if ips:
                        try:
                            kernel.ns.run(forget_connections, ips)
                        except Exception as exc:  # noqa: BLE001 - they end on their own; only quicker with this
                            _log.info("stitch.conntrack_failed", sandbox_id=sandbox_id, error=str(exc))
                return
            if kernel is None:
                kernel = self._kernels[sandbox_id] = KernelForwards(mirrors[0].ns, sandbox_id,
                                                                    enabled=self.kernel_path)
            wanted = {port: (m.origin_pod_ip, "origin pod") for m in mirrors for port in m.ports()}
            kernel.update(wanted)

    def _pod_ip(self, sandbox_id: str) -> str:
        """The shadow sandbox's pod IP, for the origin's kernel path; "" when containerd does not say."""
        try:
            status = self.rt.call("/runtime.v1.RuntimeService/PodSandboxStatus",
                                       cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id),
                                       cri.PodSandboxStatusResponse).status
        except WeftError:
            return ""
        return status.network.ip

    def _own_inodes(self, sandbox_id: str) -> set[int]:
        with self._lock:
            mirrors = [m for m in self._mirrors.values() if m.sandbox_id == sandbox_id]
        return set().union(*(m.inodes() for m in mirrors))

    def _listening_in(self, sandbox_id: str, ns: Netns) -> dict[int, dict[int, str]]:
        with self._listening_lock:
            at, ports = self._listening.get(sandbox_id, (float("-inf"), {}))
            if time.monotonic() - at >= POLL_S / 2:
                ports = ns.listening_on()
                self._listening[sandbox_id] = (time.monotonic(), ports)
            return ports

    def _release(self, m: Mirrors, q: queue.Queue) -> None:
        with self._lock:
            m.refs -= 1
            if m.subscriber is q:
                m.subscriber = None
            last = m.refs == 0
        if last:  # the origin reopens its stream when its pod's ports change: keep the listeners a moment
            timer = threading.Timer(GRACE_S, self._maybe_close, (m,))
            timer.daemon = True
            timer.start()

    def _maybe_close(self, m: Mirrors) -> None:
        with self._lock:
            if m.refs > 0 or self._mirrors.get((m.origin, m.key)) is not m:
                return
            del self._mirrors[(m.origin, m.key)]
            in_use = any(x.sandbox_id == m.sandbox_id for x in self._mirrors.values())
            ns = None if in_use else self._netns.pop(m.sandbox_id, None)
            if not in_use:
                with self._listening_lock:
                    self._listening.pop(m.sandbox_id, None)
        m.close()
        if in_use:  # a sibling in the namespace may have left a port to m: it takes it up now
            with self._lock:
                siblings = [x for x in self._mirrors.values() if x.sandbox_id == m.sandbox_id]
            for x in siblings:
                for problem in x.set_ports(x.wanted):
                    if x.subscriber is not None:
                        x.subscriber.put(pb.StitchEvent(problem=problem))
        self.forward(m.sandbox_id)  # the kernel path of what is left in the sandbox (nothing: rules removed)
        if ns is not None:
            ns.close()
        _log.info("stitch.closed", origin=m.origin, key=m.key, container=m.name)

    def close(self) -> None:
        with self._lock:
            mirrors, self._mirrors = list(self._mirrors.values()), {}
            spaces, self._netns = list(self._netns.values()), {}
        for m in mirrors:
            m.close()
        with self._kernel_lock:
            kernels, self._kernels = list(self._kernels.values()), {}
        for k in kernels:
            k.close()
        for ns in spaces:
            ns.close()
