"""Attach and Exec (streaming): a remote container's session is made on its host and reached through this
node's streaming relay.

kubelet gets a URL of the origin's relay, never the host's (which it could
not reach, and which names the shadow). A container lost with its host has
nothing to attach to (FAILED_PRECONDITION); an agent without a streaming
relay cannot serve the session at all. The two verbs differ only in their
messages, so each case runs for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import attach, exec_stream
from shim.errors import CannotStart, NoStreamServer
from shim.mesh.client import PeerUnavailable
from tests.cri.verbs.fakes import LOCAL_ID, ORIGIN, ctx


@dataclass(frozen=True)
class Verb:
    name: str  # the CRI method
    kind: str  # the relay's session kind, and the URL's path
    module: ModuleType
    request: Any
    response: Any
    fields: dict

    def body(self, container_id: str) -> bytes:
        return self.request(container_id=container_id, **self.fields).SerializeToString()

    @property
    def host_url(self) -> str:
        return f"http://10.0.0.2:10010/{self.kind}/shadow-token"


VERBS = [
    Verb("Attach", "attach", attach, cri.AttachRequest, cri.AttachResponse,
         {"stdin": True, "stdout": True, "tty": True}),
    Verb("Exec", "exec", exec_stream, cri.ExecRequest, cri.ExecResponse,
         {"cmd": ["sh"], "tty": True, "stdin": True, "stdout": True}),
]


@pytest.fixture(params=VERBS, ids=[v.name for v in VERBS])
def verb(request) -> Verb:
    return request.param


@pytest.fixture
def route(fabric, verb: Verb):
    return verb.module.route(fabric)


def test_a_local_containers_session_is_containerds_unchanged(fabric, containerd, host, route, remote, verb) -> None:
    containerd.answer(verb.name, verb.response(url=f"http://127.0.0.1:10010/{verb.kind}/local"))
    answer = route.handle(verb.body(LOCAL_ID), ctx())
    assert containerd.only_request(verb.name) == verb.body(LOCAL_ID)
    assert verb.response.FromString(answer).url == f"http://127.0.0.1:10010/{verb.kind}/local"
    assert host.calls == [] and fabric.origin.streams.sessions == []


def test_a_remote_containers_session_is_made_on_its_host_and_kubelet_gets_the_relays_url(
        fabric, containerd, host, route, remote, verb) -> None:
    host.answers[verb.name] = verb.response(url=verb.host_url)
    url = verb.response.FromString(route.handle(verb.body(remote.id), ctx())).url
    assert host.calls == [(verb.name, ORIGIN, remote.key)]
    assert host.requests[verb.name] == [verb.body(remote.id)]
    assert fabric.origin.streams.sessions == [(verb.kind, remote.id, verb.host_url)], \
        "the relay leads to the host's session"
    assert url == f"http://10.0.0.1:10010/{verb.kind}/token1" and url != verb.host_url
    assert containerd.calls == []


def test_a_container_lost_with_its_host_has_no_session(fabric, host, route, remote, verb) -> None:
    fabric.remotes.mark_lost(remote, 90.0)
    with pytest.raises(CannotStart) as err:
        route.handle(verb.body(remote.id), ctx())
    assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert host.calls == []


def test_an_agent_without_a_streaming_relay_refuses_the_session(fabric, host, route, remote, verb) -> None:
    fabric.origin.streams = None
    with pytest.raises(NoStreamServer) as err:
        route.handle(verb.body(remote.id), ctx())
    assert err.value.code is grpc.StatusCode.UNKNOWN and "relays no streams" in err.value.message
    assert host.calls == []


def test_a_host_that_does_not_answer_is_unavailable(fabric, host, route, remote, verb) -> None:
    host.answers[verb.name] = PeerUnavailable(f"peer cpu-1 did not answer {verb.name}", node="cpu-1")
    with pytest.raises(PeerUnavailable) as err:
        route.handle(verb.body(remote.id), ctx())
    assert err.value.code is grpc.StatusCode.UNAVAILABLE
    assert fabric.origin.streams.sessions == []
