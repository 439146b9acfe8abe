"""StartContainer: a remote container is started on its host; kubelet's next ContainerStatus already shows it running.

A container lost with its host cannot be started (FAILED_PRECONDITION); a
host that is not a peer now, or does not answer, is UNAVAILABLE, so kubelet
retries.
"""

from __future__ import annotations

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import container_status, start_container
from shim.errors import CannotStart, HostUnavailable
from shim.mesh.client import PeerUnavailable
from tests.cri.verbs.fakes import LOCAL_ID, ORIGIN, add_remote, ctx


def body(container_id: str) -> bytes:
    return cri.StartContainerRequest(container_id=container_id).SerializeToString()


@pytest.fixture
def route(fabric):
    return start_container.route(fabric)


def status_of(fabric, container_id: str) -> cri.ContainerStatus:
    request = cri.ContainerStatusRequest(container_id=container_id).SerializeToString()
    return cri.ContainerStatusResponse.FromString(container_status.route(fabric).handle(request, ctx())).status


def test_a_local_container_starts_in_containerd_unchanged(containerd, host, route, remote) -> None:
    route.handle(body(LOCAL_ID), ctx())
    assert containerd.only_request("StartContainer") == body(LOCAL_ID)
    assert host.calls == []


def test_a_remote_container_is_started_on_its_host_and_shown_running(fabric, containerd, host, route) -> None:
    r = add_remote(fabric, state=cri.CONTAINER_CREATED)
    assert status_of(fabric, r.id).state == cri.CONTAINER_CREATED
    host.status = cri.ContainerStatus(id="shadow-ctr", state=cri.CONTAINER_RUNNING, started_at=5_000)
    answer = route.handle(body(r.id), ctx())
    assert cri.StartContainerResponse.FromString(answer) == cri.StartContainerResponse()
    assert host.calls == [("StartShadow", ORIGIN, r.key)]
    assert containerd.calls == []
    shown = status_of(fabric, r.id)
    assert (shown.state, shown.started_at) == (cri.CONTAINER_RUNNING, 5_000)
    assert cri.ContainerStatus.FromString(fabric.store.placement(r.id).status).state == cri.CONTAINER_RUNNING, \
        "kept for a restarted agent"


def test_starting_a_remote_container_starts_copying_its_log(fabric, route, remote) -> None:
    started = []
    fabric.origin.events.started.append(started.append)
    route.handle(body(remote.id), ctx())
    assert started == [remote]


def test_a_container_lost_with_its_host_cannot_be_started(fabric, host, route, remote) -> None:
    fabric.remotes.mark_lost(remote, 90.0)
    with pytest.raises(CannotStart) as err:
        route.handle(body(remote.id), ctx())
    assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "lost with its host cpu-1" in err.value.message
    assert host.calls == []


def test_a_host_that_is_no_peer_now_is_unavailable(mesh, route, remote) -> None:
    mesh.hosts.clear()
    with pytest.raises(HostUnavailable) as err:
        route.handle(body(remote.id), ctx())
    assert err.value.code is grpc.StatusCode.UNAVAILABLE and "cpu-1" in err.value.message


def test_a_host_that_does_not_answer_is_unavailable_and_no_log_copy_starts(fabric, host, route, remote) -> None:
    started = []
    fabric.origin.events.started.append(started.append)
    host.answers["StartShadow"] = PeerUnavailable("peer cpu-1 did not answer StartShadow (UNAVAILABLE)", node="cpu-1")
    with pytest.raises(PeerUnavailable) as err:
        route.handle(body(remote.id), ctx())
    assert err.value.code is grpc.StatusCode.UNAVAILABLE
    assert started == []
