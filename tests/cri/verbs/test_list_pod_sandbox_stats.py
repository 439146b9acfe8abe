"""ListPodSandboxStats: an origin's remote containers add no sandbox stats (shadows left out: ``test_list_verbs``)."""

from __future__ import annotations

import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import list_pod_sandbox_stats
from shim.crishared.labels import ORIGIN_LABEL
from tests.cri.verbs.fakes import ctx

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


def test_an_origins_remote_containers_add_no_sandbox_stats(fabric, route, remote) -> None:
    assert ids(route.handle(REQUEST, ctx())) == ["own-1", "shadow-1", "own-2"]
