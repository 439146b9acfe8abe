"""ListContainerStats: each remote container's usage measured on its host, under kubelet's ID.

A host away for a moment, or a container lost with its host, leaves that
container in the list with its attributes alone: kubelet's summary keeps
every container it knows.
"""

from __future__ import annotations

import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import list_container_stats
from shim.crishared.labels import ORIGIN_LABEL
from shim.mesh.client import PeerUnavailable
from tests.cri.verbs.fakes import ORIGIN, OTHER_SANDBOX, SANDBOX, add_remote, ctx


def entry(cid: str, labels: dict) -> cri.ContainerStats:
    return cri.ContainerStats(attributes=cri.ContainerAttributes(id=cid, labels=labels),
                              cpu=cri.CpuUsage(timestamp=1, usage_core_nano_seconds=cri.UInt64Value(value=77)))


LOCAL = entry("local-1", {"app": "web"})
SHADOW = entry("shadow-1", {ORIGIN_LABEL: "gpu-1"})


def body(**filter_fields) -> bytes:
    return cri.ListContainerStatsRequest(filter=cri.ContainerStatsFilter(**filter_fields)).SerializeToString()


def listed(answer: bytes) -> list[cri.ContainerStats]:
    return list(cri.ListContainerStatsResponse.FromString(answer).stats)


@pytest.fixture
def route(fabric, containerd):
    containerd.answer("ListContainerStats", cri.ListContainerStatsResponse(stats=[LOCAL, SHADOW]))
    return list_container_stats.route(fabric)


def test_a_remote_containers_usage_is_measured_on_its_host_and_shown_under_kubelets_attributes(
        fabric, containerd, host, route, remote) -> None:
    containerd.answer("ListContainerStats", cri.ListContainerStatsResponse(stats=[LOCAL]))
    host.answers["ContainerStats"] = cri.ContainerStatsResponse(stats=entry("shadow-ctr", {ORIGIN_LABEL: ORIGIN}))
    stats = listed(route.handle(body(), ctx()))
    assert [s.attributes.id for s in stats] == ["local-1", remote.id]
    assert dict(stats[1].attributes.labels) == dict(remote.config.labels)
    assert stats[1].cpu.usage_core_nano_seconds.value == 77
    assert host.calls == [("ContainerStats", ORIGIN, remote.key)]


def test_a_host_away_for_a_moment_leaves_its_containers_listed_without_usage(fabric, containerd, host, route,
                                                                             remote) -> None:
    host.answers["ContainerStats"] = PeerUnavailable("peer cpu-1 did not answer ContainerStats", node="cpu-1")
    stats = listed(route.handle(body(), ctx()))
    assert [s.attributes.id for s in stats] == ["local-1", "shadow-1", remote.id]
    assert not stats[2].HasField("cpu") and stats[2].attributes.metadata.name == "tokenize"


def test_a_container_lost_with_its_host_is_listed_without_asking_the_host(fabric, host, route, remote) -> None:
    fabric.remotes.mark_lost(remote, 90.0)
    stats = listed(route.handle(body(), ctx()))
    assert stats[-1].attributes.id == remote.id and not stats[-1].HasField("cpu")
    assert host.calls == []


@pytest.mark.parametrize(
    ("filter_fields", "shown"),
    [
        pytest.param({"pod_sandbox_id": SANDBOX}, ["tokenize"], id="sandbox"),
        pytest.param({"label_selector": {"tier": "back"}}, ["other"], id="label"),
        pytest.param({"id": "nope"}, [], id="unknown-id"),
    ],
)
def test_remote_containers_pass_kubelets_filter(fabric, containerd, mesh, route, filter_fields, shown) -> None:
    containerd.answer("ListContainerStats", cri.ListContainerStatsResponse())
    add_remote(fabric, "tokenize")
    add_remote(fabric, "other", sandbox_id=OTHER_SANDBOX, labels={"tier": "back"})
    stats = listed(route.handle(body(**filter_fields), ctx()))
    assert sorted(s.attributes.metadata.name for s in stats) == shown
