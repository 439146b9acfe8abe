"""A host's stage budgets against an API that keeps objects in memory (what the host writes, and when)."""

from __future__ import annotations

import datetime

import httpx2
import lightkube
import pytest
from lightkube.resources.core_v1 import Pod
from lightkube.resources.policy_v1 import PodDisruptionBudget
from structlog.testing import capture_logs

from shim.core.budget import budget_name
from shim.shadowhost.budgets import StageBudgets


def _api_error(code: int) -> lightkube.ApiError:
    response = httpx2.Response(code, json={"kind": "Status", "code": code, "message": f"said {code}"},
                               request=httpx2.Request("GET", "https://api"))
    return lightkube.ApiError(response=response)


class FakeApi:
    def __init__(self) -> None:
        self.objects: dict[tuple[type, str, str], dict] = {}
        self.writes: list[tuple[str, str]] = []
        self.down = False

    def put(self, kind: type, body: dict) -> None:
        meta = body["metadata"]
        self.objects[(kind, meta["namespace"], meta["name"])] = body

    def list(self, kind, namespace, labels=None):
        self._up()
        for (k, ns, _), body in list(self.objects.items()):
            if k is kind and ns == namespace and all(
                    (body["metadata"].get("labels") or {}).get(a) == b for a, b in (labels or {}).items()):
                yield kind.from_dict(body)

    def get(self, kind, name, namespace):
        self._up()
        if (kind, namespace, name) not in self.objects:
            raise _api_error(404)
        return kind.from_dict(self.objects[(kind, namespace, name)])

    def create(self, obj, namespace):
        self._up()
        body = obj.to_dict()
        body["metadata"]["namespace"] = namespace
        if (type(obj), namespace, body["metadata"]["name"]) in self.objects:
            raise _api_error(409)
        self.put(type(obj), body)
        self.writes.append(("create", body["metadata"]["name"]))

    def patch(self, kind, name, patch, namespace, patch_type):
        self._up()
        body = self.objects[(kind, namespace, name)]
        body["spec"].update(patch["spec"])
        body["metadata"].update(patch.get("metadata") or {})
        self.writes.append(("patch", name))

    def delete(self, kind, name, namespace):
        self._up()
        self.objects.pop((kind, namespace, name))
        self.writes.append(("delete", name))

    def _up(self) -> None:
        if self.down:
            raise httpx2.ConnectError("refused")


def _reservation(key: str, pod: str, ns: str = "default") -> Pod:
    return Pod.from_dict({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": f"weft-hosted-{key}", "namespace": "weft-system",
        "labels": {"weft.io/role": "hosted-stage", "weft.io/origin-key": key},
        "annotations": {"weft.io/origin": f"{ns}/{pod}/prep"}}})


def _workload(api: FakeApi, name: str, pod_labels: dict, allowed: int, ns: str = "default") -> None:
    api.put(Pod, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns,
                                                                  "labels": pod_labels}})
    api.put(PodDisruptionBudget, {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                                  "metadata": {"name": f"{name}-pdb", "namespace": ns},
                                  "spec": {"minAvailable": 1, "selector": {"matchLabels": pod_labels}},
                                  "status": {"disruptionsAllowed": allowed, "currentHealthy": 1,
                                             "desiredHealthy": 1, "expectedPods": 1}})


def _stage_budgets(api: FakeApi) -> dict[str, dict]:
    return {name: body for (kind, ns, name), body in api.objects.items()
            if kind is PodDisruptionBudget and ns == "weft-system"}


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


def test_a_budget_that_allows_nothing_gets_a_stage_budget_that_follows_it_and_goes_with_it(api: FakeApi) -> None:
    _workload(api, "web-0", {"app": "web"}, allowed=0)
    budgets = StageBudgets(lambda: api, "cpu-1", "weft-system")
    budgets.sync([_reservation("k1", "web-0")], node_uid="u-1")
    name = budget_name("cpu-1", "default", "web-0-pdb")
    (sb,) = _stage_budgets(api).values()
    assert sb["metadata"]["name"] == name and sb["spec"]["minAvailable"] == 1
    assert sb["metadata"]["labels"]["weft.io/host"] == "cpu-1"

    budgets.sync([_reservation("k1", "web-0")], node_uid="u-1")
    assert api.writes == [("create", name)]  # nothing changed: nothing written

    api.objects[(PodDisruptionBudget, "default", "web-0-pdb")]["status"]["disruptionsAllowed"] = 1
    budgets.sync([_reservation("k1", "web-0")], node_uid="u-1")
    assert _stage_budgets(api)[name]["spec"]["minAvailable"] == 0 and api.writes[-1] == ("patch", name)

    del api.objects[(PodDisruptionBudget, "default", "web-0-pdb")]
    budgets.sync([_reservation("k1", "web-0")], node_uid="u-1")
    assert _stage_budgets(api) == {} and api.writes[-1] == ("delete", name)


def test_no_reservation_left_no_stage_budget_left(api: FakeApi) -> None:
    _workload(api, "web-0", {"app": "web"}, allowed=0)
    budgets = StageBudgets(lambda: api, "cpu-1", "weft-system")
    budgets.sync([_reservation("k1", "web-0")])
    assert _stage_budgets(api)
    budgets.sync([])
    assert _stage_budgets(api) == {}


def test_a_host_with_no_stage_budget_to_keep_asks_for_its_list_once(api: FakeApi) -> None:
    budgets = StageBudgets(lambda: api, "cpu-1", "weft-system")
    listed = []
    real = api.list
    api.list = lambda kind, namespace, labels=None: listed.append(kind) or real(kind, namespace, labels)
    for _ in range(3):
        budgets.sync([])
    assert listed == [PodDisruptionBudget]
    _workload(api, "web-0", {"app": "web"}, allowed=0)
    budgets.sync([_reservation("k1", "web-0")])
    assert _stage_budgets(api)


def test_another_hosts_stage_budgets_are_left_alone(api: FakeApi) -> None:
    _workload(api, "web-0", {"app": "web"}, allowed=0)
    StageBudgets(lambda: api, "cpu-2", "weft-system").sync([_reservation("k2", "web-0")])
    StageBudgets(lambda: api, "cpu-1", "weft-system").sync([])
    assert list(_stage_budgets(api)) == [budget_name("cpu-2", "default", "web-0-pdb")]


def test_an_api_that_does_not_answer_leaves_what_is_there_and_is_said_once(api: FakeApi) -> None:
    _workload(api, "web-0", {"app": "web"}, allowed=0)
    budgets = StageBudgets(lambda: api, "cpu-1", "weft-system")
    budgets.sync([_reservation("k1", "web-0")])
    before = dict(_stage_budgets(api))
    api.down = True
    with capture_logs() as logs:
        budgets.sync([])
        budgets.sync([])
    api.down = False
    assert _stage_budgets(api) == before
    said = [e for e in logs if e["event"] == "budget.sync_failed"]
    assert len(said) == 1 and "did not answer" in said[0]["error"], logs


def test_a_reservation_whose_origin_pod_is_gone_is_not_covered(api: FakeApi) -> None:
    _workload(api, "web-0", {"app": "web"}, allowed=0)
    del api.objects[(Pod, "default", "web-0")]
    StageBudgets(lambda: api, "cpu-1", "weft-system").sync([_reservation("k1", "web-0")])
    assert _stage_budgets(api) == {}


def test_a_reservation_being_evicted_stays_selected_so_the_next_round_allows_no_second_one(api: FakeApi) -> None:
    _workload(api, "web-0", {"app": "web"}, allowed=1)
    _workload(api, "web-1", {"app": "web"}, allowed=1)
    api.objects[(PodDisruptionBudget, "default", "web-1-pdb")]["spec"]["selector"] = {"matchLabels": {"x": "y"}}
    budgets = StageBudgets(lambda: api, "cpu-1", "weft-system")
    going = _reservation("k1", "web-0")
    going.metadata.deletionTimestamp = datetime.datetime.now(datetime.UTC)
    budgets.sync([going, _reservation("k2", "web-0")], node_uid="u-1")
    (sb,) = _stage_budgets(api).values()
    # Two selected, one of them going: one more eviction would be a second disruption.
    assert sb["spec"]["selector"]["matchExpressions"][0]["values"] == ["k1", "k2"]
    assert sb["spec"]["minAvailable"] == 1


def test_a_budget_made_before_its_node_was_read_gets_its_owner_later(api: FakeApi) -> None:
    _workload(api, "web-0", {"app": "web"}, allowed=0)
    budgets = StageBudgets(lambda: api, "cpu-1", "weft-system")
    budgets.sync([_reservation("k1", "web-0")], node_uid="")
    (sb,) = _stage_budgets(api).values()
    assert "ownerReferences" not in sb["metadata"]
    budgets.sync([_reservation("k1", "web-0")], node_uid="u-1")
    assert api.writes[-1][0] == "patch"
