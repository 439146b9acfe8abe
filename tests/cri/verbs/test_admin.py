"""weft's own admin calls on the agent's socket: Status, Explain and Drain answer JSON and refuse bad bodies.

Status is the same document ``weft status --state-dir`` builds from the state
files, plus what only the running agent knows: this node, its peers, the
shadows it hosts (from containerd) and its recent warnings. Explain is one
placement with its reasons; Drain turns admission of new shadows off or on.
"""

from __future__ import annotations

import json

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri import methods
from shim.cri.verbs import admin, routes
from shim.crishared.labels import ORIGIN_LABEL
from shim.errors import ConfigError, MalformedRequest, UnknownContainer
from shim.origin.context import Origin
from tests.cri.verbs.fakes import HOST, LOCAL_ID, SANDBOX, FakeMesh, ctx, lease_for, opt_in, placed_local

HOSTED = cri.ListContainersResponse(containers=[
    cri.Container(id="shadow-1", metadata=cri.ContainerMetadata(name="gpu-2_tokenize"), state=cri.CONTAINER_RUNNING,
                  labels={ORIGIN_LABEL: "gpu-2"}, annotations={"weft.io/origin-key-full": "sb/tokenize/0"}),
    cri.Container(id="own-1", metadata=cri.ContainerMetadata(name="web"), state=cri.CONTAINER_RUNNING),
])


def status(fabric) -> dict:
    return json.loads(admin.status(fabric).handle(b"", ctx()))


def explain(fabric, container_id: str) -> dict:
    return json.loads(admin.explain(fabric).handle(container_id.encode(), ctx()))


def drain(fabric, body: bytes) -> dict:
    return json.loads(admin.drain(fabric).handle(body, ctx()))


def test_the_admin_table_holds_status_explain_and_drain_and_no_cri_path(fabric) -> None:
    table = routes.admin_calls(fabric)
    assert set(table) == {methods.ADMIN_STATUS, methods.ADMIN_EXPLAIN, methods.ADMIN_DRAIN}
    assert not set(table) & set(routes.intercepted(fabric))
    assert all(route.applies() and route.pick is None for route in table.values())


# -- Status ------------------------------------------------------------------------------------------
def test_status_of_a_standalone_agent_shows_its_pods_and_placements(fabric, containerd) -> None:
    placed_local(fabric, LOCAL_ID)
    doc = status(fabric)
    assert doc["node"] == {"name": None, "role": "standalone", "mesh_address": None, "draining": False,
                           "gpu_broker": False}
    assert [s["id"] for s in doc["sandboxes"]] == [SANDBOX] and doc["sandboxes"][0]["opted_in"]
    assert [(p["container_id"], p["placement"], p["state"]) for p in doc["placements"]] == [
        (LOCAL_ID, "local", "created")]
    assert doc["leases"] == [] and doc["hosted"] == [] and "peers" not in doc
    assert isinstance(doc["recent_errors"], list)
    assert containerd.calls == [], "a node that hosts nothing does not ask containerd"


def test_status_lists_the_leases_the_broker_holds(fabric, broker) -> None:
    lease = lease_for(broker)
    doc = status(fabric)
    assert doc["node"]["gpu_broker"] is True
    assert [x["lease_id"] for x in doc["leases"]] == [lease]


def test_status_of_a_cpu_host_shows_its_peers_and_the_shadows_it_hosts(fabric, containerd, mesh) -> None:
    mesh.role = "cpu"
    containerd.answer("ListContainers", HOSTED)
    doc = status(fabric)
    assert doc["node"] == {"name": "gpu-1", "role": "cpu", "mesh_address": "10.0.0.1:7443", "draining": False,
                           "gpu_broker": False}
    assert [p["node"] for p in doc["peers"]] == [HOST]
    assert doc["hosted"] == [{"id": "shadow-1", "name": "gpu-2_tokenize", "origin": "gpu-2", "state": "running",
                              "key": "sb/tokenize/0"}]
    # Without the API this host makes no reservation pods, and says so for each shadow.
    assert [(s["id"], s["reservation"]) for s in doc["shadows"]] == [("shadow-1", {"name": "", "state": "none"})]


def test_status_shows_each_shadow_s_reservation_on_a_host_that_makes_them(fabric, containerd, mesh) -> None:
    mesh.role = "cpu"
    containerd.answer("ListContainers", HOSTED)
    fabric.reservation_of = lambda key: {"name": "weft-hosted-abc", "state": "admitted"} if key else None
    doc = status(fabric)
    assert doc["shadows"][0]["reservation"] == {"name": "weft-hosted-abc", "state": "admitted"}


def test_status_says_when_containerd_cannot_tell_what_is_hosted(fabric, containerd, mesh) -> None:
    mesh.role = "cpu"
    containerd.refuse("ListContainers", grpc.StatusCode.UNAVAILABLE, "containerd is restarting")
    doc = status(fabric)
    assert doc["hosted"] == "containerd: containerd is restarting"
    assert doc["node"]["role"] == "cpu", "the rest of the document is still there"


# -- Explain -----------------------------------------------------------------------------------------
def test_explain_gives_a_placement_with_its_pod_and_reasons(fabric) -> None:
    opt_in(fabric)
    placed_local(fabric, LOCAL_ID)
    doc = explain(fabric, LOCAL_ID)
    assert (doc["container_id"], doc["pod"], doc["namespace"], doc["placement"]) == (
        LOCAL_ID, "infer", "default", "local")
    assert doc["why"][0] == "pod default/infer opted in (runtime handler weft)"


def test_explain_takes_a_unique_prefix_and_surrounding_whitespace(fabric) -> None:
    placed_local(fabric, LOCAL_ID)
    assert explain(fabric, f"  {LOCAL_ID[:12]}\n")["container_id"] == LOCAL_ID


def test_explain_with_the_lease_the_broker_holds(fabric, broker) -> None:
    lease = lease_for(broker)
    placed_local(fabric, LOCAL_ID, lease_id=lease)
    doc = explain(fabric, LOCAL_ID)
    assert doc["lease"]["lease_id"] == lease and any(line.startswith(f"lease {lease}") for line in doc["why"])


def test_explain_of_a_container_weft_did_not_place_is_not_found(fabric) -> None:
    with pytest.raises(UnknownContainer) as err:
        explain(fabric, LOCAL_ID)
    assert err.value.code is grpc.StatusCode.NOT_FOUND and LOCAL_ID in err.value.message


# -- Drain -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body",
    [b"", b"{}", b"not json", b"\xff\xfe", b'{"drain": "yes"}', b'{"drain": 1}', b'{"drain": null}', b"[true]",
     b"true"],
    ids=["empty", "no-drain-key", "not-json", "not-utf8", "string", "number", "null", "list", "bare-bool"],
)
def test_drain_refuses_a_body_that_is_not_drain_true_or_false(fabric, mesh, body) -> None:
    mesh.role = "cpu"
    with pytest.raises(MalformedRequest) as err:
        drain(fabric, body)
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT and '{"drain": true}' in err.value.message
    assert mesh.draining is False


@pytest.mark.parametrize("role", [None, "gpu"], ids=["no-mesh", "gpu-only-node"])
def test_drain_on_a_node_that_hosts_nothing_is_refused(fabric, role) -> None:
    if role is not None:
        fabric.origin = Origin(FakeMesh(role=role))
    with pytest.raises(ConfigError) as err:
        drain(fabric, b'{"drain": true}')
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT and "nothing to drain" in err.value.message


def test_drain_turns_admission_off_and_back_on_and_shows_what_is_still_hosted(fabric, containerd, mesh) -> None:
    mesh.role = "gpu,cpu"
    containerd.answer("ListContainers", HOSTED)
    on = drain(fabric, b'{"drain": true}')
    assert (on["node"], on["draining"]) == ("gpu-1", True) and mesh.draining
    assert [h["id"] for h in on["hosted"]] == ["shadow-1"]
    off = drain(fabric, b'{"drain": false}')
    assert off["draining"] is False and not mesh.draining
