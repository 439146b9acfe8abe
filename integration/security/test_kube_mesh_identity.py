"""Mesh certificates through the Kubernetes CSR API, against a real kube-apiserver, and the attacks on them.

The signer's manifests (its ServiceAccount and RBAC) are applied as they
ship; ``weft mesh-signer`` runs as that account, with a CA only it reads and
a short maximum lifetime, so that renewals and expiry happen within a test.
Nodes ask with the API server's own node identities (``system:node:<name>``
in ``system:nodes``, as a kubelet's credentials are), through the Node
authorizer. What is shown: a node gets a certificate for itself and the mesh
accepts it; a node asking for another's name is refused with the reason; a
node's certificate is rotated under a running mesh server and client, and
new connections present the new one and the clients made before still get answers (and
two real ``weft agent`` processes stay peers across renewals and a restart); a
node removed from the cluster gets no new certificate and, once its last one
has expired, no connection; the signer's account approves for weft.io/mesh
only, and a node approves nothing.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import lightkube
import pytest
from cryptography import x509
from lightkube.config.kubeconfig import KubeConfig
from lightkube.models.certificates_v1 import CertificateSigningRequestCondition, CertificateSigningRequestSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.certificates_v1 import CertificateSigningRequest, CertificateSigningRequestApproval

from harness.controlplane import ControlPlane
from shim._pb import mesh_pb2 as pb
from shim.core.meshcsr import Reason
from shim.localfabric.agent import AgentProcess, free_port
from shim.localfabric.containerd import Containerd
from shim.localfabric.waiting import wait_for
from shim.mesh import csr
from shim.mesh.capacity import MIB, CapacityProbe, FixedHost
from shim.mesh.certs import cert_nodes
from shim.mesh.client import PeerClient, PeerUnavailable
from shim.mesh.enroll import CertificateDenied, Enroller
from shim.mesh.identity import PeerPolicy
from shim.mesh.server import MeshServer
from shim.mesh.tlsreload import NodeTls

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "nodeimage" / "manifests"
NODES = ["node-a", "node-b", "node-c", "node-d"]
LIFETIME_S = 20  # the signer's maximum here: a renewal every 10 s at share 0.5
GI = 2**30


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    cp = ControlPlane(tmp_path_factory.mktemp("api"), "127.0.0.1", NODES)
    try:
        cp.start()
        cp.kubectl("apply", "-f", str(MANIFESTS / "namespace.yaml"))
        cp.kubectl("apply", "-f", str(MANIFESTS / "signer.yaml"))
        for node in NODES:
            cp.kubectl("apply", "-f", "-", stdin=json.dumps(
                {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}))
        yield cp
    finally:
        cp.stop()


def _kubeconfig_with_token(api: ControlPlane, name: str, token: str) -> Path:
    path = api.workdir / f"{name}.kubeconfig"
    doc = json.loads(api.kubeconfig("admin").read_text())
    doc["users"] = [{"name": name, "user": {"token": token}}]
    doc["contexts"][0]["context"]["user"] = name
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture(scope="module")
def signer(api: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """``weft mesh-signer`` as its own service account: (the CA directory, its kubeconfig)."""
    ca_dir = tmp_path_factory.mktemp("ca")
    subprocess.run([sys.executable, "-m", "shim", "mesh-signer", "--init-ca", "--ca-dir", str(ca_dir)], check=True,
                   capture_output=True)
    token = api.kubectl("create", "token", "weft-mesh-signer", "-n", "weft-system", "--duration", "1h").stdout
    kubeconfig = _kubeconfig_with_token(api, "signer", token.strip())
    proc = _start_signer(ca_dir, kubeconfig, api.workdir / "signer.log")
    _SIGNER["proc"] = proc
    try:
        yield ca_dir, kubeconfig
    finally:
        proc.terminate()
        proc.wait(10)
        _SIGNER.clear()


_SIGNER: dict[str, subprocess.Popen] = {}  # the module's signer process, for the test that hangs it


def _start_signer(ca_dir: Path, kubeconfig: Path, log_path: Path) -> subprocess.Popen:
    with log_path.open("w") as log:
        return subprocess.Popen([sys.executable, "-m", "shim", "mesh-signer", "--ca-dir", str(ca_dir),
                                 "--kubeconfig", str(kubeconfig), "--max-lifetime", str(LIFETIME_S)],
                                stdout=log, stderr=log)


def _signer_events(*logs: Path) -> list[dict]:
    return [json.loads(line) for p in logs for line in p.read_text().splitlines() if line.startswith("{")]


_CLIENTS: dict[str, lightkube.Client] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    for client in _CLIENTS.values():
        client.close()
    _CLIENTS.clear()


def _as(api: ControlPlane, who: str) -> lightkube.Client:
    """One client per identity for the module (closed at its end)."""
    if who not in _CLIENTS:
        _CLIENTS[who] = lightkube.Client(config=KubeConfig.from_file(api.kubeconfig(who)))
    return _CLIENTS[who]


def _enroller(api: ControlPlane, who: str, out: Path, node: str | None = None) -> Enroller:
    return Enroller(_as(api, who), out, node or who, share=0.5, retry_s=1.0, wait_s=30.0, poll_s=0.2)


def _serve(node: str, tls: NodeTls, known: set[str], port: int = 0) -> MeshServer:
    probe = CapacityProbe("cpu", reserve_cpu=0.5, reserve_memory=512 * MIB,
                          host=FixedHost(cores=4, memory_total=8 * GI, memory_available=6 * GI, busy=0.25))
    server = MeshServer(node, f"127.0.0.1:{port}", tls, PeerPolicy(known), probe)
    server.start()
    return server


def _hello(client: PeerClient, node: str) -> str:
    return client.hello(pb.PeerState(node=node, role="gpu", healthy=True)).node


def _answers(client: PeerClient, node: str) -> bool:
    try:
        return _hello(client, node) != ""
    except PeerUnavailable:
        return False


def _served_serial(port: int, client_dir: Path, client_node: str) -> int:
    """The serial of the certificate the server presents to a new connection."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_cert_chain(client_dir / f"{client_node}.crt", client_dir / f"{client_node}.key")
    ctx.load_verify_locations(client_dir / "ca.crt")
    ctx.check_hostname = False
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock, \
            ctx.wrap_socket(sock) as tls:
        der = tls.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der).serial_number


def _expired(not_after: dt.datetime) -> bool:
    """Past a certificate's notAfter as TLS sees it: it compares whole seconds, so it is still valid within the
    second of its notAfter."""
    return dt.datetime.now(dt.UTC) > not_after + dt.timedelta(seconds=1)


def _serial(path: Path) -> int:
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


def _conditions(api: ControlPlane, node: str) -> list[CertificateSigningRequestCondition]:
    csrs = [c for c in _as(api, "admin").list(CertificateSigningRequest)
            if (c.spec.username or "") == f"system:node:{node}"]
    return [cond for c in csrs for cond in (c.status.conditions or [] if c.status else [])]


def test_a_node_gets_a_certificate_for_its_own_key_and_the_mesh_accepts_it(api, signer, tmp_path):
    ca_dir, _ = signer
    for node in ("node-a", "node-b"):
        _enroller(api, node, tmp_path / node).run(threading.Event(), once=True)
    a = tmp_path / "node-a"
    assert (a / "node-a.key").stat().st_mode & 0o777 == 0o600
    assert (a / "ca.crt").read_bytes() == (ca_dir / "ca.crt").read_bytes()
    cert = x509.load_pem_x509_certificate((a / "node-a.crt").read_bytes())
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate((ca_dir / "ca.crt").read_bytes()))
    assert cert_nodes((a / "node-a.crt").read_bytes()) == ["node-a"]
    assert cert.public_key() == csr.load_key((a / "node-a.key").read_bytes()).public_key()
    assert [(c.type, c.reason) for c in _conditions(api, "node-a")] == [("Approved", str(Reason.APPROVED))]

    server = _serve("node-a", NodeTls(a, "node-a"), {"node-b"})
    try:
        with PeerClient("node-a", f"127.0.0.1:{server.port}", NodeTls(tmp_path / "node-b", "node-b")) as client:
            assert _hello(client, "node-b") == "node-a"
    finally:
        server.stop()


def test_a_node_asking_for_another_node_s_name_is_refused_with_the_reason(api, signer, tmp_path):
    # node-b's own credentials, asking for node-a's certificate.
    with pytest.raises(CertificateDenied) as refused:
        _enroller(api, "node-b", tmp_path / "b", node="node-a").run(threading.Event(), once=True)
    assert refused.value.reason == str(Reason.OTHER_NODE)
    assert "node 'node-b' asked for a certificate naming ['node-a']" in refused.value.message
    assert not (tmp_path / "b" / "node-a.crt").exists()


def test_a_removed_node_cannot_renew_and_once_its_certificate_expires_cannot_join(api, signer, tmp_path):
    b = tmp_path / "node-b"
    _enroller(api, "node-b", b).run(threading.Event(), once=True)
    d = tmp_path / "node-d"
    enroller = _enroller(api, "node-d", d)
    enroller.run(threading.Event(), once=True)
    not_after = x509.load_pem_x509_certificate((d / "node-d.crt").read_bytes()).not_valid_after_utc
    server = _serve("node-b", NodeTls(b, "node-b"), {"node-d"})  # still a listed peer: TLS alone turns it away
    try:
        with PeerClient("node-b", f"127.0.0.1:{server.port}", NodeTls(d, "node-d")) as client:
            assert _hello(client, "node-d") == "node-b"

        api.kubectl("delete", "node", "node-d")
        with pytest.raises(CertificateDenied) as refused:
            enroller.renew()
        assert refused.value.reason == str(Reason.NOT_IN_CLUSTER)

        wait_for(lambda: _expired(not_after), timeout=LIFETIME_S + 10, what="node-d's last certificate to expire")
        with PeerClient("node-b", f"127.0.0.1:{server.port}", NodeTls(d, "node-d"), hello_timeout=3) as client, \
                pytest.raises(PeerUnavailable):
            _hello(client, "node-d")
    finally:
        server.stop()


def test_rotation_under_a_running_mesh_new_connections_present_the_new_certificate(api, signer, tmp_path):
    a, c = tmp_path / "node-a", tmp_path / "node-c"
    keepers = [_enroller(api, "node-a", a), _enroller(api, "node-c", c)]
    for keeper in keepers:
        keeper.run(threading.Event(), once=True)
    first = _serial(a / "node-a.crt")
    first_not_after = x509.load_pem_x509_certificate((a / "node-a.crt").read_bytes()).not_valid_after_utc
    tls_a = NodeTls(a, "node-a", check_s=0.2)
    server_a = _serve("node-a", tls_a, {"node-c"})
    server_c = _serve("node-c", NodeTls(c, "node-c"), {"node-a"})
    stop = threading.Event()
    threads = [threading.Thread(target=k.run, args=(stop,), daemon=True) for k in keepers]
    for thread in threads:
        thread.start()
    try:
        assert _served_serial(server_a.port, c, "node-c") == first
        old = PeerClient("node-a", f"127.0.0.1:{server_a.port}", NodeTls(c, "node-c"))
        assert _hello(old, "node-c") == "node-a"
        early = PeerClient("node-c", f"127.0.0.1:{server_c.port}", tls_a)  # node-a's, made with its first cert
        assert _hello(early, "node-a") == "node-c"

        wait_for(lambda: _serial(a / "node-a.crt") != first, timeout=LIFETIME_S * 2, what="a renewed certificate")
        wait_for(lambda: _served_serial(server_a.port, c, "node-c") != first, timeout=10,
                 what="the server presenting the renewed certificate to a new connection")
        wait_for(lambda: _expired(first_not_after), timeout=LIFETIME_S + 10, what="the first certificate to expire")
        # The mesh was never restarted: the client made before still gets answers, a new one is accepted, and
        # node-a's own new connections present a certificate that is valid now (an expired one is refused).
        assert _hello(old, "node-c") == "node-a"
        with PeerClient("node-a", f"127.0.0.1:{server_a.port}", NodeTls(c, "node-c")) as new:
            assert _hello(new, "node-c") == "node-a"
        with PeerClient("node-c", f"127.0.0.1:{server_c.port}", tls_a) as out:
            assert _hello(out, "node-a") == "node-c"
        # node-c restarts on the same port: node-a's client from before must connect again, and its first
        # certificate has expired, so it gets in only by presenting the renewed one.
        port = server_c.port
        server_c.stop()
        server_c = _serve("node-c", NodeTls(c, "node-c"), {"node-a"}, port=port)
        assert wait_for(lambda: _answers(early, "node-a"), timeout=15, what="node-a's early client reconnecting")
        early.close()
        assert tls_a.generation >= 1
        old.close()
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        server_a.stop()
        server_c.stop()


def test_weft_agents_keep_their_mesh_across_renewals_and_a_restarted_peer_takes_the_new_certificate(
        api, signer, containerd: Containerd, tmp_path):
    """Two real agents whose tls_dir its node's keeper renews every 10 s: they stay peers past the first
    certificates' expiry, and one restarted then is taken back by the other (whose connection to it is new)."""
    nodes = ("node-a", "node-b")
    keepers = {n: _enroller(api, n, tmp_path / n) for n in nodes}
    for keeper in keepers.values():
        keeper.run(threading.Event(), once=True)
    first_not_after = max(x509.load_pem_x509_certificate((tmp_path / n / f"{n}.crt").read_bytes())
                          .not_valid_after_utc for n in nodes)
    ports = {n: free_port() for n in nodes}
    peers = tmp_path / "peers.toml"
    peers.write_text("".join(f'[[peer]]\nname = "{n}"\naddress = "127.0.0.1:{ports[n]}"\nrole = "cpu"\n\n'
                             for n in nodes))
    conf = tmp_path / "weft.toml"
    conf.write_text("[mesh]\nhello_interval = 0.3\n")
    agents = {n: AgentProcess(containerd, tmp_path / f"agent-{n}", name=n, extra_args=[
        "--config", str(conf), "--node-name", n, "--role", "cpu", "--mesh-address", f"127.0.0.1:{ports[n]}",
        "--peers", str(peers), "--tls-dir", str(tmp_path / n)]) for n in nodes}
    stop = threading.Event()
    threads = [threading.Thread(target=k.run, args=(stop,), daemon=True) for k in keepers.values()]
    try:
        for agent in agents.values():
            agent.start()
        for thread in threads:
            thread.start()

        def healthy(agent: AgentProcess) -> bool:
            out = subprocess.run([sys.executable, "-m", "shim", "status", "--json", "--socket", str(agent.socket)],
                                 capture_output=True, text=True, check=True)
            return [p["healthy"] for p in json.loads(out.stdout).get("peers", [])] == [True]

        wait_for(lambda: all(healthy(a) for a in agents.values()), timeout=20, what="the two agents peers")
        wait_for(lambda: _expired(first_not_after), timeout=LIFETIME_S + 10, what="the first certificates to expire")
        wait_for(lambda: all(healthy(a) for a in agents.values()), timeout=10, what="still peers")
        assert all(any(e.get("event") == "mesh.tls.reloaded" for e in a.events()) for a in agents.values())
        agents["node-b"].stop(sig=9)
        agents["node-b"].start()
        wait_for(lambda: all(healthy(a) for a in agents.values()), timeout=20,
                 what="node-b taken back after its restart, on renewed certificates")
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        for agent in agents.values():
            agent.stop()


def test_the_signer_approves_for_weft_io_mesh_only_and_a_node_approves_nothing(api, signer, tmp_path):
    _, signer_kubeconfig = signer
    key = csr.new_key()
    other = CertificateSigningRequest(
        metadata=ObjectMeta(name="not-weft"),
        spec=CertificateSigningRequestSpec(request=base64.b64encode(csr.request_pem(key, "node-a")).decode(),
                                           signerName="example.com/other", usages=["client auth"]))
    got = _as(api, "node-a").create(other)
    approved = CertificateSigningRequestCondition(type="Approved", status="True", reason="Test", message="test")
    doc = got.to_dict()
    doc["status"] = {"conditions": [approved.to_dict()]}
    as_signer = _CLIENTS["signer"] = lightkube.Client(config=KubeConfig.from_file(signer_kubeconfig))
    for client in (as_signer, _as(api, "node-a")):
        with pytest.raises(lightkube.ApiError) as refused:
            client.replace(CertificateSigningRequestApproval.from_dict(doc))
        assert refused.value.status.code == 403


def test_two_signers_issue_each_certificate_once_and_a_hung_one_holds_up_no_renewal(api, signer, tmp_path):
    """The Deployment runs two signers with no leader: each request is signed by one of them, and a node still
    gets its certificate while the other hangs (as on a node that stopped answering)."""
    ca_dir, kubeconfig = signer
    before = {c.metadata.name for c in _as(api, "admin").list(CertificateSigningRequest)}
    second_log = api.workdir / "signer-2.log"
    second = _start_signer(ca_dir, kubeconfig, second_log)
    first = _SIGNER["proc"]
    try:
        os.kill(first.pid, signal.SIGSTOP)
        try:
            _enroller(api, "node-c", tmp_path / "while-hung").run(threading.Event(), once=True)
        finally:
            os.kill(first.pid, signal.SIGCONT)
        assert cert_nodes((tmp_path / "while-hung" / "node-c.crt").read_bytes()) == ["node-c"]
        # Both answering at once, request after request.
        for i in range(6):
            node = ("node-a", "node-c")[i % 2]
            _enroller(api, node, tmp_path / f"both-{i}").run(threading.Event(), once=True)
            assert cert_nodes((tmp_path / f"both-{i}" / f"{node}.crt").read_bytes()) == [node]
        ours = {c.metadata.name for c in _as(api, "admin").list(CertificateSigningRequest)} - before
        assert len(ours) == 7
    finally:
        second.terminate()
        second.wait(10)
    # The hung signer, resumed, acted on what it had missed: what it tried the API refused (409) and it dropped.
    # Nothing failed, and each request was signed once, by one of the two.
    events = [e for e in _signer_events(api.workdir / "signer.log", second_log) if e.get("csr") in ours]
    assert not [e for e in events if e["event"] == "mesh.signer.failed"], events
    signed = sorted(e["csr"] for e in events if e["event"] == "mesh.signer.signed")
    assert signed == sorted(ours), events

