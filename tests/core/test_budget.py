"""Stage budgets: which reservations a workload's PodDisruptionBudget covers on a host, and how strictly."""

import pytest

from shim.core.budget import (
    HostedReservation,
    SelectorError,
    WorkloadBudget,
    budget_name,
    manifest,
    plan,
    selects,
)
from shim.core.reservation import KEY_LABEL


@pytest.mark.parametrize(
    ("selector", "labels", "want"),
    [
        pytest.param(None, {"app": "a"}, False, id="no-selector-selects-nothing"),
        pytest.param({}, {}, True, id="empty-selects-everything"),
        pytest.param({"matchLabels": {"app": "a"}}, {"app": "a", "x": "y"}, True, id="match-labels"),
        pytest.param({"matchLabels": {"app": "a"}}, {"app": "b"}, False, id="match-labels-other-value"),
        pytest.param({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["x", "y"]}]},
                     {"tier": "y"}, True, id="in"),
        pytest.param({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["x"]}]}, {}, False,
                     id="in-missing-key"),
        pytest.param({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["x"]}]}, {}, True,
                     id="notin-missing-key"),
        pytest.param({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["x"]}]},
                     {"tier": "x"}, False, id="notin"),
        pytest.param({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}, {"tier": ""}, True, id="exists"),
        pytest.param({"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}, {"tier": "x"}, False,
                     id="does-not-exist"),
        pytest.param({"matchLabels": {"app": "a"}, "matchExpressions": [{"key": "tier", "operator": "Exists"}]},
                     {"app": "a"}, False, id="all-terms-must-hold"),
    ],
)
def test_a_selector_selects_as_the_api_does(selector, labels, want) -> None:
    assert selects(selector, labels) is want


def test_an_operator_policy_does_not_have_is_named() -> None:
    with pytest.raises(SelectorError, match=r"'Near'.*'tier'"):
        selects({"matchExpressions": [{"key": "tier", "operator": "Near"}]}, {})


def _r(key: str, pod: str, ns: str = "default", **labels: str) -> HostedReservation:
    return HostedReservation(key, ns, pod, labels)


def test_a_budget_that_allows_nothing_holds_every_reservation_of_its_pods_on_the_host() -> None:
    got = plan("cpu-1", [_r("k1", "web-0", app="web"), _r("k2", "web-1", app="web"), _r("k3", "db-0", app="db")],
               [WorkloadBudget("default", "web", 0, {"matchLabels": {"app": "web"}})])
    (sb,) = got.values()
    assert (sb.name, sb.of, sb.keys, sb.min_available) == (budget_name("cpu-1", "default", "web"), "default/web",
                                                           ("k1", "k2"), 2)


def test_the_allowance_is_taken_off_and_never_below_zero() -> None:
    rs = [_r("k1", "web-0", app="web"), _r("k2", "web-1", app="web")]
    for allowed, want in ((1, 1), (2, 0), (5, 0)):
        (sb,) = plan("cpu-1", rs, [WorkloadBudget("default", "web", allowed, {"matchLabels": {"app": "web"}})]).values()
        assert sb.min_available == want, allowed


def test_a_reservation_is_covered_once_by_the_strictest_budget_of_its_own_namespace() -> None:
    rs = [_r("k1", "web-0", app="web", tier="front"), _r("k2", "web-0", ns="other", app="web")]
    got = plan("cpu-1", rs, [WorkloadBudget("default", "loose", 3, {"matchLabels": {"app": "web"}}),
                             WorkloadBudget("default", "strict", 0, {"matchLabels": {"tier": "front"}})])
    assert [(sb.of, sb.keys) for sb in got.values()] == [("default/strict", ("k1",))]


def test_pods_no_budget_selects_get_no_stage_budget() -> None:
    assert plan("cpu-1", [_r("k1", "a", app="a")],
                [WorkloadBudget("default", "b", 0, {"matchLabels": {"app": "b"}}),
                 WorkloadBudget("default", "none", 0, None)]) == {}


def test_each_host_keeps_its_own_stage_budget_of_one_workload_budget() -> None:
    assert budget_name("cpu-1", "default", "web") != budget_name("cpu-2", "default", "web")


def test_the_stage_budget_selects_its_reservations_by_key_and_goes_with_the_node() -> None:
    (sb,) = plan("cpu-1", [_r("k1", "web-0", app="web")],
                 [WorkloadBudget("default", "web", 0, {"matchLabels": {"app": "web"}})]).values()
    body = manifest(sb, host="cpu-1", host_label="cpu-1", namespace="weft-system", node_uid="u-1")
    assert body["spec"] == {"minAvailable": 1, "selector": {"matchExpressions": [
        {"key": KEY_LABEL, "operator": "In", "values": ["k1"]}]}}
    meta = body["metadata"]
    assert meta["namespace"] == "weft-system" and meta["labels"]["weft.io/host"] == "cpu-1"
    assert meta["annotations"]["weft.io/budget-of"] == "default/web"
    assert meta["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": "cpu-1", "uid": "u-1"}]
