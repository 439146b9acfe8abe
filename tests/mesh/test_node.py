"""The mesh node in a large fleet: bounded Hellos, on-demand refresh, lazy and released connections.

The node is real (its TLS from ``shim.mesh.certs``, a static peers file);
its peers are fakes in place of ``PeerClient`` that answer Hello with the
room each is given, so a fleet of hundreds costs nothing. What is checked is
whom the node talks to and what placement reads, never how fast.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509

from shim._pb import mesh_pb2 as pb
from shim.core.reroute import Resources
from shim.errors import WeftError
from shim.mesh import node as node_module
from shim.mesh.certs import write_mesh_certs
from shim.mesh.client import PeerUnavailable
from shim.mesh.node import MeshNode
from shim.metrics import Metrics

GI = 1 << 30
ORIGIN = "gpu-1"


class Fleet:
    """What each fake peer answers, and whom the node asked."""

    def __init__(self) -> None:
        self.free: dict[str, tuple[float, int]] = {}
        self.down: set[str] = set()
        self.hellos: list[str] = []
        self.clients: dict[str, FakeClient] = {}


class FakeClient:
    fleet: Fleet

    def __init__(self, node: str, address: str, tls, **_: object) -> None:
        self.node, self.address = node, address
        self.on_admit = None
        self.connected = False
        self.busy = False
        self.released = 0
        self.fleet.clients[node] = self

    def hello(self, mine: pb.PeerState) -> pb.PeerState:
        self.fleet.hellos.append(self.node)
        self.connected = True
        if self.node in self.fleet.down:
            raise PeerUnavailable(f"peer {self.node} did not answer", node=self.node)
        cpu, mem = self.fleet.free.get(self.node, (0.0, 0))
        return pb.PeerState(node=self.node, role="cpu", healthy=True,
                            free=pb.Resources(cpu_cores=cpu, memory_bytes=mem))

    def admit(self, request: pb.AdmitRequest) -> pb.AdmitResponse:
        cpu, mem = self.fleet.free.get(self.node, (0.0, 0))
        ok = request.limits.cpu_cores <= cpu and request.limits.memory_bytes <= mem
        answer = pb.AdmitResponse(admitted=ok, reason="admitted" if ok else "insufficient-cpu",
                                  free_after=pb.Resources(cpu_cores=cpu, memory_bytes=mem))
        if self.on_admit is not None:
            self.on_admit(self.node, request, answer)
        return answer

    def release(self, idle_s: float) -> bool:
        if not self.connected or self.busy:
            return False
        self.connected = False
        self.released += 1
        return True

    def close(self) -> None:
        self.connected = False


def _node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hosts: int, *, role: str = "gpu") -> tuple[MeshNode, Fleet]:
    fleet = Fleet()
    FakeClient.fleet = fleet
    monkeypatch.setattr(node_module, "PeerClient", FakeClient)
    write_mesh_certs(tmp_path / "certs", [ORIGIN])
    names = [f"cpu-{i:04d}" for i in range(hosts)]
    peers = tmp_path / "peers.toml"
    peers.write_text("".join(f'[[peer]]\nname = "{n}"\naddress = "127.0.0.1:{10000 + i}"\nrole = "cpu"\n\n'
                             for i, n in enumerate(names)))
    mesh = MeshNode(node=ORIGIN, role=role, address="127.0.0.1:0", peers=str(peers), tls_dir=str(tmp_path / "certs"),
                    hello_interval=2.0, namespace="", service="", metrics=Metrics())
    mesh._set_peers(mesh.discovery.list())
    return mesh, fleet


def test_a_small_fleet_is_said_hello_to_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mesh, fleet = _node(tmp_path, monkeypatch, 5, role="cpu")
    mesh.hello_all()
    assert sorted(fleet.hellos) == [f"cpu-{i:04d}" for i in range(5)]
    assert [v.node for v in mesh.views()] == [f"cpu-{i:04d}" for i in range(5)]
    assert len(mesh.hosts()) == 5


def test_an_origin_of_a_large_fleet_says_hello_to_a_bounded_set(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    mesh, fleet = _node(tmp_path, monkeypatch, 500)
    fleet.free = {f"cpu-{i:04d}": (2.0, 4 * GI) for i in range(500)}
    counts = []
    for _ in range(10):
        fleet.hellos.clear()
        mesh.hello_all()
        counts.append(len(fleet.hellos))
    # Candidates every few rounds, one probe every round.
    assert max(counts) <= mesh.limit + 1 and min(counts) == 1
    assert len({v.node for v in mesh.views() if v.healthy}) >= mesh.limit
    assert mesh.hosts() == []  # no business with any yet: its Watch goes nowhere
    # Probes that did not become candidates let their connection go; at most the tracked set stays connected.
    assert sum(c.connected for c in fleet.clients.values()) <= mesh.limit + 1
    assert len(fleet.clients) < 500  # clients are made on first use only
    mesh.client("cpu-0300")
    assert mesh.hosts() == ["cpu-0300"]


def test_a_host_only_node_says_hello_only_to_its_business(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mesh, fleet = _node(tmp_path, monkeypatch, 100, role="cpu")
    mesh.hello_all()
    assert fleet.hellos == []
    assert mesh.client("cpu-0042") is not None  # a call to it: business for a while
    mesh.hello_all()
    assert fleet.hellos == ["cpu-0042"]
    assert mesh.client("nobody") is None


def test_placement_finds_room_beyond_the_candidates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mesh, fleet = _node(tmp_path, monkeypatch, 300)
    fleet.free = {f"cpu-{i:04d}": (0.5, GI) for i in range(300)}
    fleet.free["cpu-0250"] = (8.0, 16 * GI)  # the only host with room for a big container, far in the rotation
    mesh.hello_all()
    assert "cpu-0250" not in {v.node for v in mesh.views(Resources(0.25, GI // 2))}  # the candidates do
    views = {v.node: v for v in mesh.views(Resources(4.0, 8 * GI))}
    assert views["cpu-0250"].free.cpu_cores == 8.0
    for _ in range(5):
        mesh.hello_all()
    assert "cpu-0250" in {v.node for v in mesh.views()} and "cpu-0250" in fleet.hellos[-mesh.limit - 1:]


def test_an_admit_refusal_is_learnt_and_the_next_placement_refreshes(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    mesh, fleet = _node(tmp_path, monkeypatch, 100)
    fleet.free = {f"cpu-{i:04d}": (1.0, 2 * GI) for i in range(100)}
    mesh.hello_all()
    candidates = [v.node for v in mesh.views()]
    for n in candidates:  # the candidates filled up since their last Hello
        fleet.free[n] = (0.0, 0)
    ask = pb.AdmitRequest(origin_node=ORIGIN, key="k", limits=pb.Resources(cpu_cores=0.5, memory_bytes=GI))
    assert not any(mesh.client(n).admit(ask).admitted for n in candidates)
    fresh = [v.node for v in mesh.views() if v.free.cpu_cores >= 0.5]  # no need given: the last Admit's
    assert fresh and not set(fresh) & set(candidates)


def test_no_room_anywhere_is_asked_once_not_on_every_placement(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    mesh, fleet = _node(tmp_path, monkeypatch, 40)
    mesh.hello_all()
    said = set(fleet.hellos)
    fleet.hellos.clear()
    mesh.views(Resources(1.0, GI))
    asked = len(fleet.hellos)
    assert sorted(fleet.hellos) == sorted(set(fleet.clients) - said) and asked == 40 - len(said)  # every cold host
    mesh.views(Resources(1.0, GI))
    assert len(fleet.hellos) == asked  # held: no room was found a moment ago


def test_a_candidate_that_stops_answering_is_noticed_and_replaced(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    mesh, fleet = _node(tmp_path, monkeypatch, 100)
    fleet.free = {f"cpu-{i:04d}": (1.0, 2 * GI) for i in range(100)}
    mesh.hello_all()
    gone = sorted(mesh._candidates)[0]
    fleet.down.add(gone)
    for _ in range(5):  # the candidates' next Hello
        mesh.hello_all()
    peer = next(p for p in mesh.status() if p["node"] == gone)
    assert not peer["healthy"] and peer["error"]
    assert gone not in mesh._candidates and len(mesh._candidates) == mesh.limit
    assert gone not in {v.node for v in mesh.views() if v.healthy}


def test_a_busy_connection_is_kept_and_an_idle_one_let_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mesh, _ = _node(tmp_path, monkeypatch, 100, role="cpu")
    client = mesh.client("cpu-0007")
    client.hello(pb.PeerState())
    client.busy = True  # a log stream, say
    mesh._used.clear()  # long ago
    mesh.hello_all()
    assert client.connected and "cpu-0007" in mesh.business()
    client.busy = False
    mesh.hello_all()
    assert not client.connected and client.released == 1


def test_a_peer_that_leaves_closes_its_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mesh, _ = _node(tmp_path, monkeypatch, 30)
    client = mesh.client("cpu-0003")
    client.connected = True
    mesh._set_peers([p for p in mesh.discovery.list() if p.node != "cpu-0003"])
    assert not client.connected and mesh.client("cpu-0003") is None
    with pytest.raises(WeftError):
        raise PeerUnavailable("x", node="cpu-0003")


def test_the_certificate_in_use_has_its_expiry_in_the_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mesh, _ = _node(tmp_path, monkeypatch, 1)
    cert = x509.load_pem_x509_certificate((tmp_path / "certs" / f"{ORIGIN}.crt").read_bytes())
    assert mesh.metrics.registry.get_sample_value("weft_mesh_cert_expiry_timestamp_seconds") == (
        cert.not_valid_after_utc.timestamp())
    # A renewed certificate (the keeper writes it in place) shows once the agent picks it up.
    write_mesh_certs(tmp_path / "renewed", [ORIGIN], valid_days=2)
    for name in ("ca.crt", f"{ORIGIN}.crt", f"{ORIGIN}.key"):
        (tmp_path / "certs" / name).write_bytes((tmp_path / "renewed" / name).read_bytes())
    mesh.tls._checked = float("-inf")  # past the reload check's interval
    renewed = x509.load_pem_x509_certificate((tmp_path / "renewed" / f"{ORIGIN}.crt").read_bytes())
    assert mesh.metrics.registry.get_sample_value("weft_mesh_cert_expiry_timestamp_seconds") == (
        renewed.not_valid_after_utc.timestamp())
    assert renewed.not_valid_after_utc != cert.not_valid_after_utc


def test_a_host_that_pushes_its_state_on_the_watch_is_not_said_hello_to_while_it_is_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mesh, fleet = _node(tmp_path, monkeypatch, 3)
    mesh.pushed("cpu-0001", pb.PeerState(node="cpu-0001", role="cpu", healthy=True,
                                         free=pb.Resources(cpu_cores=3.0, memory_bytes=GI)))
    mesh.hello_all()
    assert sorted(fleet.hellos) == ["cpu-0000", "cpu-0002"]
    pushed = {v.node: v for v in mesh.views()}["cpu-0001"]
    assert pushed.healthy and pushed.free == Resources(3.0, GI) and pushed.sampled_age_s < 1.0
    assert mesh.silent_for("cpu-0001") < 1.0  # its state is contact, as a Hello answer is
    mesh.unwatched("cpu-0001")  # the Watch ended: said Hello to again, as any peer
    fleet.hellos.clear()
    mesh.hello_all()
    assert sorted(fleet.hellos) == ["cpu-0000", "cpu-0001", "cpu-0002"]
    mesh.pushed("nobody", pb.PeerState(node="nobody", role="cpu", healthy=True))  # not a peer: nothing kept
    assert "nobody" not in {v.node for v in mesh.views()}
