"""Kueue's controller manager beside the test cluster, as a platform team runs it, without its webhooks.

``components/kueue/build.sh`` builds ``sigs.k8s.io/kueue``'s manager and copies its CRDs. It runs here on this
machine against the cluster's API server with an admin kubeconfig (no RBAC to set up), leader election off, its
certificate management off, with a serving certificate of the test's own for the webhook server it always starts
(nothing calls it: no webhook configuration is registered, so a Job is created suspended, as Kueue's job webhook
would make it), and its on-demand visibility server off. Its metrics certificate path is fixed
(``/etc/kueue/metrics/certs``): the manager runs in a mount namespace of its own whose ``/etc`` is an overlay,
so that path exists there and nothing is written to this machine's ``/etc``.

Jobs' pods come from kube-controller-manager's Job controller, which the test starts with the garbage collector.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from harness import binaries
from harness.controlplane import ControlPlane
from harness.pki import make_pki
from harness.procs import Daemon, free_port
from shim.localfabric import builds
from shim.localfabric.waiting import wait_for

KUEUE_BUILD = binaries.REPO / "components" / "kueue" / "build.sh"
API = "kueue.x-k8s.io/v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
# Kueue manages Jobs in every namespace but these (it refuses a selector that takes kube-system or its own):
# weft's namespace is left out too, so that reservation pods are never a workload of anyone's queue.
UNMANAGED = ("kube-system", "kueue-system", "weft-system")


def bin_dir() -> Path:
    builds.run(KUEUE_BUILD)
    return Path(builds.run(KUEUE_BUILD, "--bin-dir"))


@dataclass
class Kueue:
    control: ControlPlane
    workdir: Path
    daemon: Daemon | None = None
    health_port: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    def __enter__(self) -> Kueue:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 180.0) -> None:
        bins = bin_dir()
        self.workdir.mkdir(parents=True, exist_ok=True)
        for crd in sorted((bins / "crds").glob("*.yaml")):  # the workloads CRD is too large for a client-side apply
            self.control.kubectl("apply", "--server-side", "-f", str(crd))
        # A CRD the API server has not given a status yet makes kubectl wait fail at once ("<nil> is of the type
        # <nil>") instead of waiting: asked again until all are established.
        wait_for(lambda: self.control.kubectl("wait", "--for=condition=Established", "--timeout=30s", "crd",
                                              "--all", check=False).returncode == 0,
                 timeout=90, what="Kueue's CRDs established", every=1.0)
        pki = make_pki(self.workdir / "certs", ["127.0.0.1"], ["localhost"])
        certs = self.workdir / "serving"
        certs.mkdir(exist_ok=True)
        shutil.copy(pki.serving_cert, certs / "tls.crt")
        shutil.copy(pki.serving_key, certs / "tls.key")
        self.health_port = free_port("127.0.0.1")
        config = self.workdir / "kueue.yaml"
        config.write_text(json.dumps({
            "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration", "namespace": "kueue-system",
            "leaderElection": {"leaderElect": False}, "internalCertManagement": {"enable": False},
            "webhook": {"host": "127.0.0.1", "port": free_port("127.0.0.1"), "certDir": str(certs)},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "integrations": {"frameworks": ["batch/job"]}, "manageJobsWithoutQueueName": False,
            "managedJobsNamespaceSelector": {"matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": list(UNMANAGED)}]}}))
        upper, work = self.workdir / "etc-upper", self.workdir / "etc-work"
        upper.mkdir(exist_ok=True)
        work.mkdir(exist_ok=True)
        script = (f'mount -t overlay overlay -o lowerdir=/etc,upperdir="{upper}",workdir="{work}" /etc && '
                  f'mkdir -p /etc/kueue/metrics/certs && cp "{certs}/tls.crt" "{certs}/tls.key" '
                  '/etc/kueue/metrics/certs/ && exec "$@"')
        self.daemon = Daemon("kueue", [
            "unshare", "--mount", "--propagation", "private", "sh", "-c", script, "kueue",
            str(bins / "kueue"), "--config", str(config), "--kubeconfig", str(self.control.kubeconfig("admin")),
            "--feature-gates=VisibilityOnDemand=false", "--zap-log-level=2"], self.workdir / "kueue.log")
        self.timings["kueue start"] = self.daemon.start(self._ready, timeout)

    def _ready(self) -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz", timeout=2) as r:
            return r.status == 200

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()

    def log(self) -> str:
        return (self.workdir / "kueue.log").read_text(errors="replace") if (self.workdir / "kueue.log").exists() else ""
