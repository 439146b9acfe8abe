"""The mesh signer's rule (shim.core.meshcsr), on facts as shim.mesh.csr reads them from real requests."""

from __future__ import annotations

import dataclasses

import pytest

from shim.core.meshcsr import CsrFacts, Reason, decide, lifetime_s, renew_at, requester_node
from shim.mesh import csr

USAGES = ("digital signature", "server auth", "client auth")


def _facts(node: str = "cpu-1", *, user: str = "system:node:cpu-1", groups=("system:nodes", "system:authenticated"),
           usages=USAGES, names: tuple[str, ...] | None = None) -> CsrFacts:
    return csr.facts(csr.request_pem(csr.new_key(), node, names=names), user, groups, usages)


def test_a_node_asking_for_itself_is_approved() -> None:
    d = decide(_facts(), node_in_cluster=True)
    assert (d.approved, d.reason, d.node) == (True, Reason.APPROVED, "cpu-1")


@pytest.mark.parametrize(("user", "groups"), [
    ("system:serviceaccount:weft-system:weft", ("system:serviceaccounts",)),  # weft's own account: any node's
    ("system:node:cpu-1", ("system:authenticated",)),  # the name without the group
    ("admin", ("system:masters",)),
])
def test_only_a_node_s_kubelet_identity_may_ask(user: str, groups: tuple[str, ...]) -> None:
    d = decide(_facts(user=user, groups=groups), node_in_cluster=True)
    assert (d.approved, d.reason) == (False, Reason.NOT_A_NODE)
    assert user in d.message


def test_a_node_asking_for_another_node_s_name_is_refused_naming_both() -> None:
    d = decide(_facts("gpu-1"), node_in_cluster=True)
    assert (d.approved, d.reason) == (False, Reason.OTHER_NODE)
    assert "'cpu-1' asked for a certificate naming ['gpu-1']" in d.message
    # Its own name beside another's is no better.
    d = decide(_facts(names=("cpu-1", "gpu-1")), node_in_cluster=True)
    assert (d.approved, d.reason) == (False, Reason.OTHER_NODE)


def test_a_removed_node_is_refused() -> None:
    d = decide(_facts(), node_in_cluster=False)
    assert (d.approved, d.reason) == (False, Reason.NOT_IN_CLUSTER)


def test_extra_names_keys_signatures_and_usages_are_refused() -> None:
    good = _facts()
    cases = {
        Reason.BAD_NAMES: dataclasses.replace(good, other_names=("IPAddress 10.0.0.1",)),
        Reason.BAD_KEY: dataclasses.replace(good, ec_p256=False),
    }
    cases_sig = dataclasses.replace(good, signature_ok=False)
    for reason, facts in cases.items():
        assert decide(facts, True).reason == reason
    assert decide(cases_sig, True).reason == Reason.BAD_KEY
    assert decide(dataclasses.replace(good, usages=("client auth",)), True).reason == Reason.BAD_USAGES
    assert decide(dataclasses.replace(good, usages=(*USAGES, "code signing")), True).reason == Reason.BAD_USAGES
    assert decide(dataclasses.replace(good, uris=()), True).reason == Reason.BAD_NAMES


def test_an_unreadable_request_is_refused_as_malformed() -> None:
    facts = csr.facts(b"not a request", "system:node:cpu-1", ("system:nodes",), USAGES)
    assert decide(facts, True).reason == Reason.MALFORMED


def test_requester_lifetime_and_renewal_time() -> None:
    assert requester_node("system:node:a", ["system:nodes"]) == "a"
    assert requester_node("system:node:a", []) == ""
    assert lifetime_s(None, 3600) == 3600
    assert lifetime_s(600, 3600) == 600
    assert lifetime_s(86400, 3600) == 3600
    assert renew_at(1000.0, 1900.0, 2 / 3) == pytest.approx(1600.0)
