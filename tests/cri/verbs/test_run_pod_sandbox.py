"""RunPodSandbox: a pod with runtime handler ``weft`` is recorded as opted in before kubelet gets its sandbox ID.

Every other sandbox passes through byte for byte; a sandbox weft could not
record is undone in containerd, so kubelet retries instead of running the
pod's containers unplaced.
"""

from __future__ import annotations

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import run_pod_sandbox
from shim.errors import UpstreamError
from shim.state.agent import AgentStore
from shim.state.db import StateError, StateStoreFull
from tests.cri.verbs.fakes import ctx

SANDBOX_ID = "c0ffee" * 10 + "c0ff"


def request(handler: str = "weft", name: str = "infer") -> bytes:
    config = cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name=name, namespace="ml", uid="uid-1", attempt=0),
                                  annotations={"weft.io/stage.tokenize": "cpu"})
    return cri.RunPodSandboxRequest(config=config, runtime_handler=handler).SerializeToString()


@pytest.fixture
def route(fabric, containerd):
    containerd.answer("RunPodSandbox", cri.RunPodSandboxResponse(pod_sandbox_id=SANDBOX_ID))
    return run_pod_sandbox.route(fabric)


@pytest.mark.parametrize("handler", ["", "runc", "kata", "weft-gpu"], ids=["default", "runc", "kata", "weft-prefix"])
def test_a_sandbox_of_another_handler_passes_byte_for_byte_and_is_not_recorded(fabric, containerd, route,
                                                                               handler) -> None:
    body = request(handler)
    answer = route.handle(body, ctx(("x-request-id", "42")))
    assert containerd.only_request("RunPodSandbox") == body
    assert containerd.calls[0].metadata["x-request-id"] == "42"
    assert cri.RunPodSandboxResponse.FromString(answer).pod_sandbox_id == SANDBOX_ID
    assert fabric.opted_in == {} and fabric.store.sandboxes() == []


def test_a_weft_sandbox_is_forwarded_unchanged_and_on_disk_when_kubelet_gets_its_id(fabric, containerd, route,
                                                                                  tmp_path) -> None:
    body = request("weft")
    answer = route.handle(body, ctx())
    assert containerd.only_request("RunPodSandbox") == body, "containerd's weft handler gets kubelet's request"
    assert cri.RunPodSandboxResponse.FromString(answer).pod_sandbox_id == SANDBOX_ID
    reopened = AgentStore(tmp_path / "state")  # what a restarted agent would read
    try:
        rec = reopened.sandbox(SANDBOX_ID)
    finally:
        reopened.close()
    assert rec is not None and rec.opted_in
    assert (rec.name, rec.namespace, rec.uid, rec.runtime_handler) == ("infer", "ml", "uid-1", "weft")
    assert rec.annotations == {"weft.io/stage.tokenize": "cpu"}
    assert SANDBOX_ID in fabric.opted_in, "its CreateContainers are placed from now on"


def test_an_opted_in_sandbox_is_counted_and_time_stamped(fabric, route) -> None:
    route.handle(request("weft"), ctx())
    registry = fabric.metrics.registry
    assert registry.get_sample_value("weft_opted_in_sandboxes") == 1
    assert registry.get_sample_value("weft_sandbox_opted_in_timestamp_seconds",
                                     {"namespace": "ml", "pod": "infer"}) > 0


def test_containerds_refusal_reaches_kubelet_unchanged_and_nothing_is_recorded(fabric, containerd, route) -> None:
    containerd.refuse("RunPodSandbox", grpc.StatusCode.INVALID_ARGUMENT, "no runtime for \"weft\" is configured")
    with pytest.raises(UpstreamError) as err:
        route.handle(request("weft"), ctx())
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message == "no runtime for \"weft\" is configured"
    assert fabric.opted_in == {} and fabric.store.sandboxes() == []


def test_a_request_that_does_not_parse_is_containerds_to_answer(fabric, containerd, route) -> None:
    body = b"\x0a\x05\xff\xfe\xfd\xfc\xfb"  # config: five bytes that are no PodSandboxConfig
    route.handle(body, ctx())
    assert containerd.only_request("RunPodSandbox") == body
    assert fabric.store.sandboxes() == []


def _fill_the_disk(fabric) -> None:
    # SQLite's own "database or disk is full", through the store's real code path.
    pages = fabric.store.db._conn.execute("PRAGMA page_count").fetchone()[0]
    fabric.store.db._conn.execute(f"PRAGMA max_page_count={pages}")
    for i in range(64):  # use up the free pages the schema left
        try:
            fabric.store.db._conn.execute("INSERT INTO sandboxes VALUES (?, '', '', '', '', 0, ?, 0)",
                                          (f"filler-{i}", "x" * 2000))
        except Exception:  # noqa: BLE001 - full at last
            return


def _read_only(fabric) -> None:
    fabric.store.db._conn.execute("PRAGMA query_only=ON")


@pytest.mark.parametrize(
    ("break_store", "error", "code"),
    [pytest.param(_fill_the_disk, StateStoreFull, grpc.StatusCode.RESOURCE_EXHAUSTED, id="disk-full"),
     pytest.param(_read_only, StateError, grpc.StatusCode.INTERNAL, id="database-read-only")],
)
def test_a_sandbox_weft_cannot_record_is_stopped_and_removed_and_kubelet_told(fabric, containerd, route, break_store,
                                                                              error, code) -> None:
    break_store(fabric)
    with pytest.raises(error) as err:
        route.handle(request("weft"), ctx())
    assert err.value.code is code
    assert containerd.verbs() == ["RunPodSandbox", "StopPodSandbox", "RemovePodSandbox"]
    assert cri.StopPodSandboxRequest.FromString(containerd.requests("StopPodSandbox")[0]).pod_sandbox_id == SANDBOX_ID
    assert cri.RemovePodSandboxRequest.FromString(
        containerd.requests("RemovePodSandbox")[0]).pod_sandbox_id == SANDBOX_ID
    assert SANDBOX_ID not in fabric.opted_in


def test_an_undo_containerd_refuses_stops_there_and_kubelet_still_gets_the_store_error(fabric, containerd,
                                                                                        route) -> None:
    containerd.refuse("StopPodSandbox", grpc.StatusCode.UNAVAILABLE, "shim gone")
    _fill_the_disk(fabric)
    with pytest.raises(StateStoreFull):
        route.handle(request("weft"), ctx())
    assert containerd.verbs() == ["RunPodSandbox", "StopPodSandbox"]
