"""etcd, kube-apiserver and kube-scheduler for the test cluster, on this machine.

etcd listens on loopback. The API server listens on one address of the root network namespace that
the test nodes reach (the local fabric's mesh bridge), with a serving certificate from ``pki``,
static tokens for its clients (an admin in ``system:masters``, one ``system:node:<name>`` per kubelet,
the scheduler), Node and RBAC authorization, the ServiceAccount admission and token signing. No
controller-manager runs unless a test starts one with the controllers it needs (the DRA test's
resourceclaim controller): what its controllers would make that the tests need (the ``default``
ServiceAccount, the ``kube-root-ca.crt`` ConfigMap) the fixture makes itself, and the
TaintNodesByCondition admission is off, since no node lifecycle controller would lift its taint.
"""

from __future__ import annotations

import json
import secrets
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from harness import binaries
from harness.pki import Pki, make_pki
from harness.procs import Daemon, free_port

SERVICE_CIDR = "10.96.0.0/24"
ISSUER = "https://kubernetes.default.svc.cluster.local"


@dataclass
class ControlPlane:
    workdir: Path
    address: str  # where the API server listens: an address of the root namespace the nodes reach
    node_names: list[str]
    timings: dict[str, float] = field(default_factory=dict)
    pki: Pki | None = None
    tokens: dict[str, str] = field(default_factory=dict)
    etcd: Daemon | None = None
    apiserver: Daemon | None = None
    scheduler: Daemon | None = None
    controller_manager: Daemon | None = None
    api_port: int = 0
    etcd_port: int = 0
    # The ``weft`` RuntimeClass made up front, as the harness's agents need it; off where the test installs
    # weft's own manifests or chart, which make it (Helm refuses to take over an object it did not make).
    runtime_class: bool = True

    @property
    def server(self) -> str:
        return f"https://{self.address}:{self.api_port}"

    # -- start and stop ----------------------------------------------------------
    def start(self, timeout: float = 120.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.api_port = free_port(self.address)
        self.pki = make_pki(self.workdir / "pki", [self.address, "127.0.0.1", "10.96.0.1"],
                            ["kubernetes", "kubernetes.default", "kubernetes.default.svc",
                             "kubernetes.default.svc.cluster.local"])
        users = {"admin": ("admin", "system:masters"), "scheduler": ("system:kube-scheduler", "")}
        users.update({n: (f"system:node:{n}", "system:nodes") for n in self.node_names})
        self.tokens = {who: secrets.token_hex(16) for who in users}
        (self.workdir / "tokens.csv").write_text("".join(
            f'{self.tokens[who]},{user},{user},"{group}"\n' for who, (user, group) in users.items()))
        for who in users:
            self.write_kubeconfig(who)
        self.etcd_port, peer_port = free_port(), free_port()
        self.etcd = Daemon("etcd", [
            binaries.binary("etcd"), "--name", "weft-test", "--data-dir", str(self.workdir / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"weft-test=http://127.0.0.1:{peer_port}",
            "--unsafe-no-fsync", "--log-level", "warn"], self.workdir / "etcd.log")
        self.timings["etcd ready"] = self.etcd.start(self._etcd_healthy, timeout)
        self.start_apiserver(timeout)
        self._bootstrap()
        self.scheduler = Daemon("kube-scheduler", [
            binaries.binary("kube-scheduler"), "--kubeconfig", str(self.kubeconfig("scheduler")),
            "--leader-elect=false", "--secure-port=0", "--v=1"], self.workdir / "kube-scheduler.log")
        self.scheduler.start(lambda: True, timeout)

    def start_apiserver(self, timeout: float = 120.0) -> None:
        assert self.pki is not None
        self.apiserver = Daemon("kube-apiserver", [
            binaries.binary("kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            f"--bind-address={self.address}", f"--advertise-address={self.address}",
            f"--secure-port={self.api_port}", f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={self.pki.serving_cert}", f"--tls-private-key-file={self.pki.serving_key}",
            f"--client-ca-file={self.pki.ca_cert}", f"--token-auth-file={self.workdir / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction", "--disable-admission-plugins=TaintNodesByCondition",
            f"--service-account-issuer={ISSUER}", f"--service-account-key-file={self.pki.sa_public}",
            f"--service-account-signing-key-file={self.pki.sa_private}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--endpoint-reconciler-type=none",
            "--kubelet-preferred-address-types=InternalIP", "--allow-privileged=true", "--profiling=false",
            "--v=1"], self.workdir / "kube-apiserver.log")
        self.timings["API server ready"] = self.apiserver.start(self._apiserver_ready, timeout)

    def stop_apiserver(self) -> None:
        if self.apiserver is not None:
            self.apiserver.stop()

    def start_controller_manager(self, controllers: list[str], timeout: float = 120.0) -> None:
        """kube-controller-manager with only ``controllers`` (the DRA tests' resourceclaim controller, a real
        cluster's workload controllers), as the admin; built by components/dra/build.sh, since most tests need
        none."""
        assert self.pki is not None
        self.controller_manager = Daemon("kube-controller-manager", [
            binaries.dra_binary("kube-controller-manager"), "--kubeconfig", str(self.kubeconfig("admin")),
            f"--controllers={','.join(controllers)}", "--leader-elect=false", "--secure-port=0",
            f"--root-ca-file={self.pki.ca_cert}", "--v=1"],  # what the CA publisher puts in kube-root-ca.crt
            self.workdir / "kube-controller-manager.log")
        self.controller_manager.start(lambda: True, timeout)

    def stop(self) -> None:
        for d in (self.controller_manager, self.scheduler, self.apiserver, self.etcd):
            if d is not None:
                d.stop()

    # -- health --------------------------------------------------------------------
    def _etcd_healthy(self) -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.etcd_port}/health", timeout=2) as r:
            return json.loads(r.read()).get("health") == "true"

    def _apiserver_ready(self) -> bool:
        status, _ = self.get("/readyz")
        return status == 200

    def get(self, path: str, who: str = "admin") -> tuple[int, str]:
        """A GET on the API server as ``who``: the status and the body."""
        assert self.pki is not None
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        req = urllib.request.Request(self.server + path, headers={"Authorization": f"Bearer {self.tokens[who]}"})
        try:
            with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    # -- clients -----------------------------------------------------------------------
    def kubeconfig(self, who: str) -> Path:
        return self.workdir / f"{who}.kubeconfig"

    def write_kubeconfig(self, who: str) -> Path:
        assert self.pki is not None
        path = self.kubeconfig(who)
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "weft",
            "clusters": [{"name": "weft", "cluster": {"server": self.server,
                                                      "certificate-authority": str(self.pki.ca_cert)}}],
            "users": [{"name": who, "user": {"token": self.tokens[who]}}],
            "contexts": [{"name": "weft", "context": {"cluster": "weft", "user": who, "namespace": "default"}}],
        }, indent=1))
        path.chmod(0o600)
        return path

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 120.0,
                ) -> subprocess.CompletedProcess[str]:
        """The real kubectl (built with the cluster) as the admin."""
        res = subprocess.run([binaries.binary("kubectl"), "--kubeconfig", str(self.kubeconfig("admin")), *args],
                             input=stdin, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}")
        return res

    def kubectl_argv(self, *args: str) -> list[str]:
        return [binaries.binary("kubectl"), "--kubeconfig", str(self.kubeconfig("admin")), *args]

    # -- what a controller-manager would have made ---------------------------------------------
    def _bootstrap(self) -> None:
        """The objects the tests' pods need that no controller makes here, and the ``weft`` RuntimeClass."""
        assert self.pki is not None
        ca = self.pki.ca_cert.read_text()
        manifest = {"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": "default"}},
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "kube-root-ca.crt", "namespace": "default"},
             "data": {"ca.crt": ca}},
        ]}
        if self.runtime_class:
            manifest["items"].append({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                                      "metadata": {"name": "weft"}, "handler": "weft"})
        deadline = time.monotonic() + 60
        while True:  # RBAC's bootstrap roles may still be on their way right after /readyz
            res = self.kubectl("apply", "-f", "-", stdin=json.dumps(manifest), check=False)
            if res.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"bootstrap objects: {res.stderr}")
            time.sleep(0.5)
