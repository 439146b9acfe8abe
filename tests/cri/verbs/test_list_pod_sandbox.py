"""ListPodSandbox: a host's shadow sandboxes are left out, so its kubelet never sees (or kills) them.

Intercepted only while this node hosts shadows or has remote containers; an
origin's remote containers live in its own sandboxes, so none is added.
"""

from __future__ import annotations

import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.labels import ORIGIN_LABEL
from shim.cri.verbs import list_pod_sandbox
from tests.cri.verbs.fakes import SANDBOX, add_remote, ctx

REQUEST = cri.ListPodSandboxRequest(filter=cri.PodSandboxFilter(label_selector={"app": "web"})).SerializeToString()


def listed(*items: tuple[str, dict]) -> cri.ListPodSandboxResponse:
    return cri.ListPodSandboxResponse(items=[cri.PodSandbox(id=i, labels=lb, state=cri.SANDBOX_READY)
                                             for i, lb in items])


MIXED = listed(("own-1", {"app": "web"}), ("shadow-1", {ORIGIN_LABEL: "gpu-1", "app": "web"}), ("own-2", {}))


@pytest.fixture
def route(fabric, containerd):
    containerd.answer("ListPodSandbox", MIXED)
    return list_pod_sandbox.route(fabric)


def ids(answer: bytes) -> list[str]:
    return [s.id for s in cri.ListPodSandboxResponse.FromString(answer).items]


def test_not_intercepted_on_a_node_without_shadows_or_remote_containers(fabric, mesh, route) -> None:
    assert not route.applies()
    fabric.shadows.present = True
    assert route.applies()
    fabric.shadows.present = False
    add_remote(fabric)
    assert route.applies()


def test_a_hosts_shadow_sandboxes_are_left_out_and_the_rest_kept_in_order(fabric, containerd, route) -> None:
    fabric.shadows.present = True
    answer = route.handle(REQUEST, ctx(("x-request-id", "3")))
    assert containerd.only_request("ListPodSandbox") == REQUEST, "kubelet's filter reaches containerd unchanged"
    assert containerd.calls[0].metadata["x-request-id"] == "3"
    assert ids(answer) == ["own-1", "own-2"]
    kept = cri.ListPodSandboxResponse.FromString(answer).items[0]
    assert kept == MIXED.items[0], "what is kept is kept whole"


def test_a_list_without_shadows_comes_back_byte_for_byte(fabric, containerd, route) -> None:
    fabric.shadows.present = True
    plain = listed(("own-1", {"app": "web"}))
    containerd.answer("ListPodSandbox", plain)
    assert route.handle(REQUEST, ctx()) == plain.SerializeToString()


def test_an_origins_remote_containers_add_no_sandbox(fabric, route, remote) -> None:
    assert route.applies()
    assert ids(route.handle(REQUEST, ctx())) == ["own-1", "shadow-1", "own-2"]
    assert SANDBOX not in ids(route.handle(REQUEST, ctx()))
