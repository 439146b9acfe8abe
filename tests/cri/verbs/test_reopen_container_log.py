"""ReopenContainerLog: kubelet rotated a remote container's log; this node's copy of it starts a new file.

The origin writes that log (the shadow's output, copied), so neither the
host nor containerd is asked.
"""

from __future__ import annotations

import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import reopen_container_log
from tests.cri.verbs.fakes import LOCAL_ID, ctx


def body(container_id: str) -> bytes:
    return cri.ReopenContainerLogRequest(container_id=container_id).SerializeToString()


@pytest.fixture
def route(fabric):
    return reopen_container_log.route(fabric)


def test_a_local_containers_log_is_reopened_by_containerd_unchanged(fabric, containerd, route, remote) -> None:
    reopened = []
    fabric.origin.events.reopened.append(reopened.append)
    route.handle(body(LOCAL_ID), ctx())
    assert containerd.only_request("ReopenContainerLog") == body(LOCAL_ID)
    assert reopened == []


def test_a_remote_containers_log_copy_moves_to_a_new_file_without_asking_anyone(fabric, containerd, host, route,
                                                                                remote) -> None:
    reopened = []
    fabric.origin.events.reopened.append(reopened.append)
    answer = route.handle(body(remote.id), ctx())
    assert cri.ReopenContainerLogResponse.FromString(answer) == cri.ReopenContainerLogResponse()
    assert reopened == [remote]
    assert containerd.calls == [] and host.calls == []
