"""What every verb that acts on one container has in common: it is weft's only while this node has remote
containers, and then only for a remote container's request; anything else goes to containerd unchanged.

One module for all of them (each verb's own module tests what it does with what it takes).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import (
    attach,
    container_stats,
    container_status,
    exec_stream,
    exec_sync,
    reopen_container_log,
    start_container,
    stop_container,
    stop_pod_sandbox,
    update_container_resources,
)
from tests.cri.verbs.fakes import SANDBOX, add_remote

LOCAL_ID = "1c" * 32
OTHER_SANDBOX = "07" * 32

BY_CONTAINER: dict[ModuleType, Callable[..., object]] = {
    attach: cri.AttachRequest,
    container_stats: cri.ContainerStatsRequest,
    container_status: cri.ContainerStatusRequest,
    exec_stream: lambda container_id: cri.ExecRequest(container_id=container_id, cmd=["sh"]),
    exec_sync: lambda container_id: cri.ExecSyncRequest(container_id=container_id, cmd=["true"]),
    reopen_container_log: cri.ReopenContainerLogRequest,
    start_container: cri.StartContainerRequest,
    stop_container: cri.StopContainerRequest,
    update_container_resources: cri.UpdateContainerResourcesRequest,
}
VERBS = [*BY_CONTAINER, stop_pod_sandbox]


def _name(verb: ModuleType) -> str:
    return verb.__name__.rsplit(".", 1)[-1]


@pytest.mark.parametrize("verb", VERBS, ids=_name)
def test_not_intercepted_while_this_node_has_no_remote_containers(fabric, mesh, verb: ModuleType) -> None:
    route = verb.route(fabric)
    assert not route.applies()
    add_remote(fabric)
    assert route.applies()


@pytest.mark.parametrize("verb", list(BY_CONTAINER), ids=_name)
def test_only_a_remote_containers_request_is_wefts(fabric, remote, verb: ModuleType) -> None:
    route = verb.route(fabric)
    request = BY_CONTAINER[verb]
    assert route.pick(request(container_id=remote.id).SerializeToString())
    assert not route.pick(request(container_id=LOCAL_ID).SerializeToString())


def test_only_a_sandbox_with_remote_containers_is_wefts(fabric, remote) -> None:
    route = stop_pod_sandbox.route(fabric)
    assert route.pick(cri.StopPodSandboxRequest(pod_sandbox_id=SANDBOX).SerializeToString())
    assert not route.pick(cri.StopPodSandboxRequest(pod_sandbox_id=OTHER_SANDBOX).SerializeToString())
