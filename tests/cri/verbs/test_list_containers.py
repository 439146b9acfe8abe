"""ListContainers: an origin's remote containers are added under kubelet's IDs (shadows: ``test_list_verbs``).

Remote containers pass kubelet's filter as containerd applies it to its own:
ID or sandbox ID (a unique prefix), state, and labels.
"""

from __future__ import annotations

import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import list_containers
from shim.crishared.labels import ORIGIN_LABEL
from tests.cri.verbs.fakes import OTHER_SANDBOX, SANDBOX, add_remote, ctx

LOCAL = cri.Container(id="local-1", pod_sandbox_id=SANDBOX, state=cri.CONTAINER_RUNNING, labels={"app": "web"})
SHADOW = cri.Container(id="shadow-1", pod_sandbox_id="shadow-sb", labels={ORIGIN_LABEL: "gpu-1", "app": "web"})


def body(**filter_fields) -> bytes:
    return cri.ListContainersRequest(filter=cri.ContainerFilter(**filter_fields)).SerializeToString()


def ids(answer: bytes) -> list[str]:
    return [c.id for c in cri.ListContainersResponse.FromString(answer).containers]


@pytest.fixture
def route(fabric, containerd):
    containerd.answer("ListContainers", cri.ListContainersResponse(containers=[LOCAL, SHADOW]))
    return list_containers.route(fabric)


def test_remote_containers_are_added_after_containerds_in_kubelets_terms(fabric, containerd, host, route,
                                                                         remote) -> None:
    containerd.answer("ListContainers", cri.ListContainersResponse(containers=[LOCAL]))
    answer = cri.ListContainersResponse.FromString(route.handle(body(), ctx()))
    assert [c.id for c in answer.containers] == ["local-1", remote.id]
    item = answer.containers[1]
    assert (item.pod_sandbox_id, item.state, item.created_at) == (SANDBOX, cri.CONTAINER_RUNNING, 1_000)
    assert item.metadata.name == "tokenize" and item.image.image == "busybox:1.36"
    assert dict(item.labels) == dict(remote.config.labels) and ORIGIN_LABEL not in item.labels
    assert item.image_ref.startswith("docker.io/library/busybox@sha256:")
    assert host.calls == [], "answered from what the hosts pushed"


@pytest.mark.parametrize(
    ("filter_fields", "shown"),
    [
        pytest.param({}, ["tokenize", "detok", "other"], id="no-filter"),
        pytest.param({"pod_sandbox_id": SANDBOX}, ["tokenize", "detok"], id="sandbox"),
        pytest.param({"pod_sandbox_id": SANDBOX[:8]}, ["tokenize", "detok"], id="sandbox-prefix"),
        pytest.param({"state": cri.ContainerStateValue(state=cri.CONTAINER_EXITED)}, ["detok"], id="state"),
        pytest.param({"label_selector": {"tier": "front"}}, ["tokenize", "other"], id="label"),
        pytest.param({"label_selector": {"tier": "front", "io.kubernetes.container.name": "other"}}, ["other"],
                     id="labels-all-must-match"),
        pytest.param({"id": "nope"}, [], id="unknown-id"),
    ],
)
def test_remote_containers_pass_kubelets_filter_as_containerd_applies_it(fabric, containerd, mesh, route,
                                                                         filter_fields, shown) -> None:
    containerd.answer("ListContainers", cri.ListContainersResponse())
    add_remote(fabric, "tokenize", labels={"tier": "front"})
    add_remote(fabric, "detok", state=cri.CONTAINER_EXITED)
    add_remote(fabric, "other", sandbox_id=OTHER_SANDBOX, labels={"tier": "front"})
    answer = cri.ListContainersResponse.FromString(route.handle(body(**filter_fields), ctx()))
    assert sorted(c.metadata.name for c in answer.containers) == sorted(shown)


def test_a_remote_container_is_found_by_a_unique_prefix_of_its_id(fabric, containerd, mesh, route) -> None:
    containerd.answer("ListContainers", cri.ListContainersResponse())
    r = add_remote(fabric, "tokenize")
    add_remote(fabric, "detok")
    assert ids(route.handle(body(id=r.id[:16]), ctx())) == [r.id]


def test_shadows_hidden_and_remote_containers_added_together(fabric, route, remote) -> None:
    fabric.shadows.present = True  # a node both hosts for its peers and reroutes its own
    assert ids(route.handle(body(), ctx())) == ["local-1", remote.id]
