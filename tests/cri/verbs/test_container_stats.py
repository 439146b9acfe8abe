"""ContainerStats: a remote container's usage is measured on its host and shown under kubelet's ID and labels.

Once the container is lost with its host there is no usage to measure: its
attributes alone are shown, without asking anyone.
"""

from __future__ import annotations

import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import container_stats
from shim.crishared.labels import ORIGIN_LABEL
from tests.cri.verbs.fakes import LOCAL_ID, ORIGIN, ctx


def body(container_id: str) -> bytes:
    return cri.ContainerStatsRequest(container_id=container_id).SerializeToString()


def hosts_stats() -> cri.ContainerStatsResponse:
    """What the host's containerd says: the shadow's own ID, name and labels, and real usage."""
    return cri.ContainerStatsResponse(stats=cri.ContainerStats(
        attributes=cri.ContainerAttributes(id="shadow-ctr", metadata=cri.ContainerMetadata(name="gpu-1_tokenize"),
                                           labels={ORIGIN_LABEL: ORIGIN}),
        cpu=cri.CpuUsage(timestamp=42, usage_core_nano_seconds=cri.UInt64Value(value=123_456)),
        memory=cri.MemoryUsage(timestamp=42, working_set_bytes=cri.UInt64Value(value=64 << 20))))


@pytest.fixture
def route(fabric):
    return container_stats.route(fabric)


def test_a_local_containers_stats_are_containerds_unchanged(containerd, host, route, remote) -> None:
    containerd.answer("ContainerStats", hosts_stats())
    assert route.handle(body(LOCAL_ID), ctx()) == hosts_stats().SerializeToString()
    assert containerd.only_request("ContainerStats") == body(LOCAL_ID)
    assert host.calls == []


def test_a_remote_containers_usage_comes_from_its_host_under_kubelets_attributes(containerd, host, route,
                                                                                 remote) -> None:
    host.answers["ContainerStats"] = hosts_stats()
    stats = cri.ContainerStatsResponse.FromString(route.handle(body(remote.id), ctx())).stats
    assert stats.attributes.id == remote.id and stats.attributes.metadata.name == "tokenize"
    assert dict(stats.attributes.labels) == dict(remote.config.labels)
    assert dict(stats.attributes.annotations) == dict(remote.config.annotations)
    assert stats.cpu.usage_core_nano_seconds.value == 123_456
    assert stats.memory.working_set_bytes.value == 64 << 20
    assert host.calls == [("ContainerStats", ORIGIN, remote.key)]
    assert cri.ContainerStatsRequest.FromString(host.requests["ContainerStats"][0]).container_id == remote.id
    assert containerd.calls == []


def test_a_container_lost_with_its_host_shows_its_attributes_alone(fabric, host, route, remote) -> None:
    fabric.remotes.mark_lost(remote, 90.0)
    stats = cri.ContainerStatsResponse.FromString(route.handle(body(remote.id), ctx())).stats
    assert stats.attributes.id == remote.id
    assert not stats.HasField("cpu") and not stats.HasField("memory")
    assert host.calls == []
