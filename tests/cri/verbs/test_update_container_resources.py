"""UpdateContainerResources: a remote container's limits change on its host, as kubelet asked."""

from __future__ import annotations

import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import update_container_resources
from tests.cri.verbs.fakes import LOCAL_ID, ORIGIN, ctx


def body(container_id: str) -> bytes:
    return cri.UpdateContainerResourcesRequest(
        container_id=container_id,
        linux=cri.LinuxContainerResources(cpu_period=100_000, cpu_quota=150_000, memory_limit_in_bytes=2 << 30),
    ).SerializeToString()


@pytest.fixture
def route(fabric):
    return update_container_resources.route(fabric)


def test_a_local_containers_update_is_containerds_unchanged(containerd, host, route, remote) -> None:
    route.handle(body(LOCAL_ID), ctx())
    assert containerd.only_request("UpdateContainerResources") == body(LOCAL_ID)
    assert host.calls == []


def test_a_remote_containers_limits_change_on_its_host_as_kubelet_asked(containerd, host, route, remote) -> None:
    answer = route.handle(body(remote.id), ctx())
    assert cri.UpdateContainerResourcesResponse.FromString(answer) == cri.UpdateContainerResourcesResponse()
    assert host.calls == [("UpdateContainerResources", ORIGIN, remote.key)]
    assert host.requests["UpdateContainerResources"] == [body(remote.id)]
    assert containerd.calls == []
