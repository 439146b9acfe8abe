"""What the container verbs share: the test's host keeps to PeerClient's interface, and an absent host is typed."""

from __future__ import annotations

import inspect

import grpc
import pytest

from shim.cri.verbs.remote_calls import client_for
from shim.errors import HostUnavailable
from shim.mesh.client import PeerClient
from tests.cri.verbs.fakes import FakeHost

USED = ("start_shadow", "shadow_status", "remove_shadow", "call", "admit", "run_shadow")


@pytest.mark.parametrize("name", USED)
def test_the_fake_host_answers_as_peerclient_is_called(name: str) -> None:
    real = inspect.signature(getattr(PeerClient, name))
    fake = inspect.signature(getattr(FakeHost, name))
    assert list(fake.parameters) == list(real.parameters)


def test_the_hosts_client_is_the_meshs_client_for_its_node(fabric, mesh, remote) -> None:
    assert client_for(fabric, remote) is mesh.hosts["cpu-1"]


@pytest.mark.parametrize("why", ["no-mesh", "not-a-peer"])
def test_a_host_that_is_not_a_peer_now_is_unavailable(fabric, mesh, remote, why) -> None:
    if why == "no-mesh":
        fabric.origin = None
    else:
        mesh.hosts.clear()
    with pytest.raises(HostUnavailable) as err:
        client_for(fabric, remote)
    assert err.value.code is grpc.StatusCode.UNAVAILABLE and "cpu-1" in err.value.message
