"""What an install writes, as values: the host's files in, the files to change and add out (pure).

The plan is computed from the host's *original* files: on a first install
the files as they are, on a re-run the backups in the journal. The same
originals always give the same plan, which is what makes every step
convergent: a re-run after a crash writes the same bytes again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from shim.broker.simulated import parse_spec
from shim.errors import ConfigError, InstallError
from shim.install import containerd, kubelet
from shim.install.containerd import HostFiles
from shim.mesh.capacity import fixed_host

OPT = "/opt/weft"
BIN = f"{OPT}/bin/weft"
HOOK = f"{OPT}/bin/weft-oci-hook"
AGENT_SOCKET = "/run/weft/cri.sock"
BROKER_SOCKET = "/run/weft/broker.sock"
STATE_DIR = "/var/lib/weft"
BROKER_STATE_DIR = "/var/lib/weft/broker"
INSTALL_DIR = "/var/lib/weft/install"
UNIT_DIR = "/etc/systemd/system"
AGENT_UNIT = "weft-agent.service"
# containerd's unit gains one line: weft's drop-in made again from the files it copies before each start.
CONTAINERD_UNIT_DROPIN = f"{UNIT_DIR}/containerd.service.d/10-weft.conf"
BROKER_UNIT = "weft-broker.service"
BROKERS = ("nvml", "simulated", "none")
# Node labels that choose a node's broker where --broker is auto: a label value holds no comma, so parts of a
# devices spec are joined with "_" there ("1x80Gi_1x40Gi").
BROKER_LABEL = "weft.io/broker"
DEVICES_LABEL = "weft.io/simulated-devices"
# A node that shares its machine with other nodes (kind's, a staging cluster's) advertises this capacity
# ("CORES_MEMORY", e.g. "1_2Gi") instead of measuring the whole machine's load: mesh.fixed_capacity.
CAPACITY_LABEL = "weft.io/fixed-capacity"
CONFIG = "/etc/weft/weft.toml"
# containerd's own default (1.7 and 2.x), and the agent's: nothing to pass on.
DEFAULT_CDI_SPEC_DIRS = ["/etc/cdi", "/var/run/cdi"]
MESH_TLS_DIR = "/etc/weft/mesh"
PEERS_FILE = "/etc/weft/peers.toml"
API_KUBECONFIG = "/etc/weft/api/kubeconfig"  # kept by the DaemonSet (weft kube-credentials)
MESH_ROLES = ("gpu", "cpu", "both")
DEFAULT_NAMESPACE = "weft-system"  # mesh.namespace's and kubernetes.namespace's default


@dataclass(frozen=True)
class Mesh:
    """This node's place in the mesh, and the files it needs (read by the caller: the plan stays pure)."""

    node_name: str
    role: str  # gpu | cpu | both
    address: str  # HOST:PORT the agent's mesh listens on
    peers: str  # "kubernetes", or the contents of a static peers file (peers_file)
    ca_crt: bytes
    node_crt: bytes
    node_key: bytes
    peers_file: bytes | None = None
    # The TLS files are already in MESH_TLS_DIR, kept there by `weft mesh-identity` (the node made its key
    # there): the installer checks them and neither writes nor removes them.
    tls_on_host: bool = False
    fixed_capacity: str = ""  # mesh.fixed_capacity ("CORES,MEMORY"); "" measures
    # weft's namespace in the cluster (the DaemonSet's own): where the mesh's EndpointSlices and the host's
    # reservation pods are. "" or the default writes nothing.
    namespace: str = ""

    def files(self, reservation_image: str | None = None) -> dict[str, bytes]:
        out = {} if self.tls_on_host else {
            f"{MESH_TLS_DIR}/ca.crt": self.ca_crt, f"{MESH_TLS_DIR}/{self.node_name}.crt": self.node_crt,
            f"{MESH_TLS_DIR}/{self.node_name}.key": self.node_key}
        out[CONFIG] = self.config(reservation_image)
        if self.peers_file is not None:
            out[PEERS_FILE] = self.peers_file
        return out

    def config(self, reservation_image: str | None = None) -> bytes:
        """weft.toml; ``reservation_image`` is the node's own pause image (containerd's sandbox image)."""
        peers = PEERS_FILE if self.peers_file is not None else self.peers
        q = _toml_string
        namespace = f"namespace = {q(self.namespace)}\n" if self.namespace not in ("", DEFAULT_NAMESPACE) else ""
        kube = f"[kubernetes]\nkubeconfig = {q(API_KUBECONFIG)}\n" + (
            f"reservation_image = {q(reservation_image)}\n" if reservation_image else "") + namespace
        return (f"# Written by `weft install`; `weft uninstall` removes it.\n[mesh]\nnode_name = {q(self.node_name)}\n"
                f"role = {q(self.role)}\naddress = {q(self.address)}\npeers = {q(peers)}\n"
                f"tls_dir = {q(MESH_TLS_DIR)}\n"
                + (f"fixed_capacity = {q(self.fixed_capacity)}\n" if self.fixed_capacity else "")
                + (namespace if self.peers == "kubernetes" else "")
                # Peers from Kubernetes: the DaemonSet keeps the agent's API credentials there.
                + (kube if self.peers == "kubernetes" else "")
                ).encode()


def broker_from_labels(labels: dict[str, str]) -> tuple[str | None, str | None]:
    """(broker, simulated devices) a node's labels choose; (None, None) where they choose nothing."""
    broker = labels.get(BROKER_LABEL)
    if broker is None:
        return None, None
    if broker not in BROKERS:
        raise InstallError(f"node label {BROKER_LABEL}={broker!r} is not one of {', '.join(BROKERS)}; "
                           "nothing was changed")
    devices = labels.get(DEVICES_LABEL)
    if devices is None or broker != "simulated":
        return broker, None
    devices = devices.replace("_", ",")
    try:
        parse_spec(devices)
    except ValueError as exc:
        raise InstallError(f"node label {DEVICES_LABEL}: {exc}; nothing was changed") from None
    return broker, devices


def capacity_from_labels(labels: dict[str, str]) -> str:
    """mesh.fixed_capacity from the node's label, checked; "" (measure) where it has none."""
    value = labels.get(CAPACITY_LABEL)
    if value is None:
        return ""
    spec = value.replace("_", ",", 1)
    try:
        fixed_host(spec)
    except ConfigError as exc:
        raise InstallError(f"node label {CAPACITY_LABEL}={value!r}: {exc.message}; nothing was changed") from None
    return spec


_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def selector_matches(selector: str, labels: dict[str, str], *, what: str) -> bool:
    """Whether ``labels`` match an equality-based Kubernetes label selector ("k=v,k2!=v2,k3,!k4"), as
    ``kubectl get -l`` reads one. The whole selector is checked first; set-based terms ("k in (a,b)") are
    refused, naming ``what`` set it."""
    terms: list[tuple[str, str, str]] = []  # (key, op, value); op one of = != exists absent
    for term in (t.strip() for t in selector.split(",")):
        if " in " in f" {term} " or " notin " in f" {term} " or "(" in term:
            raise InstallError(f"{what} {selector!r}: set-based terms ({term!r}) are not supported, only "
                               "key=value, key!=value, key and !key; nothing was changed")
        if "!=" in term:
            key, _, value = term.partition("!=")
            op = "!="
        elif "=" in term:
            key, _, value = term.replace("==", "=", 1).partition("=")
            op = "="
        elif term.startswith("!"):
            key, op, value = term[1:], "absent", ""
        else:
            key, op, value = term, "exists", ""
        key, value = key.strip(), value.strip()
        if not _LABEL_KEY.fullmatch(key):
            raise InstallError(f"{what} {selector!r}: {key!r} is not a label key; nothing was changed")
        terms.append((key, op, value))
    checks = {"=": lambda k, v: labels.get(k) == v, "!=": lambda k, v: labels.get(k) != v,
              "exists": lambda k, v: k in labels, "absent": lambda k, v: k not in labels}
    return all(checks[op](key, value) for key, op, value in terms)


def role_from_selectors(labels: dict[str, str], gpu_nodes: str, cpu_nodes: str) -> str | None:
    """The mesh role the cluster's selectors give a node with these labels (``--gpu-nodes``, ``--cpu-nodes``):
    gpu, cpu, both where both match; None where neither is set or none matches (the host decides)."""
    gpu = bool(gpu_nodes) and selector_matches(gpu_nodes, labels, what="--gpu-nodes")
    cpu = bool(cpu_nodes) and selector_matches(cpu_nodes, labels, what="--cpu-nodes")
    return "both" if gpu and cpu else "gpu" if gpu else "cpu" if cpu else None


def _toml_string(value: str) -> str:
    import json

    return json.dumps(value)  # a JSON string is a TOML basic string for the characters these hold


@dataclass(frozen=True)
class Options:
    broker: str = "none"  # nvml | simulated | none
    simulated_devices: str = "2x80GiB"
    mesh: Mesh | None = None  # no mesh: the agent runs without one (CPU containers stay local)


@dataclass(frozen=True)
class Plan:
    modified: dict[str, bytes]  # host files that exist and change (backed up first)
    added: dict[str, bytes]  # files weft adds (removed by uninstall)
    units: tuple[str, ...]  # weft's units, in start order
    containerd_socket: str
    kubelet_endpoint_was: str
    modes: dict[str, int] = field(default_factory=dict)  # files weft adds with another mode than 0644
    default_runtime: str = "runc"  # containerd's, as it merges its files
    runtimes: dict[str, Any] | None = None  # every runtime handler, likewise


def agent_unit(containerd_socket: str, broker: bool, config: bool = False,
               cdi_spec_dirs: tuple[str, ...] | None = None) -> str:
    extra = (f" --broker-socket {BROKER_SOCKET}" if broker else "") + (f" --config {CONFIG}" if config else "")
    if cdi_spec_dirs is not None and list(cdi_spec_dirs) != DEFAULT_CDI_SPEC_DIRS:
        extra += f" --cdi-spec-dirs {':'.join(cdi_spec_dirs)}"  # where a DRA claim's GPUs are named
    after = f" {BROKER_UNIT}" if broker else ""
    return f"""# Written by `weft install`; `weft uninstall` removes it.
[Unit]
Description=weft CRI proxy between kubelet and containerd
After=containerd.service{after}
Wants=containerd.service{after}
Before=kubelet.service

[Service]
# Ready once it serves CRI (sd_notify), so that kubelet, ordered after it, finds the socket at boot.
Type=notify
NotifyAccess=main
ExecStart={BIN} agent --socket {AGENT_SOCKET} --containerd-socket {containerd_socket} --state-dir {STATE_DIR}{extra}
Restart=always
RestartSec=1
TimeoutStopSec=15

[Install]
WantedBy=multi-user.target kubelet.service
"""


def containerd_unit_dropin() -> str:
    return f"""# Written by `weft install`; `weft uninstall` removes it.
# Before each start of containerd, weft's containerd drop-in is made again from the files it copies (containerd
# 1.x: the host's whole CRI section; 2.x: the default runtime), so that another tool's later change of
# containerd's configuration (NVIDIA's toolkit adding or changing its runtime, then restarting containerd) is
# never hidden behind an older copy. A failure leaves the drop-in as it was ('-'): containerd starts all the same.
[Service]
ExecStartPre=-{BIN} containerd-dropin
"""


def broker_unit(backend: str, simulated_devices: str) -> str:
    sim = f" --simulated-devices {simulated_devices}" if backend == "simulated" else ""
    return f"""# Written by `weft install`; `weft uninstall` removes it.
[Unit]
Description=weft GPU broker (leases of this node's GPUs)
Before={AGENT_UNIT} kubelet.service

[Service]
Type=notify
NotifyAccess=main
ExecStart={BIN} broker --socket {BROKER_SOCKET} --state-dir {BROKER_STATE_DIR} --backend {backend}{sim}
Restart=always
RestartSec=1

[Install]
WantedBy=multi-user.target
"""


def unapply(path: str, current: bytes, original: bytes) -> bytes:
    """``current`` (a host file weft changed, and someone else since) with weft's own edit taken out: its entry in
    containerd's ``imports``, kubelet's endpoints switched to the agent. Refused naming the file where that cannot
    be done by editing in place."""
    if path == containerd.CONFIG:
        try:
            text = current.decode()
        except UnicodeDecodeError as exc:
            raise InstallError(f"{path}: not UTF-8 text; nothing was changed") from exc
        return containerd.without_weft_runtime(containerd.without_import(text), path).encode()
    if path in (kubelet.CONFIG_YAML, *kubelet.FLAG_FILES):
        return kubelet.unswitch(path, current, original, AGENT_SOCKET)
    return original  # weft changes no other host file: what it wrote is taken back whole


def make(files: HostFiles, opts: Options, ctrd: containerd.Containerd) -> Plan:
    """Raises :class:`~shim.errors.UnrecognisedHost` for a host it does not understand, before anything is done.

    ``ctrd`` is the containerd the node runs: how it merges imports decides what the drop-in holds.
    """
    ctr = containerd.plan(files, [HOOK], BROKER_SOCKET, ctrd)
    kub = kubelet.plan(files, ctr.socket, AGENT_SOCKET)
    broker = opts.broker != "none"
    added = {
        f"{UNIT_DIR}/{AGENT_UNIT}": agent_unit(ctr.socket, broker, config=opts.mesh is not None,
                                               cdi_spec_dirs=ctr.cdi_spec_dirs).encode(),
        containerd.BASE_SPEC: ctr.base_spec,
        containerd.DROPIN: ctr.dropin,
        CONTAINERD_UNIT_DROPIN: containerd_unit_dropin().encode(),
    }
    if broker:
        added[f"{UNIT_DIR}/{BROKER_UNIT}"] = broker_unit(opts.broker, opts.simulated_devices).encode()
    modes = {}
    if opts.mesh is not None:
        added.update(opts.mesh.files(ctr.sandbox_image))
        modes = {p: 0o600 for p in opts.mesh.files() if p.endswith(".key")}
    modified = dict(kub.files)
    original = files.read(containerd.CONFIG)
    if ctr.config != original:
        modified[containerd.CONFIG] = ctr.config
    return Plan(modified=modified, added=added, units=(BROKER_UNIT, AGENT_UNIT) if broker else (AGENT_UNIT,),
                containerd_socket=ctr.socket, kubelet_endpoint_was=kub.endpoint_was, modes=modes,
                default_runtime=ctr.default_runtime, runtimes=ctr.runtimes)
