"""A shadow's CPU quota, taken out of its config and set once it runs (a fake containerd here)."""

from __future__ import annotations

import json
import threading

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri

from shim.crishared.labels import CPU_MAX_ANNOTATION, ORIGIN_LABEL
from shim.errors import UpstreamError
from shim.shadowhost import cpu_limit


class FakeRuntime:
    """containerd as far as the limit goes: updates recorded, an error to answer them with, specs to show."""

    def __init__(self, containers: list[cri.Container] | None = None, quotas: dict[str, int] | None = None,
                 fail: grpc.StatusCode | None = None) -> None:
        self._containers = containers or []
        self.quotas = quotas or {}
        self.fail = fail
        self.updates: list[tuple[str, int, int]] = []
        self.stopped: list[str] = []
        self.statuses: list[str] = []
        self.reasons: dict[str, tuple[str, str]] = {}
        self.exited: set[str] = set()  # containers that ran and exited on their own
        self.fail_times = -1  # how many updates fail (-1: all)
        self.updating = threading.Event()  # set while an update is being answered
        self.release = threading.Event()
        self.release.set()

    def call(self, path: str, request, response_type, timeout: float | None = 120.0):
        verb = path.rsplit("/", 1)[1]
        if verb == "UpdateContainerResources":
            self.updating.set()
            self.release.wait(10)
            if self.fail is not None and self.fail_times != 0:
                self.fail_times -= 1
                raise UpstreamError(self.fail, f"runc update {request.container_id}: no such cgroup")
            r = request.linux
            self.updates.append((request.container_id, r.cpu_quota, r.cpu_period))
            return response_type()
        if verb == "ContainerStatus":
            self.statuses.append(request.container_id)
            spec = {"linux": {"resources": {"cpu": {"quota": self.quotas.get(request.container_id, 0)}}}}
            return cri.ContainerStatusResponse(info={"info": json.dumps({"runtimeSpec": spec})})
        raise AssertionError(f"unexpected call {verb}")

    def stop(self, container_id: str) -> None:
        self.stopped.append(container_id)

    def status(self, container_id: str) -> cri.ContainerStatus | None:
        if container_id in self.exited:
            return cri.ContainerStatus(id=container_id, state=cri.CONTAINER_EXITED, exit_code=3)
        return cri.ContainerStatus(id=container_id, state=cri.CONTAINER_RUNNING)

    def containers(self, state: int | None = None) -> list[cri.Container]:
        return [c for c in self._containers if state is None or c.state == state]


def _config(quota: int = 0, period: int = 0, **annotations: str) -> cri.ContainerConfig:
    config = cri.ContainerConfig(annotations=annotations)
    config.linux.resources.cpu_quota, config.linux.resources.cpu_period = quota, period
    config.linux.resources.memory_limit_in_bytes = 64 << 20
    return config


def test_the_quota_is_taken_out_of_the_config_into_its_annotation_and_nothing_else_changes() -> None:
    config = _config(10000, 100000)
    cpu_limit.defer(config)
    res = config.linux.resources
    assert (res.cpu_quota, res.cpu_period, res.memory_limit_in_bytes) == (0, 0, 64 << 20)
    assert config.annotations[CPU_MAX_ANNOTATION] == "10000 100000"
    assert cpu_limit.deferred(config.annotations) == (10000, 100000)

    kubelets_default_period = _config(25000)
    cpu_limit.defer(kubelets_default_period)
    assert cpu_limit.deferred(kubelets_default_period.annotations) == (25000, 100000)


def test_no_quota_asked_leaves_no_annotation_and_one_the_origin_sent_is_not_kept() -> None:
    config = _config(0, 100000, **{CPU_MAX_ANNOTATION: "1 1000000"})
    cpu_limit.defer(config)
    assert CPU_MAX_ANNOTATION not in config.annotations
    assert config.linux.resources.cpu_period == 100000


@pytest.mark.parametrize("value", ["", "10000", "x 100000", "10000 0", "-5 100000", "1 2 3"])
def test_an_unreadable_annotation_defers_nothing(value: str) -> None:
    assert cpu_limit.deferred({CPU_MAX_ANNOTATION: value}) is None


def test_the_limit_is_set_with_containerds_update_and_a_gone_container_is_no_error() -> None:
    rt = FakeRuntime()
    cpu_limit.apply(rt, "c1", {CPU_MAX_ANNOTATION: "10000 100000"}, "StartShadow k")
    assert rt.updates == [("c1", 10000, 100000)]
    cpu_limit.apply(rt, "c2", {}, "StartShadow k")  # made before this, or with no quota asked
    assert rt.updates == [("c1", 10000, 100000)]

    gone = FakeRuntime(fail=grpc.StatusCode.NOT_FOUND)
    cpu_limit.apply(gone, "c1", {CPU_MAX_ANNOTATION: "10000 100000"}, "StartShadow k")
    assert gone.stopped == []


def test_a_shadow_whose_limit_containerd_refuses_is_stopped_with_the_reason_for_its_origin() -> None:
    rt = FakeRuntime(fail=grpc.StatusCode.UNKNOWN)
    with pytest.raises(cpu_limit.LimitNotSet) as err:
        cpu_limit.apply(rt, "c1", {CPU_MAX_ANNOTATION: "10000 100000"}, "StartShadow origin-sb/prep/0")
    assert rt.stopped == ["c1"]
    assert err.value.code is grpc.StatusCode.UNKNOWN
    assert err.value.message.startswith("StartShadow origin-sb/prep/0: containerd did not set its CPU limit "
                                        "(cpu.max 10000 100000) once it ran, so this host stops it: runc update")
    assert rt.reasons["c1"] == (cpu_limit.REASON, err.value.message)


def test_a_shadow_that_exited_on_its_own_before_its_limit_is_neither_stopped_nor_given_a_reason() -> None:
    rt = FakeRuntime(fail=grpc.StatusCode.UNKNOWN)  # runc update: the container's task is gone
    rt.exited.add("c1")
    cpu_limit.apply(rt, "c1", {CPU_MAX_ANNOTATION: "10000 100000"}, "StartShadow k")
    assert rt.stopped == [] and rt.reasons == {}


def test_a_refusal_is_asked_again_once_before_the_shadow_is_stopped() -> None:
    rt = FakeRuntime(fail=grpc.StatusCode.UNKNOWN)
    rt.fail_times = 1  # a moment later containerd sets it
    cpu_limit.apply(rt, "c1", {CPU_MAX_ANNOTATION: "10000 100000"}, "StartShadow k")
    assert rt.updates == [("c1", 10000, 100000)] and rt.stopped == [] and rt.reasons == {}


def test_containerd_not_answering_leaves_the_shadow_running_for_a_later_try() -> None:
    rt = FakeRuntime(fail=grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(UpstreamError) as err:
        cpu_limit.apply(rt, "c1", {CPU_MAX_ANNOTATION: "10000 100000"}, "StartShadow k")
    assert not isinstance(err.value, cpu_limit.LimitNotSet)
    assert rt.stopped == [] and rt.reasons == {}


def test_the_limiter_sets_each_started_shadows_limit_in_order_off_the_callers_thread() -> None:
    rt = FakeRuntime()
    limiter = cpu_limit.Limiter(rt)
    rt.release.clear()
    limiter.later("c1", {CPU_MAX_ANNOTATION: "10000 100000"}, "StartShadow a")  # returns before the update
    assert rt.updating.wait(5)
    limiter.later("c2", {CPU_MAX_ANNOTATION: "20000 100000"}, "StartShadow b")
    limiter.later("c3", {}, "StartShadow c")  # nothing to set
    ran = threading.Event()
    limiter.after(ran.set)
    assert rt.updates == [] and not ran.is_set()
    rt.release.set()
    limiter.close()
    assert rt.updates == [("c1", 10000, 100000), ("c2", 20000, 100000)]
    assert ran.is_set() and limiter.pending() == []
    limiter.later("c4", {CPU_MAX_ANNOTATION: "10000 100000"}, "StartShadow d")  # closed: the next settle's
    assert limiter.pending() == []


def test_a_resize_or_removal_that_comes_first_wins_over_the_deferred_limit() -> None:
    rt = FakeRuntime()
    limiter = cpu_limit.Limiter(rt)
    rt.release.clear()
    limiter.later("busy", {CPU_MAX_ANNOTATION: "1000 100000"}, "StartShadow a")  # holds the thread
    assert rt.updating.wait(5)
    limiter.later("resized", {CPU_MAX_ANNOTATION: "10000 100000"}, "StartShadow b")
    limiter.drop("resized")  # queued, not under way: dropped at once, not waiting for "busy"
    limiter.drop("removed")  # before its start was even queued
    limiter.later("removed", {CPU_MAX_ANNOTATION: "10000 100000"}, "StartShadow c")
    assert limiter.pending() == []
    rt.release.set()
    limiter.close()
    assert rt.updates == [("busy", 1000, 100000)]


def test_dropping_a_shadow_whose_update_is_under_way_waits_for_that_update() -> None:
    rt = FakeRuntime()
    limiter = cpu_limit.Limiter(rt)
    rt.release.clear()
    limiter.later("c1", {CPU_MAX_ANNOTATION: "10000 100000"}, "StartShadow a")
    assert rt.updating.wait(5)
    dropped = threading.Event()
    dropper = threading.Thread(target=lambda: (limiter.drop("c1"), dropped.set()))
    dropper.start()
    assert not dropped.wait(0.3)  # the caller's own update must land after this one
    rt.release.set()
    assert dropped.wait(5)
    dropper.join()
    assert rt.updates == [("c1", 10000, 100000)]
    limiter.close()


def test_the_limiter_goes_on_after_a_refusal_and_after_an_unexpected_error() -> None:
    rt = FakeRuntime(fail=grpc.StatusCode.UNKNOWN)
    limiter = cpu_limit.Limiter(rt)
    limiter.later("c1", {CPU_MAX_ANNOTATION: "10000 100000"}, "StartShadow a")
    limiter.after(lambda: 1 / 0)
    ran = threading.Event()
    limiter.after(ran.set)
    assert ran.wait(5)
    assert rt.stopped == ["c1"]
    rt.fail = None
    limiter.later("c2", {CPU_MAX_ANNOTATION: "10000 100000"}, "StartShadow b")
    limiter.close()
    assert rt.updates == [("c2", 10000, 100000)]


def _shadow(cid: str, *, deferred: bool = True, ours: bool = True, state: int = cri.CONTAINER_RUNNING) -> cri.Container:
    labels = {ORIGIN_LABEL: "gpu-1", "mark": "ok" if ours else "forged"}
    return cri.Container(id=cid, state=state, labels=labels,
                         annotations={CPU_MAX_ANNOTATION: "10000 100000"} if deferred else {})


def _ours(labels) -> bool:
    return labels.get("mark") == "ok"


def test_settle_gives_only_this_hosts_running_shadows_without_a_quota_theirs_once() -> None:
    rt = FakeRuntime(containers=[
        _shadow("unset"),                                   # started while the agent was away: set
        _shadow("resized"),                                 # has a quota (set, or resized since): left
        _shadow("made", state=cri.CONTAINER_CREATED),       # its start sets it
        _shadow("older", deferred=False),                   # made with its quota
        _shadow("forged", ours=False),                      # labels not of this host's making
        cri.Container(id="own", state=cri.CONTAINER_RUNNING, annotations={CPU_MAX_ANNOTATION: "1 100000"}),
    ], quotas={"resized": 50000})
    limiter = cpu_limit.Limiter(rt)
    assert limiter.settle(_ours) == 1
    assert rt.updates == [("unset", 10000, 100000)]
    looked = len(rt.statuses)
    assert limiter.settle(_ours) == 0  # the next round looks at neither again
    assert len(rt.statuses) == looked and rt.updates == [("unset", 10000, 100000)]


def test_settle_retries_what_containerd_did_not_answer_and_a_failed_resize_but_not_a_resized_one() -> None:
    rt = FakeRuntime(containers=[_shadow("c1"), _shadow("c2")], fail=grpc.StatusCode.UNAVAILABLE)
    limiter = cpu_limit.Limiter(rt)
    assert limiter.settle(_ours) == 0 and rt.stopped == []
    rt.fail = None
    limiter.drop("c2")  # an origin's resize under way: settle keeps off it
    assert limiter.settle(_ours) == 1
    assert rt.updates == [("c1", 10000, 100000)]
    limiter.undrop("c2")  # the resize failed: containerd kept the spec without a quota
    assert limiter.settle(_ours) == 1
    assert rt.updates == [("c1", 10000, 100000), ("c2", 10000, 100000)]
