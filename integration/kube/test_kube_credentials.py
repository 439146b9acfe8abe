"""The host agent's Kubernetes API credentials, against a real kube-apiserver.

The DaemonSet's manifests (namespace, service account, RBAC, Service) are
applied as they ship; ``weft kube-credentials`` then runs as weft's own
service account, as it does in the DaemonSet's container, and keeps a
kubeconfig whose token it renews. What the agent does with it: discovers its
peers from the EndpointSlices, is refused anything else, picks up a renewed
token without a restart, and, with no API configuration at all, runs alone
instead of failing.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import lightkube
import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc
from lightkube.models.core_v1 import Container, PodSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod, Secret
from lightkube.resources.policy_v1 import PodDisruptionBudget

from harness.controlplane import ControlPlane
from shim.kube import access
from shim.localfabric.agent import AgentProcess, free_port
from shim.localfabric.containerd import Containerd
from shim.localfabric.waiting import wait_for
from shim.mesh.discovery import DiscoveryError, EndpointSliceDiscovery, Peer

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "nodeimage" / "manifests"


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    cp = ControlPlane(tmp_path_factory.mktemp("api"), "127.0.0.1", [])
    try:
        cp.start()
        for name in ("namespace.yaml", "serviceaccount.yaml", "rbac.yaml", "service.yaml"):
            cp.kubectl("apply", "-f", str(MANIFESTS / name))
        # The mesh port of one peer, as the DaemonSet's pod on node cpu-1 would give it.
        cp.kubectl("apply", "-f", "-", stdin=json.dumps({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": "weft-mesh-test", "namespace": "weft-system",
                         "labels": {"kubernetes.io/service-name": "weft-mesh"}},
            "ports": [{"name": "mesh", "port": 7443, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["10.9.0.2"], "nodeName": "cpu-1", "conditions": {"ready": True}}],
        }))
        yield cp
    finally:
        cp.stop()


@pytest.fixture
def as_weft(api: ControlPlane) -> Path:
    """A kubeconfig of weft's service account itself, as the DaemonSet's pod has it."""
    token = api.kubectl("create", "token", "weft", "-n", "weft-system", "--duration", "10m").stdout.strip()
    path = api.workdir / "weft-sa.kubeconfig"
    doc = json.loads(api.kubeconfig("admin").read_text())
    doc["users"] = [{"name": "weft", "user": {"token": token}}]
    doc["contexts"][0]["context"]["user"] = "weft"
    path.write_text(json.dumps(doc))
    return path


def _credentials(as_weft: Path, out: Path, *extra: str, wait: bool = True) -> subprocess.Popen | None:
    argv = [sys.executable, "-m", "shim", "kube-credentials", "--kubeconfig", str(as_weft),
            "--namespace", "weft-system", "--service-account", "weft", "--dir", str(out), "--lifetime", "600",
            *extra]
    if not wait:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return None


@contextlib.contextmanager
def _discovery(kubeconfig: Path) -> Iterator[EndpointSliceDiscovery]:
    found = EndpointSliceDiscovery("weft-system", "weft-mesh", client_factory=access.resolve(kubeconfig).client)
    try:
        yield found
    finally:
        found.close()


def _peers(kubeconfig: Path) -> list[Peer]:
    with _discovery(kubeconfig) as found:
        return found.list()


def test_the_keeper_as_weft_s_own_account_writes_a_kubeconfig_the_agent_finds_its_peers_with(
        api: ControlPlane, as_weft: Path, tmp_path: Path) -> None:
    out = tmp_path / "api"
    _credentials(as_weft, out, "--once")
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {"kubeconfig": "0o600",
                                                                             "token": "0o600"}
    assert oct(out.stat().st_mode & 0o777) == "0o700"
    assert _peers(out / "kubeconfig") == [Peer("cpu-1", "10.9.0.2", 7443, True)]
    # Least privilege (nodeimage/manifests/rbac.yaml): the token reads pods and PodDisruptionBudgets, never
    # Secrets, and writes either only in weft-system.
    client = access.resolve(out / "kubeconfig").client()
    try:
        with pytest.raises(lightkube.ApiError) as refused:
            list(client.list(Secret, namespace="default"))
        assert refused.value.status.code == 403
        assert list(client.list(PodDisruptionBudget, namespace="default")) == []
        with pytest.raises(lightkube.ApiError) as refused:
            client.create(Pod(metadata=ObjectMeta(name="not-weft-s", namespace="default"),
                              spec=PodSpec(containers=[Container(name="c", image="busybox")])))
        assert refused.value.status.code == 403
        with pytest.raises(lightkube.ApiError) as refused:
            client.create(PodDisruptionBudget.from_dict({
                "metadata": {"name": "not-weft-s", "namespace": "default"},
                "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "x"}}}}))
    finally:
        client.close()
    assert refused.value.status.code == 403


def test_a_renewed_token_is_picked_up_by_a_client_that_was_already_running(
        api: ControlPlane, as_weft: Path, tmp_path: Path) -> None:
    out = tmp_path / "api"
    _credentials(as_weft, out, "--once")
    with _discovery(out / "kubeconfig") as found:
        assert found.list()  # the client is made, and holds the first token
        # Every token of the account stops working (as an expired one would): the account is made anew.
        api.kubectl("delete", "serviceaccount", "weft", "-n", "weft-system")
        api.kubectl("apply", "-f", str(MANIFESTS / "serviceaccount.yaml"))

        def refused() -> bool:  # the API server caches a token's verdict for a few seconds
            try:
                found.list()
            except DiscoveryError as exc:
                assert "401" in exc.message or "Unauthorized" in exc.message, exc.message
                return True
            return False

        wait_for(refused, timeout=30, what="the old token refused")
        fresh = api.kubectl("create", "token", "weft", "-n", "weft-system", "--duration", "10m").stdout.strip()
        doc = json.loads(as_weft.read_text())
        doc["users"][0]["user"]["token"] = fresh
        as_weft.write_text(json.dumps(doc))
        _credentials(as_weft, out, "--once")  # the keeper's next renewal
        assert found.list() == [Peer("cpu-1", "10.9.0.2", 7443, True)]  # same client, new token, no restart


def test_the_keeper_renews_on_its_own_and_keeps_the_kubeconfig(api: ControlPlane, as_weft: Path,
                                                               tmp_path: Path) -> None:
    out = tmp_path / "api"
    proc = _credentials(as_weft, out, "--refresh", "0.005", wait=False)  # renew every 3 s of a 600 s token
    assert proc is not None
    try:
        first = wait_for(lambda: (out / "token").is_file() and (out / "token").read_text(), timeout=30,
                         what="the first token")
        kubeconfig = (out / "kubeconfig").read_text()
        wait_for(lambda: (out / "token").read_text() != first, timeout=30, what="a renewed token")
        assert (out / "kubeconfig").read_text() == kubeconfig
        assert _peers(out / "kubeconfig")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err  # SIGTERM ends it cleanly
    renewed = [json.loads(line) for line in err.splitlines() if '"kube.credentials.renewed"' in line]
    assert len(renewed) >= 2 and all(590 <= e["expires_in_s"] <= 600 for e in renewed)


def test_the_keeper_refuses_a_lifetime_the_api_server_would_refuse(as_weft: Path, tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "shim", "kube-credentials", "--kubeconfig", str(as_weft),
                          "--namespace", "weft-system", "--service-account", "weft", "--dir", str(tmp_path),
                          "--lifetime", "60", "--once"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--lifetime 60" in res.stderr and not (tmp_path / "token").exists()


@pytest.fixture
def mesh_tls(tmp_path: Path) -> Path:
    out = tmp_path / "mesh"
    subprocess.run([sys.executable, "-m", "shim", "mesh-certs", "--out", str(out), "--nodes", "gpu-1,cpu-1"],
                   check=True, capture_output=True, timeout=60)
    return out


def _agent_args(tls: Path, *extra: str) -> list[str]:
    return ["--node-name", "gpu-1", "--role", "gpu", "--mesh-address", f"127.0.0.1:{free_port()}",
            "--peers", "kubernetes", "--tls-dir", str(tls), *extra]


def test_an_agent_with_the_kept_kubeconfig_finds_its_peers_through_the_api(
        api: ControlPlane, as_weft: Path, containerd: Containerd, mesh_tls: Path, tmp_path: Path) -> None:
    out = tmp_path / "api"
    _credentials(as_weft, out, "--once")
    with AgentProcess(containerd, tmp_path / "agent",
                      extra_args=_agent_args(mesh_tls, "--kubeconfig", str(out / "kubeconfig"))) as agent:
        wait_for(lambda: any(e.get("event") == "mesh.peers" and e.get("peers") == ["cpu-1"]
                             for e in agent.events()), timeout=30, what="cpu-1 found through the API")
        (line,) = [e for e in agent.events() if e.get("event") == "kube.access"]
        assert line["source"] == "kubeconfig" and str(out / "kubeconfig") in line["detail"]


def test_an_agent_started_before_its_kubeconfig_is_written_uses_it_once_it_is(
        api: ControlPlane, as_weft: Path, containerd: Containerd, mesh_tls: Path, tmp_path: Path) -> None:
    out = tmp_path / "api"
    with AgentProcess(containerd, tmp_path / "agent",
                      extra_args=_agent_args(mesh_tls, "--kubeconfig", str(out / "kubeconfig"))) as agent:
        wait_for(lambda: any(e.get("event") == "mesh.discovery.waiting" for e in agent.events()), timeout=30,
                 what="discovery waiting for its credentials")
        _credentials(as_weft, out, "--once")  # the DaemonSet's keeper, just after the installer
        wait_for(lambda: any(e.get("event") == "mesh.peers" and e.get("peers") == ["cpu-1"]
                             for e in agent.events()), timeout=60, what="cpu-1 found once the kubeconfig exists")


def test_without_any_api_configuration_the_agent_runs_alone_and_says_so(
        containerd: Containerd, mesh_tls: Path, tmp_path: Path) -> None:
    assert not access.resolve(None).available  # this machine is no pod: no in-cluster configuration either
    with AgentProcess(containerd, tmp_path / "agent", extra_args=_agent_args(mesh_tls)) as agent:
        with agent.channel() as ch:  # it serves kubelet all the same
            assert cri_grpc.RuntimeServiceStub(ch).Version(cri.VersionRequest()).runtime_name == "containerd"
        events = wait_for(lambda: (ev := agent.events()) and any(e.get("event") == "mesh.no_api" for e in ev)
                          and ev, timeout=20, what="the agent saying it has no API")
        (line,) = [e for e in events if e.get("event") == "kube.access"]
        assert line["source"] == "none"


def test_a_kubeconfig_that_is_there_but_broken_stops_the_agent_with_a_line_naming_it(
        containerd: Containerd, mesh_tls: Path, tmp_path: Path) -> None:
    bad = tmp_path / "kubeconfig"
    bad.write_text("clusters: [oops")
    res = subprocess.run([sys.executable, "-m", "shim", "agent", "--socket", str(tmp_path / "w.sock"),
                          "--containerd-socket", str(containerd.socket), "--state-dir", str(tmp_path / "state"),
                          "--metrics-address", "", *_agent_args(mesh_tls, "--kubeconfig", str(bad))],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and f"kubernetes.kubeconfig: cannot read {bad}" in res.stderr
