"""The host's pure rules for shadows: which are orphans, how often Watch beats, what is never run, when a stop is
tried again."""

import threading

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri

from shim._pb import mesh_pb2 as pb
from shim.crishared.labels import KEY_LABEL
from shim.errors import UpstreamError
from shim.shadowhost.lifecycle import _unsafe, sandbox_to_use
from shim.shadowhost.runtime import RT, ShadowRuntime
from shim.shadowhost.runtime import label as _label
from shim.shadowhost.watch import Pulse, heartbeat_s, idle_heartbeat_s, orphans


def _shadow(cid: str, key: str) -> cri.Container:
    return cri.Container(id=cid, labels={KEY_LABEL: _label(key)})


@pytest.mark.parametrize(("keys", "orphaned"), [
    (["sb/a/0", "sb/b/0"], []),
    (["sb/a/0"], ["2"]),
    ([], ["1", "2"]),
    (["sb/a/1", "other/x/0"], ["1", "2"]),  # another attempt of the same container is another key
], ids=["all-owned", "one-dropped", "origin-owns-nothing", "other-attempt-is-not-owned"])
def test_shadows_whose_key_the_origin_no_longer_lists_are_orphans(keys: list[str], orphaned: list[str]) -> None:
    shadows = [_shadow("1", "sb/a/0"), _shadow("2", "sb/b/0")]
    assert [c.id for c in orphans(shadows, keys)] == orphaned


def test_a_shadow_without_a_key_label_is_an_orphan() -> None:
    assert [c.id for c in orphans([cri.Container(id="x")], ["sb/a/0"])] == ["x"]


@pytest.mark.parametrize(("asked", "expected"), [(0.0, 1.0), (0.5, 0.5), (0.01, 0.2), (60.0, 5.0), (-1.0, 1.0)],
                         ids=["host-default", "as-asked", "floor", "ceiling", "negative-means-default"])
def test_the_watch_interval_is_what_the_origin_asked_within_bounds(asked: float, expected: float) -> None:
    assert heartbeat_s(asked, 1.0) == expected


@pytest.mark.parametrize(("log_path", "refused"), [
    ("tokenize/0.log", False), ("0.log", False), ("../../etc/cron.d/x", True), ("/var/log/x.log", True),
    ("a/../../x", True)], ids=["kubelet-style", "flat", "dotdot", "absolute", "dotdot-inside"])
def test_a_log_path_may_not_leave_the_pods_log_directory(log_path: str, refused: bool) -> None:
    assert bool(_unsafe(cri.PodSandboxConfig(), cri.ContainerConfig(log_path=log_path))) is refused


def _sandbox(sid: str, state: int, attempt: int = 0) -> cri.PodSandbox:
    return cri.PodSandbox(id=sid, state=state, metadata=cri.PodSandboxMetadata(name="p", attempt=attempt))


@pytest.mark.parametrize(("existing", "asked", "expected"), [
    ([], 0, (None, 0)),
    ([], 2, (None, 2)),
    ([_sandbox("a", cri.SANDBOX_READY)], 0, ("a", 0)),
    ([_sandbox("dead", cri.SANDBOX_NOTREADY), _sandbox("a", cri.SANDBOX_READY, 1)], 0, ("a", 1)),
    ([_sandbox("dead", cri.SANDBOX_NOTREADY)], 0, (None, 1)),
    ([_sandbox("d0", cri.SANDBOX_NOTREADY), _sandbox("d3", cri.SANDBOX_NOTREADY, 3)], 1, (None, 4)),
    ([_sandbox("dead", cri.SANDBOX_NOTREADY)], 5, (None, 5)),
], ids=["none-yet", "none-yet-origin-attempt", "ready-reused", "ready-beside-a-dead-one",
        "dead-one-takes-the-next-attempt", "after-the-highest-dead-attempt", "origin-attempt-already-higher"])
def test_a_dead_shadow_sandbox_is_not_reused_and_its_name_not_asked_for_again(existing, asked, expected) -> None:
    # After a host reboot the pod's shadow sandbox is NOTREADY and its name stays reserved until removed.
    assert sandbox_to_use(existing, asked) == expected


def test_a_shadow_is_admitted_by_what_the_origin_was_admitted_with() -> None:
    from shim._pb import mesh_pb2 as pb
    from shim.shadowhost.lifecycle import admitted_with

    config = cri.ContainerConfig()
    config.linux.resources.cpu_period, config.linux.resources.cpu_quota = 100000, 50000
    config.linux.resources.memory_limit_in_bytes = 1 << 30
    assert admitted_with(pb.RunShadowRequest(), config) == (0.5, 1 << 30)  # its limits
    by_requests = pb.RunShadowRequest(admitted=pb.Resources(cpu_cores=0.25, memory_bytes=128 << 20))
    assert admitted_with(by_requests, cri.ContainerConfig()) == (0.25, 128 << 20)  # no limits: its requests


def test_an_empty_dir_is_made_fresh_and_writable_at_an_absolute_path_only(tmp_path) -> None:
    from shim._pb import mesh_pb2 as pb
    from shim.errors import BadAnnotation
    from shim.shadowhost.lifecycle import _empty_dir

    made = _empty_dir(tmp_path / "v", 0, pb.EmptyDir(container_path="/scratch", size_limit=1 << 20))
    assert made.is_dir() and not any(made.iterdir()) and made.stat().st_mode & 0o777 == 0o777
    with pytest.raises(BadAnnotation, match="must be absolute"):
        _empty_dir(tmp_path / "v", 1, pb.EmptyDir(container_path="scratch"))


class _Containerd(ShadowRuntime):
    """StopContainer answered from a script of errors (None: done)."""

    def __init__(self, answers: list[UpstreamError | None]) -> None:
        super().__init__(ctx=None)
        self.answers, self.asked = answers, []

    def call(self, path, request, response_type, timeout=120.0):
        self.asked.append((path, request.container_id, request.timeout))
        answer = self.answers.pop(0)
        if answer is not None:
            raise answer
        return response_type()


def test_a_stop_containerd_answers_unknown_is_tried_again_and_other_refusals_are_not() -> None:
    closed = UpstreamError(grpc.StatusCode.UNKNOWN, 'failed to kill container "c1": ttrpc: closed: unknown')
    rt = _Containerd([closed, closed, None])
    rt.stop("c1", retry_s=(0, 0, 0))
    assert rt.asked == [(RT + "StopContainer", "c1", 0)] * 3
    # Past its tries the error is the caller's, as is any other at once.
    rt = _Containerd([closed] * 4)
    with pytest.raises(UpstreamError) as still:
        rt.stop("c1", retry_s=(0, 0, 0))
    assert still.value is closed and len(rt.asked) == 4
    gone = UpstreamError(grpc.StatusCode.NOT_FOUND, 'container "c1" not found')
    rt = _Containerd([gone])
    with pytest.raises(UpstreamError):
        rt.stop("c1")
    assert len(rt.asked) == 1


@pytest.mark.parametrize(("asked", "expected"), [(0.0, 0.0), (15.0, 15.0), (0.1, 1.0), (600.0, 60.0)],
                         ids=["none-an-older-origin", "as-asked", "not-under-the-interval", "ceiling"])
def test_the_idle_heartbeat_is_what_the_origin_asked_within_bounds(asked: float, expected: float) -> None:
    assert idle_heartbeat_s(asked, 1.0) == expected


class _Listing:
    def __init__(self) -> None:
        self.by_origin: dict[str, frozenset] = {}

    def marks(self) -> dict[str, frozenset]:
        return dict(self.by_origin)


def _room(cpu: float, *, healthy: bool = True) -> pb.PeerState:
    return pb.PeerState(node="cpu-1", role="cpu", healthy=healthy, allocatable=pb.Resources(cpu_cores=8.0),
                        free=pb.Resources(cpu_cores=cpu, memory_bytes=1 << 30))


def test_the_pulse_wakes_only_the_watches_with_news(monkeypatch: pytest.MonkeyPatch) -> None:
    listing = _Listing()
    pulse = Pulse(listing, 1.0)  # type: ignore[arg-type]
    monkeypatch.setattr(pulse, "_run", lambda: None)  # rounds by hand
    room = [_room(4.0)]
    pulse.room = lambda: room[0]
    a, b = threading.Event(), threading.Event()
    pulse.subscribe("gpu-a", a)
    pulse.subscribe("gpu-b", b)
    version, state = pulse.state()
    assert state.free.cpu_cores == 4.0
    pulse._round()  # the first look at each origin's shadows: news to both
    a.clear(), b.clear()
    pulse._round()
    assert not a.is_set() and not b.is_set()  # nothing changed: nobody woken
    listing.by_origin = {"gpu-a": frozenset({("c1", cri.CONTAINER_EXITED)})}
    pulse._round()
    assert a.is_set() and not b.is_set()
    a.clear()
    room[0] = _room(3.9)  # a wobble: carried by the next heartbeat, woken for by nobody
    pulse._round()
    assert not a.is_set() and not b.is_set() and pulse.state() == (version, room[0])
    room[0] = _room(4.0, healthy=False)  # health: everyone, at once
    pulse._round()
    assert a.is_set() and b.is_set() and pulse.state()[0] == version + 1
    pulse.unsubscribe("gpu-a", a)
    pulse.unsubscribe("gpu-b", b)
    assert not pulse._subs
