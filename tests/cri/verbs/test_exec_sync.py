"""ExecSync: a command in a remote container runs on its host; stdout, stderr and exit code come back unchanged.

Probes are ExecSync calls: their timeout is kubelet's deadline, or the
command's own timeout and some slack, or an hour when neither is set.
"""

from __future__ import annotations

import time

import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.relay.context import RelayContext
from shim.cri.verbs import exec_sync
from tests.cri.verbs.fakes import LOCAL_ID, ORIGIN, ctx


def body(container_id: str, timeout: int = 0) -> bytes:
    return cri.ExecSyncRequest(container_id=container_id, cmd=["cat", "/tmp/ready"], timeout=timeout
                               ).SerializeToString()


@pytest.fixture
def route(fabric):
    return exec_sync.route(fabric)


def test_a_local_containers_command_runs_in_containerd_unchanged(containerd, host, route, remote) -> None:
    containerd.answer("ExecSync", cri.ExecSyncResponse(stdout=b"local", exit_code=0))
    answer = route.handle(body(LOCAL_ID, timeout=1), ctx())
    assert containerd.only_request("ExecSync") == body(LOCAL_ID, timeout=1)
    assert cri.ExecSyncResponse.FromString(answer).stdout == b"local" and host.calls == []


def test_a_remote_containers_command_runs_on_its_host_and_its_output_comes_back(containerd, host, route,
                                                                                remote) -> None:
    host.answers["ExecSync"] = cri.ExecSyncResponse(stdout=b"ok\n", stderr=b"warn\n", exit_code=3)
    answer = cri.ExecSyncResponse.FromString(route.handle(body(remote.id, timeout=1), ctx()))
    assert (answer.stdout, answer.stderr, answer.exit_code) == (b"ok\n", b"warn\n", 3)
    assert host.calls == [("ExecSync", ORIGIN, remote.key)]
    assert host.requests["ExecSync"] == [body(remote.id, timeout=1)], "the command as kubelet sent it"
    assert containerd.calls == []


@pytest.mark.parametrize(
    ("command_timeout", "expected"),
    [pytest.param(5, 20, id="command-timeout-plus-slack"), pytest.param(0, exec_sync.NO_TIMEOUT_S, id="no-timeout")],
)
def test_without_a_deadline_the_call_waits_for_the_command(host, route, remote, command_timeout, expected) -> None:
    route.handle(body(remote.id, timeout=command_timeout), ctx())
    assert host.timeouts["ExecSync"] == [expected]


def test_kubelets_deadline_bounds_the_call_to_the_host(host, route, remote) -> None:
    route.handle(body(remote.id, timeout=60), RelayContext([], time.monotonic() + 8.0))
    [waited] = host.timeouts["ExecSync"]
    assert 0 < waited <= 8.0
