"""Configuration: frozen dataclasses per subsystem, one loader.

Values come from a TOML file (``--config``) and are then overridden by flags.
Every validation error names the field (``agent.socket``) and the value, so a
platform engineer can fix the file without reading code.

Example file::

    [agent]
    socket = "/run/weft/cri.sock"
    containerd_socket = "/run/containerd/containerd.sock"
    state_dir = "/var/lib/weft"
    metrics_address = "127.0.0.1:9464"   # "" turns the HTTP endpoint off
    broker_socket = "/run/weft/broker.sock"  # "" on nodes without GPUs
    log_level = "info"
    workers = 64                          # threads for intercepted calls
    stream_address = "127.0.0.1:0"        # exec/attach of rerouted containers (beside containerd's)
    stream_busy_poll_us = 200             # exec/attach relays spin up to this long after a keystroke; 0: off
    cdi_spec_dirs = "/etc/cdi:/var/run/cdi"  # containerd's cdi_spec_dirs: a DRA claim's GPUs are read there

    [mesh]                                # off unless address is set
    node_name = "gpu-1"                   # default: the host name
    role = "gpu"                          # gpu, cpu or both
    address = "10.0.0.4:7443"
    peers = "/etc/weft/peers.toml"        # or "kubernetes" (EndpointSlices of the weft-mesh Service)
    tls_dir = "/etc/weft/mesh"
    tunnel_tls = true                     # pod bytes in the user-space tunnel inside TLS (false: plaintext)

    [kubernetes]
    kubeconfig = "/etc/weft/kubeconfig"   # kept by the DaemonSet (weft kube-credentials); "" : in-cluster or none

    [report]                              # weft report (flags override)
    prometheus = "http://prometheus.monitoring:9090"
    timeout = 10.0                        # seconds per Prometheus request
    default_node_type = "p4d.24xlarge"    # for nodes without an instance-type label
    [report.prices."p4d.24xlarge"]        # per node type (node.kubernetes.io/instance-type)
    gpu_hour = 4.10
    vcpu_hour = 0.05
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shim.core.annotations import parse_host_port
from shim.errors import ConfigError

LOG_LEVELS = ("debug", "info", "warning", "error")
# Past a millisecond a relay would spin through a person's typing pauses: CPU spent for no echo sooner.
MAX_BUSY_POLL_US = 1000


@dataclass(frozen=True)
class AgentConfig:
    socket: Path = Path("/run/weft/cri.sock")
    containerd_socket: Path = Path("/run/containerd/containerd.sock")
    state_dir: Path = Path("/var/lib/weft")
    metrics_address: str = "127.0.0.1:9464"
    log_level: str = "info"
    # The GPU broker's socket; "" for a node without GPUs (GPU containers of
    # opted-in pods then fail with UNAVAILABLE, everything else works).
    broker_socket: str = ""
    # Threads for the calls weft answers itself; pass-through needs none.
    workers: int = 64
    # The streaming server for Exec/Attach of rerouted containers (HOST:PORT, port 0 picks one): where
    # kubelet reaches it, as it reaches containerd's own (stream_server_address, 127.0.0.1 by default).
    stream_address: str = "127.0.0.1:0"
    # After a small transfer, an exec/attach relay polls without sleeping (yielding the CPU) for this many
    # microseconds before it blocks: a wake-up from idle costs more than the echo itself (shim.mesh.tunnel).
    stream_busy_poll_us: int = 200
    # Where containerd reads CDI specs (its cdi_spec_dirs), colon-separated: a DRA claim's CDI devices
    # are matched to GPUs through them.
    cdi_spec_dirs: str = "/etc/cdi:/var/run/cdi"

    @property
    def cdi_spec_path_list(self) -> list[Path]:
        return [Path(p) for p in self.cdi_spec_dirs.split(":") if p]

    def validate(self) -> None:
        if self.metrics_address:
            try:
                parse_host_port(self.metrics_address, field="agent.metrics_address")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        try:
            parse_host_port(self.stream_address, field="agent.stream_address")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"agent.log_level: {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
        if not 0 <= self.stream_busy_poll_us <= MAX_BUSY_POLL_US:
            raise ConfigError(f"agent.stream_busy_poll_us: {self.stream_busy_poll_us} is not between 0 (off) and "
                              f"{MAX_BUSY_POLL_US} microseconds")
        if self.workers < 4:
            raise ConfigError(f"agent.workers: {self.workers} is too few (at least 4)")
        for p in self.cdi_spec_path_list:
            if not p.is_absolute():
                raise ConfigError(f"agent.cdi_spec_dirs: {str(p)!r} must be an absolute path")
        for name in ("socket", "containerd_socket", "state_dir"):
            if not getattr(self, name).is_absolute():
                raise ConfigError(f"agent.{name}: {str(getattr(self, name))!r} must be an absolute path")


MESH_ROLES = ("gpu", "cpu", "both")


# The mesh's gRPC keepalive: a ping every STREAM_KEEPALIVE_S on a connection with a call or stream open, the
# connection dead when one goes unanswered for as long again. Until then a host counts an origin whose stream
# crosses a cut link as in contact, so the origin's loss timeout has to wait that long on top of the fence.
STREAM_KEEPALIVE_S = 2.0
STREAM_DEAD_S = 2 * STREAM_KEEPALIVE_S
FENCE_TICK_S = 0.5  # how often a host's fencer looks
# A Watch whose origin counts the open stream as contact (keepalive ends it over a dead link) needs a heartbeat
# only to show that the host's agent still runs, not that the link does: the host sends one after this long
# without any other message. The origin ends such a Watch after WATCH_QUIET_S without a message (an agent wedged
# while its gRPC core still answers pings), and then counts silence as before.
WATCH_IDLE_S = 15.0
WATCH_QUIET_S = 2 * WATCH_IDLE_S + STREAM_DEAD_S
# What the loss timeout must add to the fence timeout, besides one heartbeat interval (the origin's loss clock
# runs from the host's last heartbeat, up to one interval before the cut): the stream's keepalive, the
# fencer's round, and time for the kill.
LOSS_MARGIN_S = STREAM_DEAD_S + FENCE_TICK_S + 1.5

@dataclass(frozen=True)
class MeshConfig:
    """The peer mesh; off unless ``address`` is set."""

    node_name: str = ""  # this node's name in the mesh and its certificate; default: the host name
    role: str = "both"  # gpu, cpu or both: what this node offers
    address: str = ""  # HOST:PORT the mesh listens on
    peers: str = ""  # a static peers file (TOML, [[peer]] tables), or "kubernetes"
    tls_dir: str = ""  # ca.crt and <node>.crt/.key, as `weft mesh-certs` writes them
    hello_interval: float = 2.0
    namespace: str = "weft-system"  # kubernetes discovery: the DaemonSet's namespace
    service: str = "weft-mesh"  # ... and its headless Service
    # At most one live copy (docs/design.md): a host kills an origin's shadows after
    # fence_timeout without a Hello or Watch from it; the origin reports them
    # exited (WeftPeerLost) only after loss_timeout without hearing from the
    # host. loss_timeout - fence_timeout is the margin the kill has. The
    # defaults let kubelet's restart run again within 30 s of a host dying.
    fence_timeout: float = 8.0
    loss_timeout: float = 16.0
    # How often a host looks for changes of the shadows its Watches report, and beats on the Watch of an origin
    # that asks for no idle heartbeat (an older weft).
    heartbeat_interval: float = 1.0
    # Where kubelet keeps pods' volumes: which mounts are ConfigMaps/Secrets to copy, which are host paths.
    kubelet_pods_dir: str = "/var/lib/kubelet/pods"
    # How often a remote container's read-only volumes are compared and their changes sent to the host.
    volume_sync_interval: float = 5.0
    # Where a host puts the cgroups of the shadows it runs (a path, or a slice with the systemd driver).
    shadow_cgroup_parent: str = "/weft-shadows"
    # "CORES,MEMORY" to advertise instead of measuring (test and demo nodes sharing one machine); "" measures.
    fixed_capacity: str = ""
    # Make an opted-in pod's shadow sandbox on the likeliest host as soon as its RunPodSandbox arrives.
    prepare_shadow_sandbox: bool = True
    # A host removes a shadow sandbox no container has used for this long (prepared, or left half-way).
    prepared_sandbox_ttl: float = 60.0
    # Carry a rerouted container's ports on localhost through the kernel (nftables in the origin pod's
    # namespace) where the pod network reaches the shadow; the agents' tunnel otherwise.
    stitch_kernel_path: bool = True
    # Carry pod bytes in the agents' user-space tunnel inside TLS with the mesh certificates. Either end asking
    # for it is enough. Off only where the cluster's network already encrypts traffic between nodes.
    tunnel_tls: bool = True

    def validate(self) -> None:
        if self.role not in MESH_ROLES:
            raise ConfigError(f"mesh.role: {self.role!r} is not one of {', '.join(MESH_ROLES)}")
        for name in ("hello_interval", "fence_timeout", "loss_timeout", "heartbeat_interval", "prepared_sandbox_ttl"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"mesh.{name}: {getattr(self, name)} must be positive")
        if self.fence_timeout < 2 * max(self.hello_interval, self.heartbeat_interval):
            raise ConfigError(f"mesh.fence_timeout: {self.fence_timeout} s must be at least two Hello intervals "
                              f"({self.hello_interval} s) and two heartbeats ({self.heartbeat_interval} s), "
                              "or a healthy origin's shadows would be fenced")
        margin = LOSS_MARGIN_S + self.heartbeat_interval
        if self.loss_timeout < self.fence_timeout + margin:
            raise ConfigError(f"mesh.loss_timeout: {self.loss_timeout} s must exceed mesh.fence_timeout "
                              f"({self.fence_timeout} s) by at least {margin:g} s: the origin's clock runs from the "
                              f"host's last heartbeat (every {self.heartbeat_interval:g} s), a cut link's mesh "
                              f"stream looks open to the host for up to {STREAM_DEAD_S:g} s (keepalive), and the "
                              "host then needs time to kill a fenced shadow before the origin starts another copy")
        if not self.address:
            return
        try:
            parse_host_port(self.address, field="mesh.address")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for name in ("peers", "tls_dir"):
            if not getattr(self, name):
                raise ConfigError(f"mesh.{name}: required when mesh.address is set")


@dataclass(frozen=True)
class ReportConfig:
    """``weft report``: where Prometheus is, and what GPU-hours and vCPU-hours cost per node type."""

    prometheus: str = ""  # http://HOST:PORT of the Prometheus server
    timeout: float = 10.0  # seconds per request
    default_node_type: str = ""
    currency: str = "$"
    prices: dict = field(default_factory=dict)  # node type -> {gpu_hour, vcpu_hour}

    def validate(self) -> None:
        if self.timeout <= 0:
            raise ConfigError(f"report.timeout: {self.timeout} must be positive")
        for node_type, price in self.prices.items():
            where = f'report.prices."{node_type}"'
            if not isinstance(price, dict):
                raise ConfigError(f"{where}: expected a table with gpu_hour and vcpu_hour, got {price!r}")
            for key in sorted(set(price) | {"gpu_hour", "vcpu_hour"}):
                value = price.get(key)
                if key not in ("gpu_hour", "vcpu_hour"):
                    raise ConfigError(f"{where}.{key}: unknown setting (known: gpu_hour, vcpu_hour)")
                if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                    raise ConfigError(f"{where}.{key}: expected a price of zero or more, got {value!r}")


@dataclass(frozen=True)
class KubernetesConfig:
    """The agent's access to the Kubernetes API (``shim.kube.access``)."""

    # A kubeconfig for the agent (the DaemonSet keeps one at /etc/weft/kubeconfig); "" uses in-cluster
    # configuration where the process has it, and otherwise no API.
    kubeconfig: str = ""
    namespace: str = "weft-system"  # weft's own namespace: where a host's reservation pods live
    # A host with the API gives each shadow a reservation pod, so that Kubernetes counts, arbitrates and shows it.
    reservations: bool = True
    # The node's pause image (containerd's sandbox image); "" asks the running containerd (weft install writes the
    # one containerd's configuration names).
    reservation_image: str = ""
    # How long a shadow may run before kubelet admits its reservation; then it stops.
    reservation_grace: float = 10.0
    # Reservation pods carry a preStop hook to the agent's HTTP endpoint, so that kubelet holds a preempted
    # stage's CPU until the shadow has stopped. Off where kubelet cannot reach that endpoint.
    reservation_stop_hook: bool = True
    # Placement reads the pod spec from a cache of the node's Pods (emptyDirs, init containers, requests).
    pod_spec: bool = True

    def validate(self) -> None:
        if not self.namespace:
            raise ConfigError("kubernetes.namespace: required (weft's own namespace)")
        if self.reservation_grace <= 0:
            raise ConfigError(f"kubernetes.reservation_grace: {self.reservation_grace} must be positive")


@dataclass(frozen=True)
class Config:
    agent: AgentConfig = field(default_factory=AgentConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    report: ReportConfig = field(default_factory=ReportConfig)


def _build(cls: type, table: Mapping[str, Any], section: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"{section}.{key}: unknown setting (known: {known})")
        default = fields[key].default
        want = type(default) if default is not dataclasses.MISSING else str
        if fields[key].default_factory is dict:  # a table of tables, checked by the section's validate()
            want = dict
        if want is Path or isinstance(default, Path):
            if not isinstance(value, str):
                raise ConfigError(f"{section}.{key}: expected a path string, got {value!r}")
            value = Path(value)
        elif want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ConfigError(f"{section}.{key}: expected {want.__name__}, got {value!r}")
        kwargs[key] = value
    return cls(**kwargs)


def load(path: Path | None = None, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Config:
    """Read ``path`` (if given), apply ``overrides`` (section -> field -> value, None skipped), validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"config file {path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: {exc}") from exc
    for section in raw:
        if section not in {f.name for f in dataclasses.fields(Config)}:
            raise ConfigError(f"{section}: unknown section in {path}")
    sections: dict[str, Any] = {}
    for f in dataclasses.fields(Config):
        table = dict(raw.get(f.name, {}))
        for key, value in (overrides or {}).get(f.name, {}).items():
            if value is not None:
                table[key] = str(value) if isinstance(value, Path) else value
        sections[f.name] = _build(type(f.default_factory()), table, f.name)  # type: ignore[misc]
    cfg = Config(**sections)
    cfg.agent.validate()
    cfg.mesh.validate()
    cfg.kubernetes.validate()
    cfg.report.validate()
    return cfg
