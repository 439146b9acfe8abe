"""Which node a mesh peer is, read from its TLS certificate, and whether this agent talks to it.

TLS already proved that the peer holds a key the cluster CA signed. What it
does not say is *which* node the peer is, or whether this agent should deal
with it: a certificate for a node that has left the cluster is still signed.
The answer is the SAN URI ``weft://node/<name>`` (``shim.mesh.certs`` puts
exactly one in every node certificate), checked against the set of nodes this
agent knows as peers. A peer is then held to that name: a Hello whose
``origin.node`` is another node is a lie and is refused.

grpcio hands the verified certificate's names to the server in
``context.auth_context()``: a dict of ``str`` to lists of ``bytes``. Recent
grpcio puts URI SANs alone under ``peer_uri``; all grpcio versions list every
SAN (DNS, URI and IP mixed) under ``x509_subject_alternative_name``, which is
read only when ``peer_uri`` is absent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import grpc

from shim.errors import WeftError
from shim.mesh.certs import NODE_URI_PREFIX

AuthContext = Mapping[str, Sequence[bytes]]


class PeerRefused(WeftError):
    """The mesh peer is not one this agent deals with: unknown node, no node, or a lie about its node.

    PERMISSION_DENIED; UNAUTHENTICATED when the peer presented no certificate at all. ``node`` is
    the node on the other side when known: the refused client on a server, the refusing peer on
    a client (``shim.mesh.client``).
    """

    code = grpc.StatusCode.PERMISSION_DENIED

    def __init__(self, message: str, *, node: str | None = None,
                 code: grpc.StatusCode = grpc.StatusCode.PERMISSION_DENIED) -> None:
        super().__init__(message)
        self.node = node
        self.code = code


def node_of_peer(auth_context: AuthContext) -> str | None:
    """The node the peer's certificate names, or None when it names none (or, ambiguously, several)."""
    uris = auth_context.get("peer_uri")
    if uris is None:
        uris = auth_context.get("x509_subject_alternative_name", ())
    nodes = {node for node in (_node_of_uri(u) for u in uris) if node}
    return nodes.pop() if len(nodes) == 1 else None


def has_certificate(auth_context: AuthContext) -> bool:
    return bool(auth_context.get("x509_pem_cert") or auth_context.get("x509_subject_alternative_name")
                or auth_context.get("x509_common_name"))


class PeerPolicy:
    """Admits peers whose certificate names exactly one node, and a node this agent knows."""

    def __init__(self, known_nodes: Iterable[str]) -> None:
        self.known_nodes = frozenset(known_nodes)

    def set_known(self, nodes: Iterable[str]) -> None:
        """Replace the known set (discovery found peers come or go); one assignment, so no lock."""
        self.known_nodes = frozenset(nodes)

    def check(self, auth_context: AuthContext) -> str:
        """The peer's node; raises ``PeerRefused`` when the peer is not welcome."""
        if not has_certificate(auth_context):
            raise PeerRefused("mesh peer presented no client certificate",
                              code=grpc.StatusCode.UNAUTHENTICATED)
        node = node_of_peer(auth_context)
        if node is None:
            raise PeerRefused(f"mesh peer certificate names no single weft node ({NODE_URI_PREFIX}<node> SAN URI)")
        if node not in self.known_nodes:
            raise PeerRefused(f"mesh peer {node!r} is not a known peer of this node", node=node)
        return node

    @staticmethod
    def check_claim(cert_node: str, claimed: str, what: str) -> None:
        """A peer speaks only for the node its certificate names."""
        if claimed != cert_node:
            raise PeerRefused(f"mesh peer {cert_node!r} claims to be {claimed!r} in {what}", node=cert_node)


def _node_of_uri(raw: bytes | str) -> str | None:
    uri = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    if not uri.startswith(NODE_URI_PREFIX):
        return None
    return uri[len(NODE_URI_PREFIX):] or None
