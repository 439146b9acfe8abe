"""A booted node laid out as kubeadm lays out a worker: containerd and kubelet as systemd units.

What ``kubeadm join`` leaves on a node, written directly (the test cluster has no bootstrap tokens):
``kubelet.service`` with its ``10-kubeadm.conf`` drop-in, ``/var/lib/kubelet/config.yaml``,
``kubeadm-flags.env`` naming containerd's socket, ``/etc/kubernetes/kubelet.conf`` with the cluster CA
embedded and the node's own client certificate (``system:node:<name>`` in ``system:nodes``, from the
cluster CA) in ``/var/lib/kubelet/pki``, and ``/etc/kubernetes/pki/ca.crt``. containerd is Debian's (1.6,
in the node's root) or a release the tests build, replacing Debian's binaries in that node alone; its
configuration names the test registry for every pull. The pod network is flat across nodes: a CNI bridge
per node with its own subnet, and a oneshot unit that routes every other node's subnet through that node
and, standing in for kube-proxy, sends the ``kubernetes`` Service's address to the API server.

The KubeletConfiguration is kubeadm's with what this kind of machine needs (as the local harness's
kubelets have it, ``harness/kubelet.py``): cgroupfs, no per-QoS cgroups, no swap check, no
eviction thresholds, and kernel defaults left alone (the machine's settings are put back after the
cluster by :class:`harness.kubelet.KernelSettings`).
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from harness.nodes.nspawn import Node
from harness.pki import Pki

CONTAINERD_SOCKET = "unix:///var/run/containerd/containerd.sock"
KUBERNETES_SERVICE_IP = "10.96.0.1"  # the first address of the control plane's service range
PAUSE = "weft-test/pause:3.10"  # in the test registry (what the sandbox image is on every node)

KUBELET_UNIT = """[Unit]
Description=kubelet: The Kubernetes Node Agent
Documentation=https://kubernetes.io/docs/
Wants=network-online.target
After=network-online.target

[Service]
ExecStart=/usr/bin/kubelet
Restart=always
StartLimitInterval=0
RestartSec=10

[Install]
WantedBy=multi-user.target
"""
KUBEADM_DROPIN = """# Note: This dropin only works with kubeadm and kubelet v1.11+
[Service]
Environment="KUBELET_KUBECONFIG_ARGS=--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf --kubeconfig=/etc/kubernetes/kubelet.conf"
Environment="KUBELET_CONFIG_ARGS=--config=/var/lib/kubelet/config.yaml"
# This is a file that "kubeadm init" and "kubeadm join" generates at runtime, populating the KUBELET_KUBEADM_ARGS variable dynamically
EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env
# This is a file that the user can use for overrides of the kubelet args as a last resort.
EnvironmentFile=-/etc/default/kubelet
ExecStart=
ExecStart=/usr/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS $KUBELET_EXTRA_ARGS
"""  # noqa: E501  (kubeadm's own file, line for line)
ROUTES_UNIT = """[Unit]
Description=weft test cluster: the other nodes' pod subnets through those nodes, the API server's Service
After=network.target
Before=kubelet.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh -c '{script}'

[Install]
WantedBy=multi-user.target
"""


@dataclass(frozen=True)
class NodeSpec:
    name: str
    role: str  # the weft.io/role label: gpu or cpu
    containerd: str  # "1.6" (Debian's, in the root) or a line components/containerd/build.sh builds ("2")
    pod_subnet: str


def _minor(kubelet: Path) -> int:
    """The minor release of a kubelet binary ("Kubernetes v1.36.3" -> 36)."""
    said = subprocess.run([str(kubelet), "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"v1\.(\d+)\.", said)
    if m is None:
        raise RuntimeError(f"{kubelet} --version: {said.strip()!r} is not a kubelet version")
    return int(m.group(1))


def kubelet_config(minor: int) -> dict:
    """kubelet's config.yaml for a kubelet of release 1.``minor``.

    From 1.35 the in-place resize gate is GA and locked on (kubelet refuses a config that sets it) and kubelet
    refuses cgroup v1, which these machines run, unless told not to.
    """
    newer = {"failCgroupV1": False} if minor >= 35 else {"featureGates": {"InPlacePodVerticalScaling": False}}
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": "/etc/kubernetes/pki/ca.crt"}},
        "authorization": {"mode": "AlwaysAllow"},
        "cgroupDriver": "cgroupfs", "cgroupsPerQOS": False, "enforceNodeAllocatable": [],
        "clusterDNS": [], "clusterDomain": "cluster.local",
        "containerRuntimeEndpoint": CONTAINERD_SOCKET,
        "evictionHard": {}, "failSwapOn": False, "healthzBindAddress": "127.0.0.1", "healthzPort": 10248,
        "localStorageCapacityIsolation": False, "makeIPTablesUtilChains": False, "protectKernelDefaults": False,
        "resolvConf": "", "rotateCertificates": False, "serializeImagePulls": False, "syncFrequency": "10s",
        "staticPodPath": "/etc/kubernetes/manifests",
        **newer,
    }


def containerd_config(line: str, registry: str) -> str:
    """A node's /etc/containerd/config.toml: its own format (version 2 on 1.x, 3 on 2.x), runc by default."""
    if line.startswith("1."):
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        return f"""version = 2

[{cri}]
  sandbox_image = "{registry}/{PAUSE}"
  restrict_oom_score_adj = true

[{cri}.containerd]
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.cni]
  bin_dir = "/usr/lib/cni"
  conf_dir = "/etc/cni/net.d"

[{cri}.registry]
  config_path = "/etc/containerd/certs.d"
"""
    runtime, images = 'plugins."io.containerd.cri.v1.runtime"', 'plugins."io.containerd.cri.v1.images"'
    return f"""version = 3

[{runtime}]
  restrict_oom_score_adj = true

[{runtime}.containerd]
  default_runtime_name = "runc"

[{runtime}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{runtime}.cni]
  bin_dirs = ["/usr/lib/cni"]
  conf_dir = "/etc/cni/net.d"

[{images}.pinned_images]
  sandbox = "{registry}/{PAUSE}"

[{images}.registry]
  config_path = "/etc/containerd/certs.d"
"""


def _write(node: Node, inside: str, data: str | bytes, mode: int = 0o644) -> None:
    p = node.path(inside)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    p.chmod(mode)


def lay_out(node: Node, spec: NodeSpec, *, pki: Pki, server: str, registry: str, kubelet: Path,
            containerd_bin: Path | None, others: list[tuple[str, str]], crictl: Path | None = None) -> None:
    """Write what kubeadm join and a node's packages leave (``others``: every other node's address and pod
    subnet; ``crictl``, which a node image carries, as kind's do); nothing is started."""
    if crictl is not None:
        shutil.copy2(crictl, node.path("/usr/bin/crictl"))
        _write(node, "/etc/crictl.yaml", f"runtime-endpoint: {CONTAINERD_SOCKET}\nimage-endpoint: "
               f"{CONTAINERD_SOCKET}\ntimeout: 10\n")
    # containerd: the line's binaries in place of Debian's, its configuration, the test registry.
    if containerd_bin is not None:
        for name in ("containerd", "containerd-shim-runc-v2"):
            target = node.path(f"/usr/bin/{name}")
            target.unlink(missing_ok=True)
            shutil.copy2(containerd_bin / name, target)
    _write(node, "/etc/containerd/config.toml", containerd_config(spec.containerd, registry))
    _write(node, f"/etc/containerd/certs.d/{registry}/hosts.toml",
           f'server = "http://{registry}"\n\n[host."http://{registry}"]\n  capabilities = ["pull", "resolve"]\n')
    # The pod network.
    _write(node, "/etc/cni/net.d/10-weft-test.conflist", json.dumps({
        "cniVersion": "0.4.0", "name": "weft-test-cluster", "plugins": [
            {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False, "hairpinMode": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": spec.pod_subnet}]],
                      "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "portmap", "capabilities": {"portMappings": True}}]}, indent=1))
    # No kube-proxy here: the one Service pods reach, the API server's, is what it would make of it.
    api_host, api_port = server.removeprefix("https://").rsplit(":", 1)
    nat = [f"iptables -t nat -A {chain} -d {KUBERNETES_SERVICE_IP} -p tcp --dport 443 -j DNAT "
           f"--to-destination {api_host}:{api_port}" for chain in ("OUTPUT", "PREROUTING")]
    script = "; ".join(["sysctl -qw net.ipv4.ip_forward=1",
                        *(f"ip route replace {subnet} via {address}" for address, subnet in others), *nat])
    _write(node, "/etc/systemd/system/weft-test-routes.service", ROUTES_UNIT.format(script=script))
    # kubelet, as kubeadm join leaves it.
    shutil.copy2(kubelet, node.path("/usr/bin/kubelet"))
    _write(node, "/etc/systemd/system/kubelet.service", KUBELET_UNIT)
    _write(node, "/etc/systemd/system/kubelet.service.d/10-kubeadm.conf", KUBEADM_DROPIN)
    minor = _minor(kubelet)
    _write(node, "/var/lib/kubelet/config.yaml", yaml.safe_dump(kubelet_config(minor), sort_keys=True))
    # kubelet 1.35 dropped --pod-infra-container-image (the sandbox image is containerd's alone), and kubeadm with it.
    pause = f"--pod-infra-container-image={registry}/{PAUSE} " if minor < 35 else ""
    _write(node, "/var/lib/kubelet/kubeadm-flags.env",
           f'KUBELET_KUBEADM_ARGS="--container-runtime-endpoint={CONTAINERD_SOCKET} '
           f'{pause}--node-ip={node.address}"\n')
    _write(node, "/etc/default/kubelet", f'KUBELET_EXTRA_ARGS="--node-labels=weft.io/role={spec.role}"\n')
    ca = pki.ca_cert.read_bytes()
    _write(node, "/etc/kubernetes/pki/ca.crt", ca)
    cert, key = pki.client_certificate(f"system:node:{spec.name}", "system:nodes")
    _write(node, "/var/lib/kubelet/pki/kubelet-client-current.pem", cert + key, 0o600)
    _write(node, "/etc/kubernetes/kubelet.conf", yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "system:node:" + spec.name + "@kubernetes",
        "clusters": [{"name": "kubernetes", "cluster": {
            "certificate-authority-data": base64.b64encode(ca).decode(), "server": server}}],
        "contexts": [{"name": f"system:node:{spec.name}@kubernetes",
                      "context": {"cluster": "kubernetes", "user": f"system:node:{spec.name}"}}],
        "users": [{"name": f"system:node:{spec.name}", "user": {
            "client-certificate": "/var/lib/kubelet/pki/kubelet-client-current.pem",
            "client-key": "/var/lib/kubelet/pki/kubelet-client-current.pem"}}],
        "preferences": {}}, sort_keys=False), 0o600)
    node.path("/etc/kubernetes/manifests").mkdir(parents=True, exist_ok=True)


def start(node: Node) -> None:
    """Enable and start the node's units in kubeadm's order: the network, containerd, then kubelet."""
    node.systemctl("daemon-reload")
    node.systemctl("enable", "--now", "weft-test-routes.service")
    node.systemctl("enable", "--now", "containerd.service")
    node.systemctl("enable", "--now", "kubelet.service")
