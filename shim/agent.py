"""``weft agent``: the node agent process.

Assembles the CRI proxy (socket claim, upstream channel, router), the state
store, the broker client and the crash reconciler, the HTTP endpoint for
metrics and health, and the signal handling: SIGTERM or SIGINT
stops accepting calls, lets running ones finish for a grace period, cancels
open streams, and removes the socket it made.
"""

from __future__ import annotations

import os
import socket as socketlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from cri_api.v1 import api_pb2

from shim import failpoint, log, sdnotify, stopping
from shim.broker.client import BrokerClient
from shim.config import Config
from shim.cri.cdi import CdiSpecs
from shim.cri.fabric import Fabric
from shim.cri.instrument import Instrument
from shim.cri.passthrough import Upstream
from shim.cri.recovery import Reconciler
from shim.cri.relay.server import RelayServer
from shim.cri.verbs import routes
from shim.crishared.mark import ShadowMark, ShadowsSeen
from shim.httpd import HttpEndpoint
from shim.kube import access
from shim.kube.pods import PodCache
from shim.metrics import Metrics
from shim.origin.context import Origin
from shim.origin.prepare import Prepared
from shim.origin.settings import OriginSettings
from shim.origin.supervisor import RemoteSupervisor
from shim.periodic import Periodic
from shim.shadowhost.context import HostContext
from shim.shadowhost.sandbox_image import SandboxImage
from shim.state.agent import AgentStore

if TYPE_CHECKING:
    from shim.mesh.node import MeshNode
    from shim.mesh.tunnel import TunnelServer
    from shim.shadowhost.side import HostSide

_log = log.get("weft.agent")
HOST_CHECK_INTERVAL = 30.0  # seconds between looks at the host (containerd's configuration)
_VERSION = "/runtime.v1.RuntimeService/Version"


def _probe(upstream: Upstream):
    version = upstream.channel.unary_unary(
        _VERSION, request_serializer=api_pb2.VersionRequest.SerializeToString,
        response_deserializer=api_pb2.VersionResponse.FromString,
    )

    def probe() -> tuple[bool, str]:
        try:
            resp = version(api_pb2.VersionRequest(), timeout=2)
        except grpc.RpcError as exc:
            return False, upstream.translate(exc).message
        return True, f"{resp.runtime_name} {resp.runtime_version}"

    return probe


@dataclass(frozen=True)
class Meshed:
    """What runs where the node is on the mesh, besides the fabric's origin side."""

    host: HostSide
    mesh: MeshNode
    tunnel: TunnelServer
    pods: PodCache | None


class _StopTimer:
    """Each part of a stop timed; a slow one said as it ends (a stop that waits out systemd's timeout at a
    node's poweroff must say where it waited)."""

    def __init__(self) -> None:
        self.took: dict[str, float] = {}

    def __call__(self, name: str, stop: Callable[[], object]) -> None:
        t = time.monotonic()
        stop()
        self.took[name] = time.monotonic() - t
        if self.took[name] >= 1.0:
            _log.warning("agent.stop_slow", part=name, s=round(self.took[name], 3))

    def slowest(self) -> str:
        name = max(self.took, key=self.took.__getitem__, default="")
        return f"{name} {self.took[name]:.3f} s" if name else ""


class Agent:
    def __init__(self, cfg: Config, host_check: Callable[[], dict[str, Any] | None] | None = None,
                 host_sandbox_image: Callable[[], str | None] | None = None) -> None:
        """``host_check``: what to look at on the host every so often (on a node weft was installed onto, its place
        in containerd's configuration: ``shim.install.dropin.agent_watch``); its last answer is in the status.
        ``host_sandbox_image``: the pause image containerd's files say, where its Status does not (2.x)."""
        self.cfg = cfg
        self.host_sandbox_image = host_sandbox_image
        self.metrics = Metrics()
        self.upstream = Upstream(str(cfg.agent.containerd_socket))
        self.store = AgentStore(cfg.agent.state_dir)
        self.broker = BrokerClient(cfg.agent.broker_socket) if cfg.agent.broker_socket else None
        self.api = access.resolve(Path(cfg.kubernetes.kubeconfig) if cfg.kubernetes.kubeconfig else None)
        # Every node knows its own mark, hosting or not (a node that hosted before keeps its key): the list verbs
        # hide only what bears it, never a pod that merely carries a shadow's labels. Hidden from the first
        # answer: kubelet kills a running pod it does not know, and lists as soon as the agent serves it.
        self.shadows = ShadowsSeen(ShadowMark.load(Path(cfg.agent.state_dir)), present=True)
        # Where this node is on the mesh: its host side, the mesh, the tunnels (_mesh), and the origin side.
        self.meshed: Meshed | None = None
        # The origin side, made with the fabric (the verbs see it through the fabric, as shim.crishared.sides says).
        self.origin: Origin | None = None
        origin = self._mesh(cfg) if cfg.mesh.address else None
        host = self.meshed.host if self.meshed is not None else None
        self.fabric = Fabric(self.upstream, self.store, self.broker, self.metrics,
                             cdi_specs=CdiSpecs(cfg.agent.cdi_spec_path_list), shadows=self.shadows,
                             reservation_of=host.reservation if host is not None else None, origin=origin)
        self.server = RelayServer(cfg.agent.socket, str(cfg.agent.containerd_socket), routes.table(self.fabric),
                                  Instrument(self.metrics, self.fabric.pod_of), cfg.agent.workers)
        self.reconciler = Reconciler(self.fabric)
        self.supervisor: RemoteSupervisor | None = None
        if self.origin is not None:
            m = cfg.mesh
            self.supervisor = RemoteSupervisor(self.fabric, self.origin, loss_timeout=m.loss_timeout,
                                               heartbeat=m.heartbeat_interval, volume_interval=m.volume_sync_interval)
        self.http: HttpEndpoint | None = None
        self._host_check: Periodic | None = None
        if host_check is not None:
            def look() -> None:
                self.fabric.host_config = host_check()

            self._host_check = Periodic("weft-host-check", HOST_CHECK_INTERVAL, look,
                                        failed="containerd.config.check_failed", first=True)
        self._stop = threading.Event()

    def _mesh(self, cfg: Config) -> Callable[[Fabric], Origin]:
        """This node's mesh, its host side and its tunnels; what makes the fabric's origin side from them."""
        from shim.mesh.node import MeshNode
        from shim.mesh.tunnel import contexts
        from shim.origin.stitch import OriginNet
        from shim.origin.stream_relay import StreamRelay
        from shim.shadowhost.side import HostSide

        m = cfg.mesh
        host = HostSide(HostContext(self.upstream, self.metrics, self.shadows), cfg.agent.state_dir,
                          fence_timeout=m.fence_timeout, heartbeat_interval=m.heartbeat_interval,
                          cgroup_parent=m.shadow_cgroup_parent, prepared_sandbox_ttl=m.prepared_sandbox_ttl)
        mesh = MeshNode(node=m.node_name or socketlib.gethostname(), role={"both": "gpu,cpu"}.get(m.role, m.role),
                        address=m.address, peers=m.peers, tls_dir=m.tls_dir, hello_interval=m.hello_interval,
                        namespace=m.namespace, service=m.service, metrics=self.metrics, host=host.hosting,
                        fixed_capacity=m.fixed_capacity, drain_file=Path(cfg.agent.state_dir) / "draining",
                        api=self.api)
        k = cfg.kubernetes
        pods = PodCache(self.api, mesh.node) if self.api.available and k.pod_spec and "gpu" in mesh.role.split(",") \
            else None
        if self.api.available and k.reservations and "cpu" in mesh.role.split(","):
            pause = SandboxImage(self.upstream.channel, k.reservation_image, from_host=self.host_sandbox_image)
            host.reserve_with(self.api, mesh.node, k.namespace, pause, grace=k.reservation_grace,
                              metrics=self.metrics, store=self.store)
            host.reservations.on_cordon = lambda on: setattr(mesh.probe, "cordoned", on)  # no new stages then
            self._stop_hook(cfg, host)
        self.meshed = Meshed(host, mesh, self._tunnels(cfg, mesh, host), pods)
        settings = OriginSettings(pods_dir=m.kubelet_pods_dir, peer_max_age_s=max(30.0, 3 * m.hello_interval),
                                  prepare_shadow_sandbox=m.prepare_shadow_sandbox,
                                  stitch_kernel_path=m.stitch_kernel_path, encrypt_pod_tunnels=m.tunnel_tls)
        tunnel_tls = contexts(m.tls_dir, mesh.node)[1]
        streams = StreamRelay(mesh, tunnel_tls, cfg.agent.stream_address, busy_poll_us=cfg.agent.stream_busy_poll_us)
        pod_spec = pods.spec_of if pods is not None else None

        def origin(fabric: Fabric) -> Origin:
            self.origin = Origin(mesh, settings, tunnel_tls, pod_spec, prepared=Prepared(mesh, settings),
                                 streams=streams, stitch=OriginNet(fabric.remotes, fabric.opted_in, fabric.upstream,
                                                                   mesh, settings, tunnel_tls))
            return self.origin

        return origin

    def _stop_hook(self, cfg: Config, host: HostSide) -> None:
        """Reservation pods get a preStop hook to this agent's HTTP endpoint, where kubelet (in the host's
        network) reaches it: an address bound to every interface is reached on loopback. None when switched off,
        without an endpoint, or on a port chosen at bind time (not known when a reservation is made)."""
        from shim.core.annotations import parse_host_port

        if not (cfg.kubernetes.reservation_stop_hook and cfg.agent.metrics_address) or host.reservations is None:
            return
        address, port = parse_host_port(cfg.agent.metrics_address, field="agent.metrics_address")
        if port == 0:
            return
        reachable = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(address, address)
        host.reservations.stop_endpoint = (reachable, port)
        host.reservations.stop_token = host.lifecycle.mark.reservation_stop

    def _tunnels(self, cfg: Config, mesh: MeshNode, host: HostSide) -> TunnelServer:
        """The host's end of exec/attach and of the stitched pod network (shim.mesh.tunnel, shim.shadowhost.tunnel);
        the origin's ends are its side's (shim.origin.stream_relay, shim.origin.stitch)."""
        from shim.core.annotations import parse_host_port
        from shim.mesh.tunnel import TunnelServer
        from shim.shadowhost.tunnel import ShadowNet

        tunnel = TunnelServer(parse_host_port(cfg.mesh.address, field="mesh.address")[0], cfg.mesh.tls_dir,
                              mesh.node, busy_poll_us=cfg.agent.stream_busy_poll_us,
                              trusted=lambda: mesh.peer_addresses)
        net = ShadowNet(host.rt, tunnel)
        net.kernel_path = cfg.mesh.stitch_kernel_path
        net.tunnel_tls = cfg.mesh.tunnel_tls
        host.calls.net = net
        return tunnel

    def _dead_loops(self) -> list[str]:
        """The accept loops that died (for /healthz): the tunnel port and the stream relay."""
        if self.meshed is None or self.origin is None:
            return []
        loops = {"tunnel": self.meshed.tunnel, "stream-relay": self.origin.streams}
        return [name for name, server in loops.items() if not server.alive]

    def start(self) -> None:
        access.announce(self.api)
        self.server.start()
        failpoint.pause("agent.serving")  # kubelet answered before the rest is up, as on a loaded node (tests)
        self.reconciler.start()
        meshed, origin = self.meshed, self.origin
        if meshed is not None:
            meshed.host.open()
            meshed.mesh.start()
            if meshed.pods is not None:
                meshed.pods.start()
            meshed.tunnel.start()
        if origin is not None:
            for part in (self.supervisor, origin.streams, origin.stitch):
                if part is not None:
                    part.start()
        if self.cfg.agent.metrics_address:
            try:
                reservations = meshed.host.reservations if meshed is not None else None
                self.http = HttpEndpoint(self.cfg.agent.metrics_address, self.metrics, _probe(self.upstream),
                                         self._dead_loops,
                                         reservations.stop_for_kubelet if reservations is not None else None)
            except OSError:
                self.server.stop(0)
                raise
            self.http.start()
        if self._host_check is not None:
            self._host_check.start()
        _log.info(
            "agent.started", socket=str(self.cfg.agent.socket), containerd=self.upstream.socket,
            http=self.http.address if self.http else None, pid=os.getpid(),
            broker=self.cfg.agent.broker_socket or None, opted_in=len(self.fabric.opted_in),
            mesh=self.cfg.mesh.address or None,
        )

    def stop(self, grace: float = 5.0) -> None:
        _log.info("agent.stopping", grace_s=grace)
        started = time.monotonic()
        timed = _StopTimer()
        if self._host_check is not None:
            timed("host-check", self._host_check.stop)
        if self.http is not None:
            timed("http", self.http.stop)
        timed("cri-server", lambda: self.server.stop(grace))
        meshed, origin = self.meshed, self.origin
        if origin is not None:
            for name, part in (("stitch", origin.stitch), ("stream-relay", origin.streams)):
                if part is not None:
                    timed(name, part.stop)
        if meshed is not None:
            timed("tunnel", meshed.tunnel.stop)
            timed("host-net", meshed.host.calls.net.close)
        if self.supervisor is not None:
            timed("supervisor", self.supervisor.stop)
        if meshed is not None:
            if meshed.pods is not None:
                timed("pod-watch", meshed.pods.stop)
            timed("mesh", meshed.mesh.stop)
            timed("host", meshed.host.close)
        timed("reconciler", self.reconciler.stop)
        self.upstream.close()
        if self.broker is not None:
            self.broker.close()
        self.store.close()
        _log.info("agent.stopped", s=round(time.monotonic() - started, 3), slowest=timed.slowest())

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def run(self) -> None:
        # Handlers that only note the signal, and a main thread that waits in short waits: a handler that set
        # the Event itself could deadlock on its lock, interrupting the main thread inside it (shim.stopping).
        signals = stopping.Signals()
        self.start()
        sdnotify.notify()  # only now may kubelet start (the unit is Type=notify, Before=kubelet.service)
        try:
            signals.wait(self._stop)
        finally:
            self.stop()
