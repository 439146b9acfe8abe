"""What the four list verbs share: a host's shadows left out, so its kubelet never sees (or kills) them.

ListPodSandbox, ListContainers, ListPodSandboxStats and ListContainerStats are intercepted only while this
node hosts shadows or has remote containers; kubelet's request reaches containerd unchanged, what is kept is
kept whole and in order, and a list with no shadow in it comes back byte for byte. What each verb adds (an
origin's remote containers, their usage) is in its own module's tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import list_container_stats, list_containers, list_pod_sandbox, list_pod_sandbox_stats
from shim.crishared.labels import ORIGIN_LABEL
from tests.cri.verbs.fakes import add_remote, ctx

Items = list[tuple[str, dict]]


@dataclass(frozen=True)
class ListVerb:
    name: str
    module: ModuleType
    request: bytes
    answer: Callable[[Items], Any]  # containerd's answer holding these (ID, labels)
    ids: Callable[[bytes], list[str]]


def _sandboxes(items: Items) -> cri.ListPodSandboxResponse:
    return cri.ListPodSandboxResponse(items=[cri.PodSandbox(id=i, labels=lb, state=cri.SANDBOX_READY)
                                             for i, lb in items])


def _containers(items: Items) -> cri.ListContainersResponse:
    return cri.ListContainersResponse(containers=[cri.Container(id=i, labels=lb, state=cri.CONTAINER_RUNNING)
                                                  for i, lb in items])


def _sandbox_stats(items: Items) -> cri.ListPodSandboxStatsResponse:
    return cri.ListPodSandboxStatsResponse(stats=[cri.PodSandboxStats(
        attributes=cri.PodSandboxAttributes(id=i, labels=lb),
        linux=cri.LinuxPodSandboxStats(cpu=cri.CpuUsage(timestamp=1))) for i, lb in items])


def _container_stats(items: Items) -> cri.ListContainerStatsResponse:
    return cri.ListContainerStatsResponse(stats=[cri.ContainerStats(
        attributes=cri.ContainerAttributes(id=i, labels=lb),
        cpu=cri.CpuUsage(timestamp=1, usage_core_nano_seconds=cri.UInt64Value(value=77))) for i, lb in items])


VERBS = [
    ListVerb("ListPodSandbox", list_pod_sandbox,
             cri.ListPodSandboxRequest(filter=cri.PodSandboxFilter(label_selector={"app": "web"})).SerializeToString(),
             _sandboxes, lambda a: [s.id for s in cri.ListPodSandboxResponse.FromString(a).items]),
    ListVerb("ListContainers", list_containers,
             cri.ListContainersRequest(filter=cri.ContainerFilter(label_selector={"app": "web"})).SerializeToString(),
             _containers, lambda a: [c.id for c in cri.ListContainersResponse.FromString(a).containers]),
    ListVerb("ListPodSandboxStats", list_pod_sandbox_stats,
             cri.ListPodSandboxStatsRequest(filter=cri.PodSandboxStatsFilter(id="own")).SerializeToString(),
             _sandbox_stats, lambda a: [s.attributes.id for s in cri.ListPodSandboxStatsResponse.FromString(a).stats]),
    ListVerb("ListContainerStats", list_container_stats,
             cri.ListContainerStatsRequest(filter=cri.ContainerStatsFilter()).SerializeToString(),
             _container_stats, lambda a: [s.attributes.id for s in cri.ListContainerStatsResponse.FromString(a).stats]),
]
MIXED: Items = [("own-1", {"app": "web"}), ("shadow-1", {ORIGIN_LABEL: "gpu-1", "app": "web"}), ("own-2", {})]


@pytest.fixture(params=VERBS, ids=[v.name for v in VERBS])
def verb(request) -> ListVerb:
    return request.param


@pytest.fixture
def route(fabric, containerd, verb: ListVerb):
    containerd.answer(verb.name, verb.answer(MIXED))
    return verb.module.route(fabric)


def test_not_intercepted_on_a_node_without_shadows_or_remote_containers(fabric, mesh, route) -> None:
    assert not route.applies()
    fabric.shadows.present = True
    assert route.applies()
    fabric.shadows.present = False
    add_remote(fabric)
    assert route.applies()


def test_a_hosts_shadows_are_left_out_and_the_rest_kept_whole_in_order(fabric, containerd, route, verb) -> None:
    fabric.shadows.present = True
    answer = route.handle(verb.request, ctx(("x-request-id", "3")))
    assert containerd.only_request(verb.name) == verb.request, "kubelet's filter reaches containerd unchanged"
    assert containerd.calls[0].metadata["x-request-id"] == "3"
    assert verb.ids(answer) == ["own-1", "own-2"]
    whole = verb.answer([MIXED[0], MIXED[2]]).SerializeToString()
    assert answer == whole, "what is kept is kept whole"


def test_a_list_without_shadows_comes_back_byte_for_byte(fabric, containerd, route, verb) -> None:
    fabric.shadows.present = True
    plain = verb.answer([("own-1", {"app": "web"})]).SerializeToString()
    containerd.answer(verb.name, plain)
    assert route.handle(verb.request, ctx()) == plain
