"""RemoveContainer: after containerd removes it, weft forgets the container's placement and releases its lease.

A remote container is removed on its host instead, and a host that cannot be
reached does not keep kubelet's removal from finishing. Removing an ID weft
does not know costs nothing and answers what containerd answers (success, per
CRI); a removal containerd fails keeps weft's records for kubelet's retry.
"""

from __future__ import annotations

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import remove_container
from shim.errors import UpstreamError
from shim.mesh.client import PeerUnavailable
from tests.cri.verbs.fakes import LOCAL_ID, ORIGIN, SANDBOX, ctx, lease_for, placed_local


def body(container_id: str) -> bytes:
    return cri.RemoveContainerRequest(container_id=container_id).SerializeToString()


@pytest.fixture
def route(fabric):
    return remove_container.route(fabric)


def test_an_unknown_container_is_containerds_to_remove_and_succeeds(fabric, containerd, route) -> None:
    answer = route.handle(body(LOCAL_ID), ctx(("x-request-id", "9")))
    assert containerd.only_request("RemoveContainer") == body(LOCAL_ID)
    assert containerd.calls[0].metadata["x-request-id"] == "9"
    assert cri.RemoveContainerResponse.FromString(answer) == cri.RemoveContainerResponse()


def test_a_placed_container_is_forgotten_and_its_lease_released(fabric, containerd, broker, route) -> None:
    lease = lease_for(broker)
    placed_local(fabric, LOCAL_ID, lease_id=lease)
    route.handle(body(LOCAL_ID), ctx())
    assert containerd.only_request("RemoveContainer") == body(LOCAL_ID)
    assert fabric.store.placement(LOCAL_ID) is None
    assert broker.leases() == []


def test_a_unique_prefix_removes_the_placement_as_containerd_removes_the_container(fabric, broker, route) -> None:
    lease = lease_for(broker)
    placed_local(fabric, LOCAL_ID, lease_id=lease)
    route.handle(body(LOCAL_ID[:12]), ctx())
    assert fabric.store.placement(LOCAL_ID) is None and broker.leases() == []


def test_an_id_shaped_like_a_placement_key_matches_no_placement(fabric, route) -> None:
    placed = placed_local(fabric, LOCAL_ID)
    route.handle(body(placed.key), ctx())
    assert fabric.store.placement(LOCAL_ID) is not None, "kubelet names containers by ID only"


def test_a_removal_containerd_fails_keeps_weft_records_for_the_retry(fabric, containerd, broker, route) -> None:
    lease = lease_for(broker)
    placed_local(fabric, LOCAL_ID, lease_id=lease)
    containerd.refuse("RemoveContainer", grpc.StatusCode.FAILED_PRECONDITION, "container is running")
    with pytest.raises(UpstreamError) as err:
        route.handle(body(LOCAL_ID), ctx())
    assert (err.value.code, err.value.message) == (grpc.StatusCode.FAILED_PRECONDITION, "container is running")
    assert fabric.store.placement(LOCAL_ID) is not None and [r.lease_id for r in broker.leases()] == [lease]


def test_a_container_containerd_no_longer_has_is_forgotten_and_its_answer_handed_on(fabric, containerd, broker,
                                                                                   route) -> None:
    lease = lease_for(broker)
    placed_local(fabric, LOCAL_ID, lease_id=lease)
    containerd.refuse("RemoveContainer", grpc.StatusCode.NOT_FOUND, "container not found")
    with pytest.raises(UpstreamError) as err:
        route.handle(body(LOCAL_ID), ctx())
    assert err.value.code is grpc.StatusCode.NOT_FOUND
    assert fabric.store.placement(LOCAL_ID) is None and broker.leases() == []


def test_a_broker_that_is_away_does_not_fail_the_removal(fabric, containerd, route) -> None:
    placed_local(fabric, LOCAL_ID, lease_id="lease-the-broker-releases-at-its-next-reconcile")
    assert fabric.broker is None
    route.handle(body(LOCAL_ID), ctx())
    assert fabric.store.placement(LOCAL_ID) is None


# -- remote containers ---------------------------------------------------------------------------
def test_a_remote_container_is_removed_on_its_host_and_here(fabric, containerd, host, route, remote) -> None:
    removed = []
    fabric.origin.events.removed.append(removed.append)
    answer = route.handle(body(remote.id), ctx())
    assert cri.RemoveContainerResponse.FromString(answer) == cri.RemoveContainerResponse()
    assert host.calls == [("RemoveShadow", ORIGIN, remote.key)]
    assert containerd.calls == [], "containerd never had it"
    assert fabric.remotes.get(remote.id) is None and fabric.store.placement(remote.id) is None
    assert removed == [remote], "its log copy stops"
    assert fabric.store.sandbox(SANDBOX) is not None, "the pod stays opted in"


def test_removing_a_remote_container_again_succeeds(fabric, containerd, host, route, remote) -> None:
    route.handle(body(remote.id), ctx())
    answer = route.handle(body(remote.id), ctx())
    assert cri.RemoveContainerResponse.FromString(answer) == cri.RemoveContainerResponse()
    assert containerd.only_request("RemoveContainer") == body(remote.id)
    assert host.methods() == ["RemoveShadow"]


@pytest.mark.parametrize("away", ["unreachable", "no-longer-a-peer"])
def test_a_host_that_cannot_be_reached_does_not_keep_the_removal_from_finishing(fabric, mesh, host, route, remote,
                                                                                away) -> None:
    if away == "unreachable":
        host.answers["RemoveShadow"] = PeerUnavailable("peer cpu-1 did not answer RemoveShadow", node="cpu-1")
    else:
        mesh.hosts.clear()
    answer = route.handle(body(remote.id), ctx())
    assert cri.RemoveContainerResponse.FromString(answer) == cri.RemoveContainerResponse()
    assert fabric.remotes.get(remote.id) is None and fabric.store.placement(remote.id) is None
