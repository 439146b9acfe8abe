"""StopContainer: a remote container is stopped on its host with kubelet's grace period.

One that has exited, or was lost with its host, is stopped already: kubelet
gets success at once, as containerd answers for an exited container. Stop of
an ID weft does not know is containerd's to answer (it succeeds, per CRI).
"""

from __future__ import annotations

import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import stop_container
from tests.cri.verbs.fakes import LOCAL_ID, ORIGIN, add_remote, ctx


def body(container_id: str, timeout: int = 30) -> bytes:
    return cri.StopContainerRequest(container_id=container_id, timeout=timeout).SerializeToString()


@pytest.fixture
def route(fabric):
    return stop_container.route(fabric)


def test_a_local_or_unknown_container_is_stopped_by_containerd_unchanged(containerd, host, route, remote) -> None:
    answer = route.handle(body(LOCAL_ID), ctx())
    assert containerd.only_request("StopContainer") == body(LOCAL_ID)
    assert answer == b"" and host.calls == []


def test_a_running_remote_container_is_stopped_on_its_host_with_kubelets_grace_period(fabric, containerd, host,
                                                                                     route, remote) -> None:
    host.status = cri.ContainerStatus(id="shadow-ctr", state=cri.CONTAINER_EXITED, exit_code=143, finished_at=9_000)
    answer = route.handle(body(remote.id, timeout=20), ctx())
    assert cri.StopContainerResponse.FromString(answer) == cri.StopContainerResponse()
    assert host.methods() == ["StopContainer", "ShadowStatus"]
    assert host.requests["StopContainer"] == [body(remote.id, timeout=20)]
    assert host.timeouts["StopContainer"] == [50], "the grace period, and time for the host to answer"
    assert all(key == remote.key and origin == ORIGIN for _, origin, key in host.calls)
    assert (remote.state, remote.status.exit_code) == (cri.CONTAINER_EXITED, 143), "kubelet's next status shows it"
    assert containerd.calls == []


@pytest.mark.parametrize("how", ["exited", "lost"])
def test_a_remote_container_that_is_not_running_is_stopped_already(fabric, host, route, how) -> None:
    r = add_remote(fabric, state=cri.CONTAINER_EXITED if how == "exited" else cri.CONTAINER_RUNNING)
    if how == "lost":
        fabric.remotes.mark_lost(r, 90.0)
    assert cri.StopContainerResponse.FromString(route.handle(body(r.id), ctx())) == cri.StopContainerResponse()
    assert host.calls == []
