"""ListPodSandboxStats: a host's shadow sandboxes are left out, as in ListPodSandbox."""

from __future__ import annotations

import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.labels import ORIGIN_LABEL
from shim.cri.verbs import list_pod_sandbox_stats
from tests.cri.verbs.fakes import add_remote, ctx

REQUEST = cri.ListPodSandboxStatsRequest(filter=cri.PodSandboxStatsFilter(id="own")).SerializeToString()


def stats(*items: tuple[str, dict]) -> cri.ListPodSandboxStatsResponse:
    return cri.ListPodSandboxStatsResponse(stats=[cri.PodSandboxStats(
        attributes=cri.PodSandboxAttributes(id=i, labels=lb),
        linux=cri.LinuxPodSandboxStats(cpu=cri.CpuUsage(timestamp=1))) for i, lb in items])


MIXED = stats(("own-1", {"app": "web"}), ("shadow-1", {ORIGIN_LABEL: "gpu-1"}), ("own-2", {}))


@pytest.fixture
def route(fabric, containerd):
    containerd.answer("ListPodSandboxStats", MIXED)
    return list_pod_sandbox_stats.route(fabric)


def ids(answer: bytes) -> list[str]:
    return [s.attributes.id for s in cri.ListPodSandboxStatsResponse.FromString(answer).stats]


def test_not_intercepted_on_a_node_without_shadows_or_remote_containers(fabric, mesh, route) -> None:
    assert not route.applies()
    fabric.shadows.present = True
    assert route.applies()
    fabric.shadows.present = False
    add_remote(fabric)
    assert route.applies()


def test_a_hosts_shadow_sandboxes_are_left_out_and_the_rest_kept_whole(fabric, containerd, route) -> None:
    fabric.shadows.present = True
    answer = route.handle(REQUEST, ctx())
    assert containerd.only_request("ListPodSandboxStats") == REQUEST
    assert ids(answer) == ["own-1", "own-2"]
    assert cri.ListPodSandboxStatsResponse.FromString(answer).stats[0] == MIXED.stats[0]


def test_a_list_without_shadows_comes_back_byte_for_byte(fabric, containerd, route) -> None:
    fabric.shadows.present = True
    plain = stats(("own-1", {}))
    containerd.answer("ListPodSandboxStats", plain)
    assert route.handle(REQUEST, ctx()) == plain.SerializeToString()


def test_an_origins_remote_containers_add_no_sandbox_stats(fabric, route, remote) -> None:
    assert ids(route.handle(REQUEST, ctx())) == ["own-1", "shadow-1", "own-2"]
