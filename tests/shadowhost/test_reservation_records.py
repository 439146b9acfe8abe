"""A host's reservation records outlive its agent: an agent killed at a step of a reservation's life (the
first instance dropped without stopping) and started again (a second one on the same state store) ends
where an agent that was never killed does. The API is a fake of the few lightkube calls used."""

from __future__ import annotations

import time
from pathlib import Path

import httpx2
import pytest
from lightkube.resources.core_v1 import Node, Pod

from shim.core.reservation import LossReason, Stage, Verdict, name_of
from shim.shadowhost.reservations import ApiUnreachable, Reservations
from shim.state.agent import AgentStore

KEY = "sb/prep/0"
STAGE = Stage(host="cpu-1", origin_node="gpu-1", namespace="default", pod="infer", container="prep", key=KEY,
              cpu_millis=100, memory_bytes=64 << 20, priority_class="low")


class FakeApi:
    """The API server's pods (as dicts), reached with lightkube's get/create/delete/list; ``up`` False: every
    call fails as a server that does not answer."""

    def __init__(self) -> None:
        self.pods: dict[str, dict] = {}
        self.up = True
        self.created: list[str] = []
        self.deleted: list[str] = []
        origin = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "infer", "namespace": "default"},
                  "spec": {"nodeName": "gpu-1", "priorityClassName": "low",
                           "containers": [{"name": "prep", "image": "x"}]}}
        self.origin = Pod.from_dict(origin)
        self.node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "cpu-1", "uid": "cpu-1-uid"},
                     "spec": {}}

    # ApiAccess's
    def client(self) -> FakeApi:
        return self

    def _answer(self) -> None:
        if not self.up:
            raise httpx2.ConnectError("connection refused")

    # lightkube.Client's
    def get(self, res, name: str, *, namespace: str | None = None):
        self._answer()
        if res is Node:
            assert name == "cpu-1"
            return Node.from_dict(self.node)
        if name in self.pods:  # a reservation
            return Pod.from_dict(self.pods[name])
        assert name == "infer"
        return self.origin

    def create(self, obj, *, namespace: str):
        self._answer()
        d = obj.to_dict()
        self.pods[d["metadata"]["name"]] = d
        self.created.append(d["metadata"]["name"])
        return obj

    def delete(self, res, name: str, *, namespace: str, grace_period: int = 0) -> None:
        self._answer()
        self.pods.pop(name, None)
        self.deleted.append(name)

    def list(self, res, *, namespace: str, labels=None, fields=None):
        self._answer()
        if res is not Pod:  # no PodDisruptionBudget anywhere
            return []
        return [Pod.from_dict(p) for p in self.pods.values()]

    def close(self) -> None:
        pass

    def set_status(self, phase: str, **status) -> None:
        self.pods[name_of(KEY)]["status"] = {"phase": phase, **status}


class Host:
    """One run of the host agent's reservations over ``store``: its shadows (``live``) and the losses it acted on."""

    def __init__(self, api: FakeApi, state_dir: Path, live: set[str], grace: float) -> None:
        self.losses: list[tuple[str, Verdict]] = []
        self.store = AgentStore(state_dir)
        self.r = Reservations(api, "cpu-1", "weft-system", "pause", lambda k, v: self.losses.append((k, v)),
                              lambda: set(live), grace=grace, store=self.store)
        self.r.load()  # as start() does, without the watch: reconcile() is called by the test


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


@pytest.mark.parametrize("killed", [False, True], ids=["no-kill", "killed-and-restarted"])
def test_a_stage_made_while_the_api_was_away_is_reserved_once_it_answers(api: FakeApi, tmp_path: Path,
                                                                          killed: bool) -> None:
    live = {KEY}
    host = Host(api, tmp_path, live, grace=0.05)
    api.up = False
    with pytest.raises(ApiUnreachable):
        host.r.reserve(STAGE)
    if killed:
        host = Host(api, tmp_path, live, grace=0.05)
        assert host.r.state(KEY) == {"name": name_of(KEY), "state": "unreserved", "reason": "ApiUnreachable"}
    time.sleep(0.1)  # past the grace: an adopted shadow with no reservation on the API would be stopped now
    api.up = True
    host.r.reconcile()
    assert api.created == [name_of(KEY)] and host.losses == []
    assert host.r.state(KEY) == {"name": name_of(KEY), "state": "pending"}
    # The longer grace after an outage is kept too (kubelet may see the reservation only when its watch
    # reconnects): still pending past the host's own grace, it is not given up.
    api.set_status("Pending")
    time.sleep(0.1)
    if killed:
        host = Host(api, tmp_path, live, grace=0.05)
    host.r.reconcile()
    assert host.losses == [] and host.r.state(KEY)["state"] == "pending"


@pytest.mark.parametrize("killed", [False, True], ids=["no-kill", "killed-and-restarted"])
def test_a_reservation_never_admitted_stops_its_shadow_one_grace_after_it_was_made(api: FakeApi, tmp_path: Path,
                                                                                   killed: bool) -> None:
    live = {KEY}
    host = Host(api, tmp_path, live, grace=0.3)
    host.r.reserve(STAGE)
    api.set_status("Pending")
    host.r.reconcile()
    assert host.losses == []
    time.sleep(0.35)
    if killed:  # the grace is counted from when it was made, not from the restart
        host = Host(api, tmp_path, live, grace=0.3)
    host.r.reconcile()
    assert [(k, v.reason) for k, v in host.losses] == [(KEY, LossReason.NOT_ADMITTED)]


@pytest.mark.parametrize("killed", [False, True], ids=["no-kill", "killed-and-restarted"])
def test_a_loss_the_agent_died_acting_on_stops_the_shadow_with_its_reason(api: FakeApi, tmp_path: Path,
                                                                          killed: bool) -> None:
    live = {KEY}
    host = Host(api, tmp_path, live, grace=10.0)
    host.r.reserve(STAGE)
    api.set_status("Running")
    host.r.reconcile()
    preempted = {**api.pods[name_of(KEY)], "status": {"phase": "Running", "conditions": [
        {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler",
         "message": "preempted by default/urgent"}]}}
    del api.pods[name_of(KEY)]  # the scheduler deleted it
    if killed:
        host.r.on_lost = lambda k, v: None  # killed between seeing the loss and stopping the shadow
    host.r.seen(preempted, deleted=True)
    if killed:
        host = Host(api, tmp_path, live, grace=10.0)
        host.r.reconcile()
    assert [(k, v.reason, v.detail) for k, v in host.losses] == [
        (KEY, LossReason.PREEMPTED, "preempted by default/urgent")]
    live.clear()  # the shadow stopped: its record goes with the reservation
    host.r.reconcile()
    assert host.store.reservations() == []


def test_a_released_reservation_leaves_no_record(api: FakeApi, tmp_path: Path) -> None:
    host = Host(api, tmp_path, {KEY}, grace=10.0)
    host.r.reserve(STAGE)
    assert [r.key for r in host.store.reservations()] == [KEY]
    host.r.release(KEY)
    assert host.store.reservations() == [] and api.pods == {}
    assert Host(api, tmp_path, set(), grace=10.0).r.state(KEY) is None


def _hooked(api: FakeApi, tmp_path: Path) -> Host:
    host = Host(api, tmp_path, {KEY}, grace=10.0)
    host.r.stop_endpoint = ("127.0.0.1", 9464)
    host.r.stop_token = lambda name: f"token-of-{name}"
    host.r.reserve(STAGE)
    return host


def test_kubelets_stop_hook_stops_the_shadow_with_the_apis_reason_before_it_answers(api: FakeApi,
                                                                                    tmp_path: Path) -> None:
    host = _hooked(api, tmp_path)
    hook = api.pods[name_of(KEY)]["spec"]["containers"][0]["lifecycle"]["preStop"]["httpGet"]
    assert hook["httpHeaders"] == [{"name": "X-Weft-Stop-Token", "value": f"token-of-{name_of(KEY)}"}]
    api.pods[name_of(KEY)]["metadata"]["deletionTimestamp"] = "2026-12-05T12:00:00Z"
    api.set_status("Running", conditions=[{"type": "DisruptionTarget", "status": "True",
                                           "reason": "PreemptionByScheduler", "message": "preempted by urgent"}])
    assert host.r.stop_for_kubelet(name_of(KEY), f"token-of-{name_of(KEY)}")[0] == 200
    assert [(k, v.reason) for k, v in host.losses] == [(KEY, LossReason.PREEMPTED)]
    # The watch seeing the same deletion later does not act twice.
    host.r.seen(api.pods[name_of(KEY)])
    assert len(host.losses) == 1


def test_a_stop_hook_acts_even_where_the_watch_saw_the_loss_first(api: FakeApi, tmp_path: Path) -> None:
    host = _hooked(api, tmp_path)
    host.r.seen({**api.pods[name_of(KEY)], "metadata": {**api.pods[name_of(KEY)]["metadata"],
                                                         "deletionTimestamp": "2026-12-05T12:00:00Z"}})
    assert len(host.losses) == 1
    # The watch's stop may still be under way: the hook's answer waits for a stop of its own.
    assert host.r.stop_for_kubelet(name_of(KEY), f"token-of-{name_of(KEY)}")[0] == 200
    assert [k for k, _ in host.losses] == [KEY, KEY]


@pytest.mark.parametrize("token", ["", "token-of-someone-else"], ids=["none", "another-reservations"])
def test_a_stop_hook_without_the_reservations_token_stops_nothing(api: FakeApi, tmp_path: Path, token: str) -> None:
    host = _hooked(api, tmp_path)
    status, text = host.r.stop_for_kubelet(name_of(KEY), token)
    assert status == 403 and "X-Weft-Stop-Token" in text
    assert host.losses == [] and host.r.state(KEY)["state"] == "pending"


def test_a_stop_hook_for_a_reservation_released_here_answers_at_once(api: FakeApi, tmp_path: Path) -> None:
    host = _hooked(api, tmp_path)
    host.r.release(KEY)
    assert host.r.stop_for_kubelet(name_of(KEY), f"token-of-{name_of(KEY)}")[0] == 200 and host.losses == []


def test_reservation_pods_are_their_nodes_and_a_cordoned_node_is_said_to_the_mesh(api: FakeApi,
                                                                                   tmp_path: Path) -> None:
    """Its Node is the reservation pod's controller (kubectl drain evicts it without --force), and each
    reconciliation tells the mesh's admission whether the Node is cordoned, and says when it changes."""
    host = Host(api, tmp_path, {KEY}, grace=10)
    told: list[bool] = []
    host.r.on_cordon = told.append
    host.r.reserve(STAGE)
    (owner,) = api.pods[name_of(KEY)]["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == ("Node", "cpu-1", "cpu-1-uid", True)
    host.r.reconcile()
    api.node["spec"]["unschedulable"] = True  # kubectl cordon
    host.r.reconcile()
    assert host.r.cordoned and told[-1] is True
    api.up = False  # the API away: what was read last holds
    with pytest.raises(httpx2.ConnectError):
        host.r.reconcile()
    assert host.r.cordoned
    api.up = True
    api.node["spec"]["unschedulable"] = False  # kubectl uncordon
    host.r.reconcile()
    assert not host.r.cordoned and told[-1] is False
