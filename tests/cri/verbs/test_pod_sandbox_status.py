"""PodSandboxStatus: a sandbox with remote containers lists them where containerd lists the pod's containers.

A kubelet with evented PLEG takes ``containers_statuses`` as the pod's
containers whenever ``timestamp`` is set; a remote container missing there
would be started again.
"""

from __future__ import annotations

import time

import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import pod_sandbox_status
from tests.cri.verbs.fakes import SANDBOX, add_remote, ctx

LOCAL_ID = "1c" * 32
OTHER_SANDBOX = "6e" * 32


def body(sandbox_id: str = SANDBOX) -> bytes:
    return cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True).SerializeToString()


def answer(timestamp: int) -> cri.PodSandboxStatusResponse:
    return cri.PodSandboxStatusResponse(
        status=cri.PodSandboxStatus(id=SANDBOX, state=cri.SANDBOX_READY), timestamp=timestamp,
        containers_statuses=[cri.ContainerStatus(id=LOCAL_ID, state=cri.CONTAINER_RUNNING)],
        info={"info": "{}"})


@pytest.fixture
def route(fabric):
    return pod_sandbox_status.route(fabric)


def test_intercepted_only_for_a_sandbox_with_remote_containers(fabric, mesh, route) -> None:
    assert not route.applies()
    add_remote(fabric)
    assert route.applies()
    assert route.pick(body(SANDBOX)) and not route.pick(body(OTHER_SANDBOX))


def test_remote_containers_are_listed_after_containerds_own(fabric, mesh, containerd, route) -> None:
    r = add_remote(fabric)
    containerd.answer("PodSandboxStatus", answer(time.time_ns()))
    got = cri.PodSandboxStatusResponse.FromString(route.handle(body(), ctx()))
    assert containerd.only_request("PodSandboxStatus") == body()
    assert [s.id for s in got.containers_statuses] == [LOCAL_ID, r.id]
    assert got.containers_statuses[1].metadata.name == "tokenize"
    assert got.info == {"info": "{}"} and got.status.id == SANDBOX


def test_an_answer_without_the_list_is_left_as_containerd_gave_it(fabric, mesh, containerd, route) -> None:
    """containerd 1.6 sets no timestamp: kubelet lists the containers itself, and ListContainers adds ours."""
    add_remote(fabric)
    containerd.answer("PodSandboxStatus", answer(0))
    assert route.handle(body(), ctx()) == answer(0).SerializeToString()
