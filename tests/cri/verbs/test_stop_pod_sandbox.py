"""StopPodSandbox: containerd stops the pod's local containers; weft kills its remote ones on their hosts.

Intercepted only while this node has remote containers, and then only for a
sandbox that has some. Remote containers are stopped at once (kubelet gave
them their grace period before); those exited or lost are left alone; a host
that cannot be reached fails the call, and kubelet retries.
"""

from __future__ import annotations

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import stop_pod_sandbox
from shim.errors import RemoteStopFailed, UpstreamError
from shim.mesh.client import PeerUnavailable
from tests.cri.verbs.fakes import ORIGIN, OTHER_SANDBOX, SANDBOX, FakeHost, add_remote, ctx


def body(sandbox_id: str = SANDBOX) -> bytes:
    return cri.StopPodSandboxRequest(pod_sandbox_id=sandbox_id).SerializeToString()


@pytest.fixture
def route(fabric):
    return stop_pod_sandbox.route(fabric)


def test_a_sandbox_without_remote_containers_is_stopped_by_containerd_unchanged(containerd, host, route,
                                                                               remote) -> None:
    route.handle(body(OTHER_SANDBOX), ctx())
    assert containerd.only_request("StopPodSandbox") == body(OTHER_SANDBOX)
    assert host.calls == []


def test_the_pods_running_remote_containers_are_killed_on_their_hosts(fabric, containerd, host, route,
                                                                      mesh) -> None:
    running, exited = add_remote(fabric, "tokenize"), add_remote(fabric, "init", state=cri.CONTAINER_EXITED)
    lost = add_remote(fabric, "detok")
    fabric.remotes.mark_lost(lost, 90.0)
    host.status = cri.ContainerStatus(id="shadow-ctr", state=cri.CONTAINER_EXITED, exit_code=137)
    answer = route.handle(body(), ctx())
    assert containerd.only_request("StopPodSandbox") == body(), "containerd stops the local part, as kubelet asked"
    assert cri.StopPodSandboxResponse.FromString(answer) == cri.StopPodSandboxResponse()
    assert host.calls == [("StopContainer", ORIGIN, running.key), ("ShadowStatus", ORIGIN, running.key)]
    stop = cri.StopContainerRequest.FromString(host.requests["StopContainer"][0])
    assert (stop.container_id, stop.timeout) == (running.id, 0)
    assert running.state == cri.CONTAINER_EXITED and exited.exited and lost.lost


def test_remote_containers_on_several_hosts_are_all_stopped(fabric, mesh, route) -> None:
    mesh.hosts["cpu-2"] = FakeHost("cpu-2")
    a, b = add_remote(fabric, "a"), add_remote(fabric, "b", node="cpu-2")
    route.handle(body(), ctx())
    assert [k for m, _, k in mesh.hosts["cpu-1"].calls if m == "StopContainer"] == [a.key]
    assert [k for m, _, k in mesh.hosts["cpu-2"].calls if m == "StopContainer"] == [b.key]


def test_a_host_that_cannot_be_reached_fails_the_stop_naming_the_container(fabric, containerd, host, route,
                                                                           remote) -> None:
    host.answers["StopContainer"] = PeerUnavailable("peer cpu-1 did not answer StopContainer", node="cpu-1")
    with pytest.raises(RemoteStopFailed) as err:
        route.handle(body(), ctx())
    assert err.value.code is grpc.StatusCode.UNAVAILABLE
    assert "tokenize on cpu-1" in err.value.message
    assert containerd.verbs() == ["StopPodSandbox"]


def test_containerds_refusal_is_handed_on_and_no_host_is_asked(containerd, host, route, remote) -> None:
    containerd.refuse("StopPodSandbox", grpc.StatusCode.DEADLINE_EXCEEDED, "stop timed out")
    with pytest.raises(UpstreamError) as err:
        route.handle(body(), ctx())
    assert err.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert host.calls == []
