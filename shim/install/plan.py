"""What an install writes, as values: the host's files in, the files to change and add out (pure).

The plan is computed from the host's *original* files: on a first install
the files as they are, on a re-run the backups in the journal. The same
originals always give the same plan, which is what makes every step
convergent: a re-run after a crash writes the same bytes again.
"""

from __future__ import annotations

from dataclasses import dataclass

from shim.install import containerd, kubelet
from shim.install.containerd import HostFiles

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
BROKER_UNIT = "weft-broker.service"
BROKERS = ("nvml", "simulated", "none")


@dataclass(frozen=True)
class Options:
    broker: str = "none"  # nvml | simulated | none
    simulated_devices: str = "2x80GiB"


@dataclass(frozen=True)
class Plan:
    modified: dict[str, bytes]  # host files that exist and change (backed up first)
    added: dict[str, bytes]  # files weft adds (removed by uninstall)
    units: tuple[str, ...]  # weft's units, in start order
    containerd_socket: str
    kubelet_endpoint_was: str

    def step_files(self, step: str) -> dict[str, bytes]:
        prefix = {"units": (UNIT_DIR,), "containerd-config": ("/etc/containerd/",),
                  "kubelet-config": (kubelet.CONFIG_YAML, *kubelet.FLAG_FILES)}[step]
        return {p: c for p, c in {**self.modified, **self.added}.items() if p.startswith(prefix)}


def agent_unit(containerd_socket: str, broker: bool) -> str:
    extra = f" --broker-socket {BROKER_SOCKET}" if broker else ""
    after = f" {BROKER_UNIT}" if broker else ""
    return f"""# Written by `weft install`; `weft uninstall` removes it.
[Unit]
Description=weft CRI proxy between kubelet and containerd
After=containerd.service{after}
Wants=containerd.service{after}
Before=kubelet.service

[Service]
ExecStart={BIN} agent --socket {AGENT_SOCKET} --containerd-socket {containerd_socket} --state-dir {STATE_DIR}{extra}
Restart=always
RestartSec=1
TimeoutStopSec=15

[Install]
WantedBy=multi-user.target kubelet.service
"""


def broker_unit(backend: str, simulated_devices: str) -> str:
    sim = f" --simulated-devices {simulated_devices}" if backend == "simulated" else ""
    return f"""# Written by `weft install`; `weft uninstall` removes it.
[Unit]
Description=weft GPU broker (leases of this node's GPUs)
Before={AGENT_UNIT} kubelet.service

[Service]
ExecStart={BIN} broker --socket {BROKER_SOCKET} --state-dir {BROKER_STATE_DIR} --backend {backend}{sim}
Restart=always
RestartSec=1

[Install]
WantedBy=multi-user.target
"""


def make(files: HostFiles, opts: Options) -> Plan:
    """Raises :class:`~shim.errors.UnrecognisedHost` for a host it does not understand, before anything is done."""
    ctr = containerd.plan(files, [HOOK], BROKER_SOCKET)
    kub = kubelet.plan(files, ctr.socket, AGENT_SOCKET)
    broker = opts.broker != "none"
    added = {
        f"{UNIT_DIR}/{AGENT_UNIT}": agent_unit(ctr.socket, broker).encode(),
        containerd.BASE_SPEC: ctr.base_spec,
        containerd.DROPIN: ctr.dropin,
    }
    if broker:
        added[f"{UNIT_DIR}/{BROKER_UNIT}"] = broker_unit(opts.broker, opts.simulated_devices).encode()
    modified = dict(kub.files)
    original = files.read(containerd.CONFIG)
    if ctr.config != original:
        modified[containerd.CONFIG] = ctr.config
    return Plan(modified=modified, added=added, units=(BROKER_UNIT, AGENT_UNIT) if broker else (AGENT_UNIT,),
                containerd_socket=ctr.socket, kubelet_endpoint_was=kub.endpoint_was)
