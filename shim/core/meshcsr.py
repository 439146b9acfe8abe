"""The mesh signer's rule: whether a certificate request for the mesh is signed, and for how long.

A node asks for its mesh certificate through the Kubernetes CSR API
(``certificates.k8s.io/v1``, signerName ``weft.io/mesh``) with the kubelet's
own credentials, so the API server records the requester as
``system:node:<node>`` in group ``system:nodes``: an identity only that
node's kubelet holds (its client certificate). The request is signed when

- its requester is a node (``system:node:<name>``, in ``system:nodes``);
- it names that same node and nothing else: subject CN ``<node>``, SAN DNS
  ``<node>`` and SAN URI ``weft://node/<node>`` (what peers read), no other
  name;
- its key is EC P-256 and it is signed by that key (proof of possession);
- its usages are within digital signature, key encipherment, server and
  client auth;
- the node is still a Node of the cluster (a removed node renews nothing).

Pure: the signer (``shim.mesh.signer``) gathers the facts (the CSR object, the
parsed request, whether the Node exists) and acts on the decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

SIGNER_NAME = "weft.io/mesh"
NODE_USER_PREFIX = "system:node:"
NODES_GROUP = "system:nodes"
NODE_URI_PREFIX = "weft://node/"
ALLOWED_USAGES = frozenset({"digital signature", "key encipherment", "server auth", "client auth"})
NEEDED_USAGES = frozenset({"server auth", "client auth"})
# The API server refuses a CSR asking for less than this (spec.expirationSeconds).
MIN_REQUEST_S = 600


class Reason(StrEnum):
    """A decision's reason: the CSR condition's ``reason`` (CamelCase, as Kubernetes' own)."""

    APPROVED = "WeftMeshNodeVerified"
    NOT_A_NODE = "RequesterNotANode"
    OTHER_NODE = "NodeMismatch"
    NOT_IN_CLUSTER = "NodeNotInCluster"
    BAD_NAMES = "BadNames"
    BAD_KEY = "BadKey"
    BAD_USAGES = "BadUsages"
    MALFORMED = "MalformedRequest"


@dataclass(frozen=True)
class CsrFacts:
    """What a CSR object and its PKCS#10 request say (``shim.mesh.csr.facts`` reads them)."""

    username: str
    groups: tuple[str, ...]
    usages: tuple[str, ...]
    common_names: tuple[str, ...] = ()
    dns: tuple[str, ...] = ()
    uris: tuple[str, ...] = ()
    other_names: tuple[str, ...] = ()  # SANs of other kinds (IP, email, ...), and subject fields besides CN
    ec_p256: bool = False
    signature_ok: bool = False
    malformed: str = ""  # why the request could not be read; empty when it was


@dataclass(frozen=True)
class Decision:
    approved: bool
    reason: Reason
    message: str
    node: str = ""  # the requesting node, when the requester is one


def requester_node(username: str, groups: tuple[str, ...] | list[str]) -> str:
    """The node a requester is (``system:node:<name>`` in ``system:nodes``), or '' for anyone else."""
    if not username.startswith(NODE_USER_PREFIX) or NODES_GROUP not in groups:
        return ""
    return username[len(NODE_USER_PREFIX):]


def decide(facts: CsrFacts, node_in_cluster: bool) -> Decision:
    """Sign or refuse, with the reason; ``node_in_cluster``: the requesting node's Node object exists."""
    node = requester_node(facts.username, facts.groups)
    if not node:
        return Decision(False, Reason.NOT_A_NODE,
                        f"requested by {facts.username!r}, not a node's kubelet (system:node:<name> in "
                        f"{NODES_GROUP}): a mesh certificate is issued to the node that asks for itself")
    if facts.malformed:
        return Decision(False, Reason.MALFORMED, f"the request cannot be read: {facts.malformed}", node)
    named = set(facts.common_names) | set(facts.dns) | {u[len(NODE_URI_PREFIX):] for u in facts.uris
                                                        if u.startswith(NODE_URI_PREFIX)}
    others = named - {node}
    if others:
        return Decision(False, Reason.OTHER_NODE,
                        f"node {node!r} asked for a certificate naming {sorted(others)}: a node gets a certificate "
                        "for itself only", node)
    expected_uri = NODE_URI_PREFIX + node
    if (facts.common_names != (node,) or facts.dns != (node,) or facts.uris != (expected_uri,)
            or facts.other_names):
        return Decision(False, Reason.BAD_NAMES,
                        f"a mesh request names CN={node}, SAN DNS {node} and SAN URI {expected_uri}, and nothing "
                        f"else (got CN {list(facts.common_names)}, DNS {list(facts.dns)}, URI {list(facts.uris)}, "
                        f"other {list(facts.other_names)})", node)
    if not facts.ec_p256:
        return Decision(False, Reason.BAD_KEY, "the key is not EC P-256", node)
    if not facts.signature_ok:
        return Decision(False, Reason.BAD_KEY, "the request is not signed by its key", node)
    usages = set(facts.usages)
    if not usages <= ALLOWED_USAGES or not usages >= NEEDED_USAGES:
        return Decision(False, Reason.BAD_USAGES,
                        f"usages {sorted(usages)}: a mesh certificate is for {sorted(NEEDED_USAGES)} "
                        f"(within {sorted(ALLOWED_USAGES)})", node)
    if not node_in_cluster:
        return Decision(False, Reason.NOT_IN_CLUSTER,
                        f"node {node!r} is not a Node of the cluster (removed): it gets no mesh certificate", node)
    return Decision(True, Reason.APPROVED, f"the requester is node {node!r} and the request names it alone", node)


def lifetime_s(requested: int | None, max_lifetime_s: int) -> int:
    """The certificate's lifetime: what the node asked for, at most the signer's maximum."""
    if requested is None or requested <= 0:
        return max_lifetime_s
    return min(requested, max_lifetime_s)


def renew_at(not_before: float, not_after: float, share: float) -> float:
    """When a node asks for its next certificate: ``share`` of the way through the current one's lifetime."""
    return not_before + share * max(0.0, not_after - not_before)
