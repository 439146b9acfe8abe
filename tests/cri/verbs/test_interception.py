"""What every verb that acts on one container has in common: it is weft's only while this node has remote
containers, and then only for a remote container's request; anything else goes to containerd unchanged.
Those verbs that create or remove are weft's always. A remote container's call its host does not answer is
UNAVAILABLE (kubelet retries), and a container lost with its host is refused as FAILED_PRECONDITION.

One module for all of them (each verb's own module tests what it does with what it takes).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import (
    attach,
    container_stats,
    container_status,
    create_container,
    exec_stream,
    exec_sync,
    remove_container,
    remove_pod_sandbox,
    reopen_container_log,
    run_pod_sandbox,
    start_container,
    stop_container,
    stop_pod_sandbox,
    update_container_resources,
)
from shim.errors import CannotStart
from shim.mesh.client import PeerUnavailable
from tests.cri.verbs.fakes import LOCAL_ID, OTHER_SANDBOX, SANDBOX, add_remote, ctx

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


@pytest.mark.parametrize("verb", [create_container, remove_container, remove_pod_sandbox, run_pod_sandbox], ids=_name)
def test_is_always_intercepted(fabric, verb: ModuleType) -> None:
    route = verb.route(fabric)
    assert route.applies() and route.pick is None


@pytest.mark.parametrize(("verb", "method"), [(container_stats, "ContainerStats"), (stop_container, "StopContainer"),
                                              (update_container_resources, "UpdateContainerResources")],
                         ids=lambda v: v if isinstance(v, str) else _name(v))
def test_a_host_that_does_not_answer_is_unavailable(fabric, host, remote, verb: ModuleType, method: str) -> None:
    host.answers[method] = PeerUnavailable(f"peer cpu-1 did not answer {method}", node="cpu-1")
    with pytest.raises(PeerUnavailable) as err:
        verb.route(fabric).handle(BY_CONTAINER[verb](container_id=remote.id).SerializeToString(), ctx())
    assert err.value.code is grpc.StatusCode.UNAVAILABLE
    assert remote.state == cri.CONTAINER_RUNNING  # a stop that failed leaves it for kubelet to stop again


@pytest.mark.parametrize("verb", [exec_sync, update_container_resources], ids=_name)
def test_a_container_lost_with_its_host_is_refused(fabric, host, remote, verb: ModuleType) -> None:
    fabric.remotes.mark_lost(remote, 90.0)
    with pytest.raises(CannotStart) as err:
        verb.route(fabric).handle(BY_CONTAINER[verb](container_id=remote.id).SerializeToString(), ctx())
    assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert host.calls == []
