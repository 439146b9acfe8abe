"""ListPodSandbox: an origin's remote containers live in its own sandboxes, so none is added.

Shadows left out, as in every list verb: ``test_list_verbs``.
"""

from __future__ import annotations

import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import list_pod_sandbox
from shim.crishared.labels import ORIGIN_LABEL
from tests.cri.verbs.fakes import SANDBOX, ctx

REQUEST = cri.ListPodSandboxRequest(filter=cri.PodSandboxFilter(label_selector={"app": "web"})).SerializeToString()


def listed(*items: tuple[str, dict]) -> cri.ListPodSandboxResponse:
    return cri.ListPodSandboxResponse(items=[cri.PodSandbox(id=i, labels=lb, state=cri.SANDBOX_READY)
                                             for i, lb in items])


MIXED = listed(("own-1", {"app": "web"}), ("shadow-1", {ORIGIN_LABEL: "gpu-1", "app": "web"}), ("own-2", {}))


@pytest.fixture
def route(fabric, containerd):
    containerd.answer("ListPodSandbox", MIXED)
    return list_pod_sandbox.route(fabric)


def ids(answer: bytes) -> list[str]:
    return [s.id for s in cri.ListPodSandboxResponse.FromString(answer).items]


def test_an_origins_remote_containers_add_no_sandbox(fabric, route, remote) -> None:
    assert route.applies()
    assert ids(route.handle(REQUEST, ctx())) == ["own-1", "shadow-1", "own-2"]
    assert SANDBOX not in ids(route.handle(REQUEST, ctx()))
