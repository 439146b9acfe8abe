"""RemovePodSandbox: once containerd removed the sandbox, everything weft kept for the pod goes too.

Its record, its containers' placements and their leases, and its remote
containers on their hosts; only after containerd succeeded (or says it has no
such sandbox), so a removal kubelet retries still finds weft's records.
Removing a sandbox nobody knows succeeds, as containerd answers.
"""

from __future__ import annotations

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import remove_pod_sandbox
from shim.errors import UpstreamError
from tests.cri.verbs.fakes import (
    LOCAL_ID,
    ORIGIN,
    OTHER_SANDBOX,
    SANDBOX,
    add_remote,
    ctx,
    lease_for,
    opt_in,
    placed_local,
)


def body(sandbox_id: str = SANDBOX) -> bytes:
    return cri.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id).SerializeToString()


@pytest.fixture
def route(fabric):
    return remove_pod_sandbox.route(fabric)


def test_an_unknown_sandbox_is_containerds_to_remove_and_succeeds(fabric, containerd, route) -> None:
    answer = route.handle(body(OTHER_SANDBOX), ctx())
    assert containerd.only_request("RemovePodSandbox") == body(OTHER_SANDBOX)
    assert cri.RemovePodSandboxResponse.FromString(answer) == cri.RemovePodSandboxResponse()


def test_an_opted_in_pod_leaves_no_record_placement_or_lease(fabric, containerd, broker, route) -> None:
    lease = lease_for(broker)
    placed_local(fabric, LOCAL_ID, lease_id=lease)
    opt_in(fabric, OTHER_SANDBOX, name="other")
    route.handle(body(), ctx())
    assert containerd.only_request("RemovePodSandbox") == body()
    assert fabric.store.sandbox(SANDBOX) is None and fabric.store.placement(LOCAL_ID) is None
    assert SANDBOX not in fabric.opted_in and broker.leases() == []
    assert fabric.metrics.registry.get_sample_value("weft_opted_in_sandboxes") == 1
    assert fabric.store.sandbox(OTHER_SANDBOX) is not None, "other pods are untouched"
    assert OTHER_SANDBOX in fabric.opted_in, "other pods are untouched"


def test_the_pods_remote_containers_are_removed_on_their_hosts(fabric, host, route, mesh) -> None:
    mine = [add_remote(fabric, "tokenize"), add_remote(fabric, "detok")]
    theirs = add_remote(fabric, "other", sandbox_id=OTHER_SANDBOX)
    route.handle(body(), ctx())
    assert sorted(host.calls) == sorted(("RemoveShadow", ORIGIN, r.key) for r in mine)
    assert [r.id for r in fabric.remotes.all()] == [theirs.id]
    assert all(fabric.store.placement(r.id) is None for r in mine)


def test_a_removal_containerd_fails_keeps_everything_for_the_retry(fabric, containerd, broker, host, route,
                                                                   mesh) -> None:
    lease = lease_for(broker)
    placed_local(fabric, LOCAL_ID, lease_id=lease)
    r = add_remote(fabric)
    containerd.refuse("RemovePodSandbox", grpc.StatusCode.UNKNOWN, "failed to remove network namespace")
    with pytest.raises(UpstreamError) as err:
        route.handle(body(), ctx())
    assert (err.value.code, err.value.message) == (grpc.StatusCode.UNKNOWN, "failed to remove network namespace")
    assert fabric.store.sandbox(SANDBOX) is not None and SANDBOX in fabric.opted_in
    assert fabric.store.placement(LOCAL_ID) is not None and [x.lease_id for x in broker.leases()] == [lease]
    assert fabric.remotes.get(r.id) is r and host.calls == []


def test_a_sandbox_containerd_no_longer_has_is_forgotten_and_its_answer_handed_on(fabric, containerd, broker,
                                                                                 route) -> None:
    placed_local(fabric, LOCAL_ID, lease_id=lease_for(broker))
    containerd.refuse("RemovePodSandbox", grpc.StatusCode.NOT_FOUND, "sandbox not found")
    with pytest.raises(UpstreamError) as err:
        route.handle(body(), ctx())
    assert err.value.code is grpc.StatusCode.NOT_FOUND
    assert fabric.store.sandbox(SANDBOX) is None and broker.leases() == []
