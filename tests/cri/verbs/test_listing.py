"""Removing shadows from List responses: only items labelled as shadows go, everything else is kept as it was."""

import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs.listing import PATHS, without_shadows
from shim.crishared.labels import ORIGIN_LABEL

_SHADOW = {ORIGIN_LABEL: "gpu-1"}


def _response(path: str, labelled: list[dict[str, str]]) -> bytes:
    if path.endswith("/ListPodSandbox"):
        return cri.ListPodSandboxResponse(items=[cri.PodSandbox(id=f"s{i}", labels=lb)
                                                 for i, lb in enumerate(labelled)]).SerializeToString()
    if path.endswith("/ListContainers"):
        return cri.ListContainersResponse(containers=[cri.Container(id=f"s{i}", labels=lb)
                                                      for i, lb in enumerate(labelled)]).SerializeToString()
    if path.endswith("/ListContainerStats"):
        return cri.ListContainerStatsResponse(stats=[cri.ContainerStats(
            attributes=cri.ContainerAttributes(id=f"s{i}", labels=lb)) for i, lb in enumerate(labelled)]
        ).SerializeToString()
    return cri.ListPodSandboxStatsResponse(stats=[cri.PodSandboxStats(
        attributes=cri.PodSandboxAttributes(id=f"s{i}", labels=lb)) for i, lb in enumerate(labelled)]
    ).SerializeToString()


@pytest.mark.parametrize("path", PATHS, ids=[p.rsplit("/", 1)[1] for p in PATHS])
def test_only_shadows_are_dropped(path: str) -> None:
    body = _response(path, [{"app": "a"}, _SHADOW, {}, {**_SHADOW, "app": "b"}])
    assert _ids(path, without_shadows(body, path)) == ["s0", "s2"]


def _ids(path: str, body: bytes) -> list[str]:
    if path.endswith("/ListPodSandbox"):
        return [i.id for i in cri.ListPodSandboxResponse.FromString(body).items]
    if path.endswith("/ListContainers"):
        return [i.id for i in cri.ListContainersResponse.FromString(body).containers]
    if path.endswith("/ListContainerStats"):
        return [i.attributes.id for i in cri.ListContainerStatsResponse.FromString(body).stats]
    return [i.attributes.id for i in cri.ListPodSandboxStatsResponse.FromString(body).stats]


@pytest.mark.parametrize("path", PATHS, ids=[p.rsplit("/", 1)[1] for p in PATHS])
def test_responses_without_shadows_are_returned_byte_for_byte(path: str) -> None:
    body = _response(path, [{"app": "a"}, {}])
    assert without_shadows(body, path) is body
