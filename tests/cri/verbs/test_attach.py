"""Attach: a remote container's stdio is attached on its host and reached through this node's streaming relay.

kubelet gets a URL of the origin's relay, never the host's (which it could
not reach, and which names the shadow). A container lost with its host has
nothing to attach to (FAILED_PRECONDITION); an agent without a streaming
relay cannot serve the session at all.
"""

from __future__ import annotations

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import attach
from shim.errors import CannotStart, NoStreamServer
from shim.mesh.client import PeerUnavailable
from tests.cri.verbs.fakes import ORIGIN, ctx

LOCAL_ID = "1c" * 32
HOST_URL = "http://10.0.0.2:10010/attach/shadow-token"


def body(container_id: str) -> bytes:
    return cri.AttachRequest(container_id=container_id, stdin=True, stdout=True, tty=True).SerializeToString()


@pytest.fixture
def route(fabric):
    return attach.route(fabric)


def test_a_local_containers_session_is_containerds_unchanged(fabric, containerd, host, route, remote) -> None:
    containerd.answer("Attach", cri.AttachResponse(url="http://127.0.0.1:10010/attach/local"))
    answer = route.handle(body(LOCAL_ID), ctx())
    assert containerd.only_request("Attach") == body(LOCAL_ID)
    assert cri.AttachResponse.FromString(answer).url == "http://127.0.0.1:10010/attach/local"
    assert host.calls == [] and fabric.origin.streams.sessions == []


def test_a_remote_containers_session_is_made_on_its_host_and_kubelet_gets_the_relays_url(
        fabric, containerd, host, route, remote) -> None:
    host.answers["Attach"] = cri.AttachResponse(url=HOST_URL)
    url = cri.AttachResponse.FromString(route.handle(body(remote.id), ctx())).url
    assert host.calls == [("Attach", ORIGIN, remote.key)]
    assert host.requests["Attach"] == [body(remote.id)]
    assert fabric.origin.streams.sessions == [("attach", remote.id, HOST_URL)], "the relay leads to the host's session"
    assert url == "http://10.0.0.1:10010/attach/token1" and url != HOST_URL
    assert containerd.calls == []


def test_a_container_lost_with_its_host_has_no_session(fabric, host, route, remote) -> None:
    fabric.remotes.mark_lost(remote, 90.0)
    with pytest.raises(CannotStart) as err:
        route.handle(body(remote.id), ctx())
    assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert host.calls == []


def test_an_agent_without_a_streaming_relay_refuses_the_session(fabric, host, route, remote) -> None:
    fabric.origin.streams = None
    with pytest.raises(NoStreamServer) as err:
        route.handle(body(remote.id), ctx())
    assert err.value.code is grpc.StatusCode.UNKNOWN and "relays no streams" in err.value.message
    assert host.calls == []


def test_a_host_that_does_not_answer_is_unavailable(fabric, host, route, remote) -> None:
    host.answers["Attach"] = PeerUnavailable("peer cpu-1 did not answer Attach", node="cpu-1")
    with pytest.raises(PeerUnavailable) as err:
        route.handle(body(remote.id), ctx())
    assert err.value.code is grpc.StatusCode.UNAVAILABLE
    assert fabric.origin.streams.sessions == []
