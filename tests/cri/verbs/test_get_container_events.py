"""GetContainerEvents: what kubelet's evented PLEG receives through the agent.

kubelet takes each event's pod status as the whole pod: so containerd's
events pass unchanged where weft has nothing to add, a host's shadows never
show, every event of a pod with remote containers lists them, and the remote
containers' own changes arrive as events containerd would have written.
"""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import get_container_events
from shim.crishared.labels import ORIGIN_LABEL
from shim.crishared.mark import MARK_LABEL, ShadowMark
from shim.errors import UpstreamError
from shim.origin.context import Origin
from tests.cri.verbs.fakes import LOCAL_ID, SANDBOX, FakeMesh, Refusal, StreamEnd, add_remote, ctx

EVENTS = "GetContainerEvents"


def sandbox_status(sandbox_id: str = SANDBOX, labels: dict | None = None, uid: str = "uid-infer"
                   ) -> cri.PodSandboxStatus:
    return cri.PodSandboxStatus(id=sandbox_id, state=cri.SANDBOX_READY, labels=labels or {},
                                metadata=cri.PodSandboxMetadata(name="infer", namespace="default", uid=uid))


def local_event(sandbox: cri.PodSandboxStatus | None = None, kind: int = cri.CONTAINER_STARTED_EVENT
                ) -> cri.ContainerEventResponse:
    ev = cri.ContainerEventResponse(container_id=LOCAL_ID, container_event_type=kind, created_at=123)
    ev.pod_sandbox_status.CopyFrom(sandbox or sandbox_status())
    ev.containers_statuses.add(id=LOCAL_ID, state=cri.CONTAINER_RUNNING)
    return ev


class Stream:
    """The handler on a thread of its own, as the relay runs it: what it emits, and how it ended."""

    def __init__(self, fabric) -> None:
        self.ctx = ctx()
        self.out: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.route = get_container_events.route(fabric)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.route.stream(cri.GetEventsRequest().SerializeToString(), self.ctx, self.out.put)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc

    def next(self, timeout: float = 5.0) -> cri.ContainerEventResponse:
        return cri.ContainerEventResponse.FromString(self.out.get(timeout=timeout))

    def raw(self, timeout: float = 5.0) -> bytes:
        return self.out.get(timeout=timeout)

    def ended(self, timeout: float = 5.0) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()


def wait_open(containerd, n: int = 1) -> None:
    deadline = time.monotonic() + 5
    while containerd.streams_open[EVENTS] < n:
        assert time.monotonic() < deadline, "the agent never opened containerd's event stream"
        time.sleep(0.01)


@pytest.fixture
def stream(fabric, mesh, containerd):
    s = Stream(fabric)
    wait_open(containerd)
    yield s
    s.ctx.cancel()
    assert s.ended()


def test_weft_answers_the_stream_only_on_a_node_with_a_mesh(fabric) -> None:
    route = get_container_events.route(fabric)
    assert not route.applies()  # no mesh: kubelet's stream goes to containerd frame by frame
    fabric.origin = Origin(FakeMesh())
    assert route.applies()


def test_containerds_events_pass_byte_for_byte_where_weft_has_nothing_to_add(containerd, stream) -> None:
    ev = local_event()
    containerd.streamed[EVENTS].put(ev)
    assert stream.raw() == ev.SerializeToString()


def test_an_event_of_a_pod_with_a_remote_container_lists_it_beside_containerds_own(fabric, containerd,
                                                                                     stream) -> None:
    r = add_remote(fabric)
    assert stream.next().container_id == r.id  # its own CREATED event (below)
    containerd.streamed[EVENTS].put(local_event())
    got = stream.next()
    assert got.container_id == LOCAL_ID
    assert [s.id for s in got.containers_statuses] == [LOCAL_ID, r.id]
    assert got.containers_statuses[1].state == cri.CONTAINER_RUNNING
    assert got.containers_statuses[1].metadata.name == "tokenize"  # kubelet's names, not the shadow's


def test_a_hosts_own_shadows_never_reach_kubelet_but_a_pod_with_their_label_does(fabric, containerd,
                                                                                 tmp_path, stream) -> None:
    mark = ShadowMark.load(tmp_path / "mark")
    fabric.shadows.mark, fabric.shadows.present = mark, True
    uid = "uid-x-shadow"
    shadow = sandbox_status("5a" * 32, {ORIGIN_LABEL: "gpu-1", MARK_LABEL: mark.sandbox("gpu-1", uid)}, uid)
    pretender = sandbox_status("5c" * 32, {ORIGIN_LABEL: "gpu-1"}, "uid-tenant")
    containerd.streamed[EVENTS].put(local_event(shadow))
    containerd.streamed[EVENTS].put(local_event(pretender))
    assert stream.next().pod_sandbox_status.id == "5c" * 32
    assert stream.out.empty()


def local_container(containerd, state: int = cri.CONTAINER_RUNNING) -> None:
    """containerd holds the pod's sandbox and one local container of it."""
    containerd.answer("PodSandboxStatus", cri.PodSandboxStatusResponse(status=sandbox_status()))
    containerd.answer("ListContainers", cri.ListContainersResponse(containers=[cri.Container(id=LOCAL_ID)]))
    containerd.answer("ContainerStatus", cri.ContainerStatusResponse(
        status=cri.ContainerStatus(id=LOCAL_ID, state=state)))


def test_a_remote_containers_changes_are_events_as_containerd_writes_them(fabric, containerd, host,
                                                                           stream) -> None:
    local_container(containerd)
    before = time.time_ns()
    r = add_remote(fabric, state=cri.CONTAINER_CREATED)
    created = stream.next()
    assert (created.container_id, created.container_event_type) == (r.id, cri.CONTAINER_CREATED_EVENT)
    assert created.pod_sandbox_status.metadata.uid == "uid-infer"
    assert [s.id for s in created.containers_statuses] == [LOCAL_ID, r.id]
    assert created.created_at >= before

    running = cri.ContainerStatus(id="shadow-ctr", state=cri.CONTAINER_RUNNING, started_at=5)
    fabric.remotes.update(r, running)
    started = stream.next()
    assert started.container_event_type == cri.CONTAINER_STARTED_EVENT
    assert started.containers_statuses[1].state == cri.CONTAINER_RUNNING
    fabric.remotes.update(r, running)  # the same state again: no event
    exited = cri.ContainerStatus(id="shadow-ctr", state=cri.CONTAINER_EXITED, started_at=5, finished_at=9,
                                 exit_code=3)
    fabric.remotes.update(r, exited)
    stopped = stream.next()
    assert stopped.container_event_type == cri.CONTAINER_STOPPED_EVENT
    assert stopped.containers_statuses[1].exit_code == 3

    fabric.remotes.drop(r.id)
    deleted = stream.next()
    assert (deleted.container_id, deleted.container_event_type) == (r.id, cri.CONTAINER_DELETED_EVENT)
    assert [s.id for s in deleted.containers_statuses] == [LOCAL_ID]  # gone from the pod
    assert stream.out.empty()


def test_a_container_lost_with_its_host_is_a_stopped_event(fabric, stream) -> None:
    r = add_remote(fabric)
    stream.next()
    assert fabric.remotes.mark_lost(r, 30.0)
    ev = stream.next()
    assert ev.container_event_type == cri.CONTAINER_STOPPED_EVENT
    assert ev.containers_statuses[-1].reason == "WeftPeerLost"


def test_the_pods_local_containers_are_asked_of_containerd_as_they_are_now(fabric, containerd, stream) -> None:
    local_container(containerd, cri.CONTAINER_EXITED)
    r = add_remote(fabric)
    ev = stream.next()
    assert [(s.id, s.state) for s in ev.containers_statuses] == [(LOCAL_ID, cri.CONTAINER_EXITED),
                                                                 (r.id, cri.CONTAINER_RUNNING)]
    listed = cri.ListContainersRequest.FromString(containerd.requests("ListContainers")[-1])
    assert listed.filter.pod_sandbox_id == SANDBOX


def test_a_remote_containers_event_for_a_pod_containerd_no_longer_has_is_left_out(fabric, containerd,
                                                                                  stream) -> None:
    containerd.refuse("PodSandboxStatus", grpc.StatusCode.NOT_FOUND, "sandbox not found")
    add_remote(fabric)
    containerd.streamed[EVENTS].put(local_event(sandbox_status("5d" * 32)))
    assert stream.next().pod_sandbox_status.id == "5d" * 32  # the stream goes on; the orphan event is not sent


def test_containerds_error_ends_the_stream_with_its_status(fabric, mesh, containerd) -> None:
    containerd.streamed[EVENTS].put(Refusal(grpc.StatusCode.UNIMPLEMENTED, "unknown method GetContainerEvents"))
    s = Stream(fabric)
    assert s.ended()
    assert isinstance(s.error, UpstreamError) and s.error.code is grpc.StatusCode.UNIMPLEMENTED
    assert "GetContainerEvents" in s.error.message


def test_containerd_ending_its_stream_ends_kubelets(fabric, mesh, containerd) -> None:
    s = Stream(fabric)
    wait_open(containerd)
    containerd.streamed[EVENTS].put(StreamEnd)
    assert s.ended() and s.error is None


def test_kubelet_cancelling_closes_containerds_stream_and_weft_stops_listening(fabric, mesh, containerd) -> None:
    s = Stream(fabric)
    wait_open(containerd)
    s.ctx.cancel()
    assert s.ended() and s.error is None
    deadline = time.monotonic() + 5
    while containerd.streams_open[EVENTS]:
        assert time.monotonic() < deadline, "containerd's stream outlived kubelet's"
        time.sleep(0.01)
    add_remote(fabric)  # no one listens: nothing is queued anywhere
    assert not fabric.remotes._listeners


def test_a_call_kubelet_cancelled_before_it_began_ends_at_once_and_holds_nothing(fabric, mesh, containerd) -> None:
    c = ctx()
    c.cancel()
    route = get_container_events.route(fabric)
    done = threading.Event()
    threading.Thread(target=lambda: (route.stream(b"", c, lambda m: None), done.set()), daemon=True).start()
    assert done.wait(5), "the handler waited for a cancel that had come already"
    assert not fabric.remotes._listeners
    time.sleep(0.2)
    assert containerd.streams_open[EVENTS] == 0


def test_each_pods_events_leave_with_rising_times(fabric, containerd, stream) -> None:
    """A containerd event written before weft's last event of the pod, but sent after it, would be dropped."""
    local_container(containerd)
    r = add_remote(fabric)
    created = stream.next()
    assert created.container_id == r.id
    older = local_event(kind=cri.CONTAINER_STOPPED_EVENT)
    older.created_at = created.created_at - 1_000_000
    containerd.streamed[EVENTS].put(older)
    got = stream.next()
    assert got.container_event_type == cri.CONTAINER_STOPPED_EVENT
    assert got.created_at == created.created_at + 1
    newer = local_event()
    newer.created_at = created.created_at + 5_000_000
    containerd.streamed[EVENTS].put(newer)
    assert stream.next().created_at == newer.created_at  # a newer one keeps its own time


def test_rising_forgets_the_oldest_pods_past_its_bound() -> None:
    rising = get_container_events.Rising()
    for i in range(rising.LIMIT + 10):
        ev = local_event(sandbox_status(uid=f"uid-{i}"))
        ev.created_at = 100
        assert not rising.keep(ev)
    assert len(rising._last) == rising.LIMIT
