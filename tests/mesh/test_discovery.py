"""Peer discovery: the static config list, and EndpointSlices as the Kubernetes API serves them.

The fixtures under ``fixtures/`` are API responses for the weft DaemonSet's
headless Service ``weft-system/weft-mesh``, written to the
``discovery.k8s.io/v1`` schema: a list (``EndpointSliceList``) and a watch
stream (one JSON event per line, as the API sends it) that follows it.

``FakeKube`` stands in for ``lightkube.Client`` with the same keywords and
return types (lightkube model objects, a list iterable carrying
``resourceVersion``); one test drives the real ``lightkube.Client`` through an
``httpx2.MockTransport`` to check the requests weft makes.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx2
import lightkube
import pytest
from lightkube.config.kubeconfig import KubeConfig
from lightkube.config.models import Cluster, User
from lightkube.models.meta_v1 import Status
from lightkube.resources.discovery_v1 import EndpointSlice
from lightkube.types import on_error_raise
from structlog.testing import capture_logs

from shim.errors import ConfigError
from shim.mesh.discovery import (
    DiscoveryError,
    DiscoveryUnavailable,
    EndpointSliceDiscovery,
    Peer,
    StaticDiscovery,
    parse_static_peers,
    peers_from_endpointslices,
)

FIXTURES = Path(__file__).parent / "fixtures"
NS, SVC = "weft-system", "weft-mesh"
SELECTOR = {"kubernetes.io/service-name": SVC}


def load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def watch_events() -> list[dict[str, Any]]:
    return [json.loads(line) for line in (FIXTURES / "endpointslices-watch.jsonl").read_text().splitlines()]


def items(name: str) -> list[dict[str, Any]]:
    return load(name)["items"]


def api_error(code: int, reason: str) -> lightkube.ApiError:
    # What lightkube raises for an ERROR event in a watch stream.
    return lightkube.ApiError(status=Status(code=code, reason=reason, message=f"{reason.lower()} (test)"))


# The recorded cluster: gpu-1 and cpu-1 in slice 7xk2p, with cpu-2's old pod
# terminating there; cpu-2's new pod and cpu-3 in slice b9dfq; a hand-made
# slice with an endpoint that has no nodeName.
GPU1 = Peer("gpu-1", "10.244.0.12", 7443)
CPU1 = Peer("cpu-1", "10.244.1.7", 7443)
CPU2 = Peer("cpu-2", "10.244.2.9", 7443)
CPU3 = Peer("cpu-3", "10.244.3.5", 7443)
CPU4_STARTING = Peer("cpu-4", "10.244.4.3", 7443, ready=False)
CPU4 = Peer("cpu-4", "10.244.4.3", 7443)

# What a watcher on gpu-1 reports over the recorded watch stream: the first
# event (cpu-2's old pod leaving) changes no peer, so it is not reported.
WATCH_REPORTS = [
    [CPU1, CPU2, CPU3],
    [CPU1, CPU2, CPU3, CPU4_STARTING],
    [CPU1, CPU2, CPU3, CPU4],
    [CPU1, CPU4],
]


# --- static -----------------------------------------------------------------


def test_static_peers_keep_order_and_default_the_port():
    peers = parse_static_peers([
        {"node": "cpu-1", "address": "10.0.0.5", "port": 7443},
        {"node": "cpu-2", "address": "10.0.0.6"},
        {"node": "cpu-3", "address": "localhost", "port": 17443},
    ])
    assert peers == [
        Peer("cpu-1", "10.0.0.5", 7443),
        Peer("cpu-2", "10.0.0.6", 7443),
        Peer("cpu-3", "localhost", 17443),
    ]


def test_static_list_leaves_out_this_node_so_every_node_can_share_it():
    entries = [{"node": "gpu-1", "address": "10.0.0.4"}, {"node": "cpu-1", "address": "10.0.0.5"}]
    assert parse_static_peers(entries, self_node="gpu-1") == [Peer("cpu-1", "10.0.0.5", 7443)]


def test_static_ipv6_address_is_unbracketed_and_dialled_bracketed():
    [peer] = parse_static_peers([{"node": "cpu-1", "address": "[fd00:0:0::5]", "port": 7443}])
    assert peer.address == "fd00::5"
    assert peer.target == "[fd00::5]:7443"


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        pytest.param(
            [{"node": "a", "address": "10.0.0.1"}, {"node": "b", "address": "10.0.0.2"}, {"node": "c"}],
            "mesh.peers[2].address: missing", id="missing-address"),
        pytest.param([{"address": "10.0.0.1"}], "mesh.peers[0].node: missing", id="missing-node"),
        pytest.param([{"node": "", "address": "10.0.0.1"}], "mesh.peers[0].node: empty", id="empty-node"),
        pytest.param([{"node": "cpu-1", "address": ""}], "mesh.peers[0].address: empty", id="empty-address"),
        pytest.param([{"node": 5, "address": "10.0.0.1"}], "mesh.peers[0].node: expected a string, got 5",
                     id="node-not-a-string"),
        pytest.param([{"node": "CPU_1", "address": "10.0.0.1"}],
                     "mesh.peers[0].node: 'CPU_1' is not a lowercase DNS name (a Kubernetes node name)",
                     id="node-not-a-node-name"),
        pytest.param([{"node": "cpu-1", "address": "10.0.0.5:7443"}],
                     "mesh.peers[0].address: '10.0.0.5:7443' is not an IP address or host name "
                     "(give the port as port)", id="port-in-address"),
        pytest.param([{"node": "cpu-1", "address": "not a host"}],
                     "mesh.peers[0].address: 'not a host' is not an IP address or host name", id="bad-address"),
        pytest.param([{"node": "cpu-1", "address": "10.0.0.5", "port": 0}],
                     "mesh.peers[0].port: 0 is out of range (1-65535)", id="port-zero"),
        pytest.param([{"node": "cpu-1", "address": "10.0.0.5", "port": 65536}],
                     "mesh.peers[0].port: 65536 is out of range (1-65535)", id="port-too-big"),
        pytest.param([{"node": "cpu-1", "address": "10.0.0.5", "port": "7443"}],
                     "mesh.peers[0].port: expected an integer, got '7443'", id="port-as-string"),
        pytest.param([{"node": "cpu-1", "address": "10.0.0.5", "port": True}],
                     "mesh.peers[0].port: expected an integer, got True", id="port-as-bool"),
        pytest.param([{"node": "cpu-1", "address": "10.0.0.5"}, {"node": "cpu-1", "address": "10.0.0.6"}],
                     "mesh.peers[1].node: 'cpu-1' is already listed at mesh.peers[0]", id="duplicate-node"),
        pytest.param([{"node": "cpu-1", "address": "10.0.0.5"}, {"node": "cpu-2", "address": "10.0.0.5"}],
                     "mesh.peers[1]: 10.0.0.5 port 7443 is already listed at mesh.peers[0]",
                     id="duplicate-address-and-port"),
        pytest.param([{"node": "cpu-1", "address": "10.0.0.5", "host": "x"}],
                     "mesh.peers[0].host: unknown setting (known: node, address, port)", id="unknown-key"),
        pytest.param(["cpu-1"], "mesh.peers[0]: expected a table like {node = ..., address = ...}, got 'cpu-1'",
                     id="entry-not-a-table"),
        pytest.param("cpu-1,cpu-2", "mesh.peers: expected a list of tables, got 'cpu-1,cpu-2'", id="not-a-list"),
    ],
)
def test_static_errors_name_the_entry_and_key(entries, message):
    with pytest.raises(ConfigError) as info:
        parse_static_peers(entries)
    assert info.value.message == message


def test_static_errors_use_the_field_they_are_given():
    with pytest.raises(ConfigError, match=r"^demo\.peers\[0\]\.address: missing$"):
        parse_static_peers([{"node": "cpu-1"}], field="demo.peers")


def test_static_self_node_is_still_validated():
    with pytest.raises(ConfigError, match=r"mesh\.peers\[0\]\.port: 0 is out of range"):
        parse_static_peers([{"node": "gpu-1", "address": "10.0.0.4", "port": 0}], self_node="gpu-1")


def test_static_discovery_reports_its_list_once_and_returns_on_stop():
    peers = [Peer("cpu-1", "10.0.0.5", 7443)]
    seen: list[list[Peer]] = []
    stop = threading.Event()
    thread = threading.Thread(target=StaticDiscovery(peers).watch, args=(seen.append, stop))
    thread.start()
    stop.set()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert seen == [peers]


# --- kubernetes: the parser -------------------------------------------------


@pytest.fixture(params=["dicts", "lightkube-objects"])
def as_served(request):
    """Slices as plain JSON dicts, or as lightkube decodes them."""
    if request.param == "dicts":
        return lambda slices: slices
    return lambda slices: [EndpointSlice.from_dict(s) for s in slices]


def test_recorded_list_gives_one_peer_per_node_sorted(as_served):
    peers = peers_from_endpointslices(as_served(items("endpointslices.json")))
    assert peers == [CPU1, CPU2, CPU3, GPU1]


def test_this_node_is_left_out(as_served):
    peers = peers_from_endpointslices(as_served(items("endpointslices.json")), self_node="gpu-1")
    assert [p.node for p in peers] == ["cpu-1", "cpu-2", "cpu-3"]


@pytest.mark.parametrize("order", ["as-listed", "reversed"])
def test_a_node_in_two_slices_keeps_its_ready_endpoint(order):
    # cpu-2's old pod is terminating (not ready) in one slice, its new pod is ready in the other.
    slices = items("endpointslices.json")
    if order == "reversed":
        slices = slices[::-1]
    [cpu2] = [p for p in peers_from_endpointslices(slices) if p.node == "cpu-2"]
    assert cpu2 == Peer("cpu-2", "10.244.2.9", 7443, ready=True)


def test_a_not_ready_endpoint_is_reported_not_ready_when_it_is_all_there_is():
    slices = items("endpointslices.json")[:1]
    [cpu2] = [p for p in peers_from_endpointslices(slices) if p.node == "cpu-2"]
    assert cpu2 == Peer("cpu-2", "10.244.2.4", 7443, ready=False)


def test_an_endpoint_without_node_name_is_skipped():
    manual = [s for s in items("endpointslices.json") if s["metadata"]["name"] == "weft-mesh-manual"]
    assert manual[0]["endpoints"][0].get("nodeName") is None
    assert peers_from_endpointslices(manual) == []


def test_missing_ready_condition_means_ready():
    # discovery.k8s.io/v1: "A nil value should be interpreted as true".
    [es] = items("endpointslices.json")[:1]
    es["endpoints"] = [{"addresses": ["10.244.1.7"], "nodeName": "cpu-1"},
                       {"addresses": ["10.244.3.5"], "nodeName": "cpu-3", "conditions": {}}]
    assert [p.ready for p in peers_from_endpointslices([es])] == [True, True]


def test_the_port_is_found_by_name_not_position():
    slices = items("endpointslices.json")
    assert {p.port for p in peers_from_endpointslices(slices)} == {7443}
    assert {p.port for p in peers_from_endpointslices(slices[:2], port_name="metrics")} == {9464}


def test_ipv6_slice_gives_ipv6_peers_dialled_bracketed(as_served):
    ipv6 = [s for s in items("endpointslices-dualstack.json") if s["addressType"] == "IPv6"]
    peers = peers_from_endpointslices(as_served(ipv6), self_node="gpu-1")
    assert peers == [Peer("cpu-1", "fd00:10:244:1::7", 7443)]
    assert peers[0].target == "[fd00:10:244:1::7]:7443"


@pytest.mark.parametrize("order", ["ipv6-listed-first", "ipv4-listed-first"])
def test_dual_stack_picks_the_same_family_whatever_the_order(order):
    slices = items("endpointslices-dualstack.json")
    if order == "ipv4-listed-first":
        slices = slices[::-1]
    assert peers_from_endpointslices(slices) == [Peer("cpu-1", "10.244.1.7", 7443), Peer("gpu-1", "10.244.0.12", 7443)]


def test_placeholder_slice_of_a_service_without_pods_means_no_peers(as_served):
    assert peers_from_endpointslices(as_served(items("endpointslices-placeholder.json"))) == []


def test_fqdn_slices_are_ignored():
    [es] = items("endpointslices-dualstack.json")[1:]
    es["addressType"] = "FQDN"
    es["endpoints"][0]["addresses"] = ["cpu-1.example.internal"]
    assert peers_from_endpointslices([es]) == []


def test_missing_mesh_port_names_the_service_and_the_port(as_served):
    with pytest.raises(DiscoveryError) as info:
        peers_from_endpointslices(as_served(items("endpointslices-wrong-port.json")))
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.message.startswith("Service weft-system/weft-mesh has no port named 'mesh' "
                                         "(EndpointSlice weft-mesh-p3r8s has ports: 'grpc')")


def test_something_that_is_not_a_slice_is_refused_by_name():
    with pytest.raises(DiscoveryError, match=r"expected an EndpointSlice .* got int"):
        peers_from_endpointslices([42])


# --- kubernetes: list and watch against a fake client -------------------------


def _kept(fake, event: dict[str, Any]) -> dict[str, Any]:
    """The event's object, kept in ``fake.store`` (gone when DELETED) and its version made ``fake.version``, as
    the API server's own store does: both fakes then list what they watched."""
    obj = event["object"]
    if event["type"] == "DELETED":
        fake.store.pop(obj["metadata"]["name"], None)
    else:
        fake.store[obj["metadata"]["name"]] = obj
    fake.version = obj["metadata"]["resourceVersion"]
    return obj


class FakeList(list):
    """What ``lightkube.Client.list`` returns: the items, and ``resourceVersion`` once iterated."""

    def __init__(self, objects: list[Any], version: str) -> None:
        super().__init__(objects)
        self.resourceVersion = version


class FakeKube:
    """An API server's EndpointSlices, reached with ``lightkube.Client``'s list and watch keywords.

    ``list`` answers from the store (after raising any queued ``list_errors``).
    Each ``watch`` call plays the next scripted session: an event is applied to
    the store before it is yielded, as on a real server, and an exception in the
    script is raised where it stands. With no session left the watch sets
    ``stop`` and ends, so a test's watcher returns instead of blocking.
    """

    def __init__(self, listing: dict[str, Any], sessions=(), *, stop: threading.Event | None = None,
                 list_errors=()) -> None:
        self.store = {s["metadata"]["name"]: s for s in copy.deepcopy(listing["items"])}
        self.version = listing["metadata"]["resourceVersion"]
        self.sessions = [list(s) for s in sessions]
        self.list_errors = list(list_errors)
        self.stop = stop
        self.calls: list[tuple] = []
        self.closed = False

    def close(self) -> None:
        self.calls.append(("close",))
        self.closed = True

    def list(self, res, *, namespace=None, chunk_size=None, labels=None, fields=None):
        self.calls.append(("list", res, namespace, labels))
        if self.list_errors:
            raise self.list_errors.pop(0)
        selected = [
            res.from_dict(s) for s in self.store.values()
            if s["metadata"]["namespace"] == namespace
            and all(s["metadata"]["labels"].get(k) == v for k, v in (labels or {}).items())
        ]
        return FakeList(selected, self.version)

    def watch(self, res, *, namespace=None, labels=None, fields=None, server_timeout=None, resource_version=None,
              on_error=on_error_raise):
        self.calls.append(("watch", res, namespace, labels, resource_version))
        return self._play(res, self.sessions.pop(0) if self.sessions else None)

    def _play(self, res, session) -> Iterator[tuple[str, Any]]:
        if session is None:
            assert self.stop is not None, "watched past the script with no stop to set"
            self.stop.set()
            return
        for step in session:
            if isinstance(step, BaseException):
                raise step
            yield step["type"], res.from_dict(_kept(self, step))

    def verbs(self) -> list[str]:
        return [call[0] for call in self.calls]


class RecordingStop(threading.Event):
    """A stop event whose waits return at once and are recorded, so backoff costs no time."""

    def __init__(self, *, set_on_wait: bool = False) -> None:
        super().__init__()
        self.waits: list[float | None] = []
        self._set_on_wait = set_on_wait

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        if self._set_on_wait:
            self.set()
        return self.is_set()


def discovery(client, **kwargs) -> EndpointSliceDiscovery:
    return EndpointSliceDiscovery(NS, SVC, client=client, self_node="gpu-1", backoff_initial=0.5, backoff_max=2.0,
                                  **kwargs)


def test_list_asks_for_the_services_slices_in_its_namespace():
    listing = load("endpointslices.json")
    other = copy.deepcopy(listing["items"][0])
    other["metadata"].update(name="dns-abcde", labels={"kubernetes.io/service-name": "kube-dns"})
    listing["items"].append(other)
    kube = FakeKube(listing)
    assert discovery(kube).list() == [CPU1, CPU2, CPU3]
    assert kube.calls == [("list", EndpointSlice, NS, SELECTOR)]


def test_watch_reports_the_full_list_on_each_change_and_nothing_else():
    stop = RecordingStop()
    kube = FakeKube(load("endpointslices.json"), [watch_events()], stop=stop)
    reports: list[list[Peer]] = []
    with capture_logs() as logs:
        discovery(kube).watch(reports.append, stop)
    assert reports == WATCH_REPORTS
    assert [e["peers"] for e in logs if e["event"] == "mesh.discovery.changed"] == [3, 4, 4, 2]
    assert [e["ready"] for e in logs if e["event"] == "mesh.discovery.changed"] == [3, 3, 4, 2]
    # Watches from the version the list was taken at; re-lists on every event.
    assert kube.calls[1] == ("watch", EndpointSlice, NS, SELECTOR, "48213")
    assert kube.verbs() == ["list", "watch", "list", "list", "list", "list", "list", "watch"]
    assert stop.waits == []


def test_watch_backs_off_doubling_up_to_the_bound_and_logs_each_failure():
    stop = RecordingStop()
    refused = [httpx2.ConnectError("connection refused") for _ in range(4)]
    kube = FakeKube(load("endpointslices.json"), stop=stop, list_errors=refused)
    reports: list[list[Peer]] = []
    with capture_logs() as logs:
        discovery(kube).watch(reports.append, stop)
    assert stop.waits == [0.5, 1.0, 2.0, 2.0]
    failed = [e for e in logs if e["event"] == "mesh.discovery.failed"]
    assert [e["retry_in"] for e in failed] == [0.5, 1.0, 2.0, 2.0]
    assert all(e["log_level"] == "warning" and "connection refused" in e["error"] for e in failed)
    assert reports == [[CPU1, CPU2, CPU3]]


def test_backoff_starts_again_once_a_watch_delivers_an_event():
    stop = RecordingStop()
    dropped = httpx2.ReadError("connection reset by peer")
    sessions = [[dropped], [dropped], [watch_events()[1], dropped], [dropped]]
    kube = FakeKube(load("endpointslices.json"), sessions, stop=stop)
    discovery(kube).watch(lambda peers: None, stop)
    assert stop.waits == [0.5, 1.0, 0.5, 1.0]


def test_gone_after_events_relists_at_once():
    stop = RecordingStop()
    sessions = [[watch_events()[1], api_error(410, "Expired")]]
    kube = FakeKube(load("endpointslices.json"), sessions, stop=stop)
    reports: list[list[Peer]] = []
    with capture_logs() as logs:
        discovery(kube).watch(reports.append, stop)
    assert stop.waits == []
    assert "mesh.discovery.expired" in [e["event"] for e in logs]
    assert kube.verbs() == ["list", "watch", "list", "list", "watch"]
    assert reports == WATCH_REPORTS[:2]


def test_gone_on_a_version_just_listed_backs_off():
    stop = RecordingStop()
    kube = FakeKube(load("endpointslices.json"), [[api_error(410, "Expired")]], stop=stop)
    discovery(kube).watch(lambda peers: None, stop)
    assert stop.waits == [0.5]


def test_a_service_without_the_mesh_port_is_retried_not_fatal():
    # Someone may fix the Service; the agent keeps running pods locally meanwhile.
    stop = RecordingStop(set_on_wait=True)
    kube = FakeKube(load("endpointslices-wrong-port.json"), stop=stop)
    reports: list[list[Peer]] = []
    with capture_logs() as logs:
        discovery(kube).watch(reports.append, stop)
    assert reports == []
    [failed] = [e for e in logs if e["event"] == "mesh.discovery.failed"]
    assert "no port named 'mesh'" in failed["error"]


def test_a_refused_watch_request_is_read_by_its_http_status():
    # lightkube raises a plain HTTPStatusError, not ApiError, when the watch request itself is refused.
    request = httpx2.Request("GET", "https://kube.test/apis/discovery.k8s.io/v1/namespaces/weft-system/endpointslices")
    refused = httpx2.HTTPStatusError("403 Forbidden", request=request, response=httpx2.Response(403, request=request))
    stop = RecordingStop(set_on_wait=True)
    kube = FakeKube(load("endpointslices.json"), [[refused]], stop=stop)
    with capture_logs() as logs:
        discovery(kube).watch(lambda peers: None, stop)
    [failed] = [e for e in logs if e["event"] == "mesh.discovery.failed"]
    assert failed["error"].startswith("cannot watch EndpointSlices of Service weft-system/weft-mesh: HTTPStatusError")
    assert "grant the agent's service account get, list and watch" in failed["error"]


def test_stop_during_backoff_ends_the_watch():
    stop = RecordingStop(set_on_wait=True)
    kube = FakeKube(load("endpointslices.json"), stop=stop,
                    list_errors=[httpx2.ConnectError("connection refused")] * 3)
    discovery(kube).watch(lambda peers: None, stop)
    assert stop.waits == [0.5]
    assert kube.verbs() == ["list"]


def test_stop_between_events_ends_the_watch_before_the_next_relist():
    stop = RecordingStop()
    kube = FakeKube(load("endpointslices.json"), [watch_events()], stop=stop)
    reports: list[list[Peer]] = []

    def on_change(peers: list[Peer]) -> None:
        reports.append(peers)
        stop.set()

    discovery(kube).watch(on_change, stop)
    assert reports == WATCH_REPORTS[:1]
    assert kube.verbs() == ["list", "watch"]


def test_an_error_in_on_change_is_not_swallowed():
    stop = RecordingStop()
    kube = FakeKube(load("endpointslices.json"), [watch_events()], stop=stop)

    def on_change(peers: list[Peer]) -> None:
        raise RuntimeError("mesh bug")

    with pytest.raises(RuntimeError, match="mesh bug"):
        discovery(kube).watch(on_change, stop)


@pytest.mark.parametrize(
    ("error", "kind", "code", "says"),
    [
        pytest.param(api_error(403, "Forbidden"), DiscoveryError, grpc.StatusCode.FAILED_PRECONDITION,
                     "grant the agent's service account get, list and watch on endpointslices.discovery.k8s.io "
                     "in namespace weft-system", id="forbidden-says-which-rbac"),
        pytest.param(api_error(401, "Unauthorized"), DiscoveryError, grpc.StatusCode.FAILED_PRECONDITION,
                     "grant the agent's service account", id="unauthorized"),
        pytest.param(api_error(500, "InternalError"), DiscoveryUnavailable, grpc.StatusCode.UNAVAILABLE,
                     "cannot list EndpointSlices of Service weft-system/weft-mesh: ApiError: internalerror (test)",
                     id="server-error"),
        pytest.param(httpx2.ConnectError("connection refused"), DiscoveryUnavailable, grpc.StatusCode.UNAVAILABLE,
                     "cannot list EndpointSlices of Service weft-system/weft-mesh: ConnectError: connection refused",
                     id="unreachable"),
    ],
)
def test_list_errors_say_what_failed_and_chain_the_cause(error, kind, code, says):
    kube = FakeKube(load("endpointslices.json"), list_errors=[error])
    with pytest.raises(DiscoveryError) as info:
        discovery(kube).list()
    assert type(info.value) is kind
    assert info.value.code == code
    assert says in info.value.message
    assert info.value.__cause__ is error


# --- kubernetes: configuration ----------------------------------------------


def _outside_a_pod(exc: Exception):
    def from_service_account(cls, service_account=None):
        raise exc
    return classmethod(from_service_account)


@pytest.mark.parametrize(
    ("in_cluster", "detail"),
    [
        # lightkube then falls back to KUBECONFIG, which names a file that is not there.
        pytest.param(lightkube.ConfigError("[Errno 2] No such file or directory: '.../token'"),
                     "(ConfigError: Configuration file ", id="no-token-and-no-kubeconfig"),
        # lightkube does not fall back here: the KeyError escapes it.
        pytest.param(KeyError("KUBERNETES_SERVICE_HOST"), "(KUBERNETES_SERVICE_HOST is not set)",
                     id="token-but-no-service-host"),
    ],
)
def test_no_kubernetes_configuration_says_how_to_give_one(monkeypatch, tmp_path, in_cluster, detail):
    monkeypatch.setattr(KubeConfig, "from_service_account", _outside_a_pod(in_cluster))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    found = EndpointSliceDiscovery(NS, SVC)
    with pytest.raises(DiscoveryError) as info:
        found.list()
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    message = info.value.message
    assert message.startswith("no Kubernetes API configuration to discover peers from Service weft-system/weft-mesh")
    assert "service account token mounted" in message
    assert "--kubeconfig" in message and "KUBECONFIG" in message
    assert detail in message
    assert isinstance(info.value.__cause__, (lightkube.ConfigError, KeyError))


def test_watch_without_configuration_fails_at_once_instead_of_retrying(monkeypatch, tmp_path):
    monkeypatch.setattr(KubeConfig, "from_service_account", _outside_a_pod(lightkube.ConfigError("no token")))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    stop = RecordingStop()
    with pytest.raises(DiscoveryError, match="--kubeconfig"):
        EndpointSliceDiscovery(NS, SVC).watch(lambda peers: None, stop)
    assert stop.waits == []


def test_client_comes_from_kubeconfig_when_not_in_a_pod(monkeypatch, tmp_path):
    monkeypatch.setattr(KubeConfig, "from_service_account", _outside_a_pod(lightkube.ConfigError("no token")))
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": "https://kube.test:6443"}}],
        "users": [{"name": "test", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": "default"}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    found = EndpointSliceDiscovery(NS, SVC)
    try:
        client = found.client()
        assert isinstance(client, lightkube.Client)
        assert client.config.cluster.server == "https://kube.test:6443"
        assert found.client() is client
    finally:
        found.close()


# --- kubernetes: the real lightkube client over a mock transport --------------


class MockApiServer:
    """Serves the recorded list and watch stream over HTTP, as the API server would.

    Watch events are applied to the store as lightkube reads them, so a re-list
    after an event sees it. lightkube re-opens a watch that ends; the second
    watch request stops the test's watcher and is answered with an error.
    """

    def __init__(self, stop: threading.Event) -> None:
        listing = load("endpointslices.json")
        self.store = {s["metadata"]["name"]: s for s in listing["items"]}
        self.version = listing["metadata"]["resourceVersion"]
        self.stop = stop
        self.requests: list[httpx2.Request] = []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        if request.url.params.get("watch") != "true":
            body = {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": self.version}, "items": list(self.store.values())}
            return httpx2.Response(200, json=body)
        if sum(r.url.params.get("watch") == "true" for r in self.requests) > 1:
            self.stop.set()
            return httpx2.Response(500, json={"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                              "message": "etcdserver: request timed out", "code": 500})
        return httpx2.Response(200, content=self._stream())

    def _stream(self) -> Iterator[bytes]:
        for event in watch_events():
            _kept(self, event)
            yield (json.dumps(event) + "\n").encode()


def test_real_lightkube_client_lists_and_watches_the_services_slices():
    stop = threading.Event()
    server = MockApiServer(stop)
    config = KubeConfig.from_one(cluster=Cluster(server="https://kube.test"), user=User(token="t0ken"),
                                 namespace="default")
    with lightkube.Client(config=config, transport=httpx2.MockTransport(server)) as client:
        reports: list[list[Peer]] = []
        discovery(client).watch(reports.append, stop)
    assert reports == WATCH_REPORTS
    first_list, first_watch = server.requests[0], server.requests[1]
    assert first_list.url.path == "/apis/discovery.k8s.io/v1/namespaces/weft-system/endpointslices"
    assert first_list.url.params["labelSelector"] == "kubernetes.io/service-name=weft-mesh"
    assert first_watch.url.path == first_list.url.path
    assert dict(first_watch.url.params) == {"labelSelector": "kubernetes.io/service-name=weft-mesh",
                                            "resourceVersion": "48213", "watch": "true"}
    assert first_watch.headers["Authorization"] == "Bearer t0ken"


# --- values -----------------------------------------------------------------


def _watched_after(failures: int, error: Exception, *, backoff_max: float):
    """A watch whose client factory raises ``error`` ``failures`` times, then builds the client: its attempts,
    stop, client, log events and reports."""
    stop = RecordingStop()
    kube = FakeKube(load("endpointslices.json"), stop=stop)
    attempts: list[int] = []

    def factory():
        attempts.append(len(attempts))
        if len(attempts) <= failures:
            raise error
        return kube

    reports: list[list[Peer]] = []
    with capture_logs() as logs:
        EndpointSliceDiscovery(NS, SVC, client_factory=factory, self_node="gpu-1", backoff_initial=0.5,
                               backoff_max=backoff_max).watch(reports.append, stop)
    return attempts, stop, kube, logs, reports


def test_a_kubeconfig_not_written_yet_is_looked_for_steadily_and_said_once_not_backed_off():
    """As on every install: the agent starts before the DaemonSet's pod writes its kubeconfig. The agent must use
    the API within a moment of it, not after a wait that doubled meanwhile (placement has no peers till then)."""
    from shim.kube.access import KubeconfigNotYet

    not_yet = KubeconfigNotYet("kubernetes.kubeconfig: /etc/weft/api/kubeconfig is not written yet")
    attempts, stop, _, logs, reports = _watched_after(6, not_yet, backoff_max=30.0)
    assert len(attempts) == 7 and stop.waits[:6] == [0.5] * 6
    assert [e["event"] for e in logs if e["event"].startswith("mesh.discovery.") and e["event"] != (
        "mesh.discovery.changed")] == ["mesh.discovery.waiting"]
    assert reports == [[CPU1, CPU2, CPU3]]


@pytest.mark.parametrize(
    ("peer", "target"),
    [
        pytest.param(Peer("cpu-1", "10.0.0.5", 7443), "10.0.0.5:7443", id="ipv4"),
        pytest.param(Peer("cpu-1", "fd00::5", 7443), "[fd00::5]:7443", id="ipv6-bracketed"),
        pytest.param(Peer("cpu-1", "cpu-1.example.internal", 17443), "cpu-1.example.internal:17443", id="hostname"),
    ],
)
def test_peer_target_is_what_grpc_dials(peer, target):
    assert peer.target == target


def test_a_client_its_factory_cannot_build_yet_is_asked_for_again_and_then_used():
    # The credentials keeper has not written the kubeconfig yet.
    unreadable = ConfigError("kubernetes.kubeconfig: cannot read /etc/weft/kubeconfig: not found")
    attempts, stop, kube, logs, reports = _watched_after(2, unreadable, backoff_max=2.0)
    assert len(attempts) == 3 and stop.waits[:2] == [0.5, 1.0]
    failed = [e for e in logs if e["event"] == "mesh.discovery.failed"]
    assert len(failed) == 2 and all("/etc/weft/kubeconfig" in e["error"] for e in failed)
    assert reports == [[CPU1, CPU2, CPU3]]
    # The client it built is closed when the watch ends, after its last call, by the watch's own thread.
    assert kube.calls[-1] == ("close",)
