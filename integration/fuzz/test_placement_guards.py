"""Two ways the fuzz suite once got past weft's placement, now closed.

A CreateContainer that protobuf cannot parse (invalid UTF-8 in a label) but
containerd would accept must not create a container of an opted-in pod
without a placement and a lease; and RemoveContainer with a placement *key*
instead of a container ID must not forget a live container's placement.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from integration.fuzz import wire
from integration.fuzz.agent_fixture import GPU_ENV, FuzzFabric, call, fuzz_fabric
from shim.localfabric import pods


@pytest.fixture(scope="module")
def fab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzFabric]:
    yield from fuzz_fabric(tmp_path_factory.mktemp("open-bugs"))


def test_a_container_of_an_opted_in_pod_is_never_created_unplaced(fab: FuzzFabric) -> None:
    """Invalid UTF-8 in a label: protobuf cannot parse the request, containerd (gogo protobuf, no UTF-8 check)
    would create the GPU container unplaced; weft refuses it, naming the sandbox."""
    ccfg = pods.container_config("fz", ["sleep", "3600"], envs=GPU_ENV)
    valid = cri.CreateContainerRequest(pod_sandbox_id=fab.sandbox_id, config=ccfg,
                                       sandbox_config=fab.sandbox_config).SerializeToString()
    raw = valid + wire.nest(wire.number_of(cri.CreateContainerRequest, "config"),
                            wire.map_entry(wire.number_of(cri.ContainerConfig, "labels")[0], b"bad", b"\xff"))
    out = call(fab.channel, "/runtime.v1.RuntimeService/CreateContainer", raw)
    assert out.response is None and "opted-in sandbox" in out.details, out
    if out.response is not None:
        cid = cri.CreateContainerResponse.FromString(out.response).container_id
        explained = call(fab.channel, "/weft.agent.v1.Admin/Explain", cid.encode())
        leases = fab.broker.leases()
        fab.remove_container(cid)
        assert explained.response is not None and leases, "created in an opted-in pod without placement or lease"


def test_remove_container_by_placement_key_keeps_a_live_containers_lease(fab: FuzzFabric) -> None:
    """RemoveContainer("<sandbox>/<name>/<attempt>"): containerd knows no such ID and succeeds (idempotent);
    the agent's lookup also matches placement *keys*, so it forgets the live container and releases its lease."""
    rt = cri_grpc.RuntimeServiceStub(fab.channel)
    ccfg = pods.container_config("fz", ["sleep", "3600"], envs=GPU_ENV)
    cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=fab.sandbox_id, config=ccfg,
                                                        sandbox_config=fab.sandbox_config), timeout=60).container_id
    try:
        rt.RemoveContainer(cri.RemoveContainerRequest(container_id=f"{fab.sandbox_id}/fz/0"), timeout=60)
        assert [lease.container_id or cid for lease in fab.broker.leases()] == [cid], "lease of a live container gone"
        assert call(fab.channel, "/weft.agent.v1.Admin/Explain", cid.encode()).response is not None
    finally:
        fab.remove_container(cid)
