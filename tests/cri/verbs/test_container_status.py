"""ContainerStatus: a remote container's status is answered from what its host pushed, in kubelet's own terms.

Intercepted only while this node has remote containers, and then only for a
remote container's request; a local container's goes to containerd unchanged.
"""

from __future__ import annotations

import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import container_status
from shim.crishared.labels import ORIGIN_LABEL
from shim.crishared.remote import LOST_EXIT_CODE, LOST_REASON
from tests.cri.verbs.fakes import LOCAL_ID, ctx


def body(container_id: str) -> bytes:
    return cri.ContainerStatusRequest(container_id=container_id, verbose=True).SerializeToString()


@pytest.fixture
def route(fabric):
    return container_status.route(fabric)


def test_only_a_remote_containers_request_is_wefts_by_full_id_or_unique_prefix(route, remote) -> None:
    assert route.pick(body(remote.id)) and route.pick(body(remote.id[:12]))
    assert not route.pick(body(LOCAL_ID)) and not route.pick(body(""))


def test_a_local_containers_status_passes_to_containerd_unchanged(containerd, route, remote) -> None:
    containerd.answer("ContainerStatus", cri.ContainerStatusResponse(status=cri.ContainerStatus(id=LOCAL_ID)))
    answer = route.handle(body(LOCAL_ID), ctx(("x-request-id", "7")))
    assert containerd.only_request("ContainerStatus") == body(LOCAL_ID)
    assert containerd.calls[0].metadata["x-request-id"] == "7"
    assert cri.ContainerStatusResponse.FromString(answer).status.id == LOCAL_ID


def test_a_request_that_does_not_parse_is_containerds_to_answer(containerd, route, remote) -> None:
    garbage = b"\x0a\x03\xff\xfe\xfd"
    route.handle(garbage, ctx())
    assert containerd.only_request("ContainerStatus") == garbage


def test_a_remote_container_is_shown_under_kubelets_id_labels_and_log_with_the_hosts_state(
        containerd, host, route, remote) -> None:
    status = cri.ContainerStatusResponse.FromString(route.handle(body(remote.id), ctx())).status
    assert status.id == remote.id
    assert status.metadata.name == "tokenize" and status.image.image == "busybox:1.36"
    assert dict(status.labels) == dict(remote.config.labels) and ORIGIN_LABEL not in status.labels
    assert status.annotations["weft.io/placement"] == "remote:cpu-1"
    assert status.log_path == "/var/log/pods/infer/tokenize/0.log"
    assert status.state == cri.CONTAINER_RUNNING and (status.created_at, status.started_at) == (1_000, 2_000)
    assert status.image_ref.startswith("docker.io/library/busybox@sha256:")
    assert containerd.calls == [] and host.calls == [], "answered from what the host pushed"


def test_a_container_lost_with_its_host_is_exited_with_weft_peer_lost(fabric, route, remote) -> None:
    fabric.remotes.mark_lost(remote, 90.0)
    status = cri.ContainerStatusResponse.FromString(route.handle(body(remote.id), ctx())).status
    assert (status.state, status.reason, status.exit_code) == (cri.CONTAINER_EXITED, LOST_REASON, LOST_EXIT_CODE)
    assert "cpu-1" in status.message and status.finished_at > 0
