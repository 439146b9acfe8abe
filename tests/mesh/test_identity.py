"""Which node a TLS peer is, from the auth context grpcio gives a server, and who is refused."""

from __future__ import annotations

import grpc
import pytest

from shim.mesh.identity import PeerPolicy, PeerRefused, node_of_peer

# What grpcio 1.85 gives a server for a client certificate with SANs
# DNS gpu-1, URI weft://node/gpu-1, IP 10.0.0.1, DNS gpu-1.example (checked
# against a real connection in integration/mesh/test_mesh_tls.py).
GRPC_CONTEXT = {
    "transport_security_type": [b"ssl"],
    "x509_common_name": [b"gpu-1"],
    "x509_pem_cert": [b"-----BEGIN CERTIFICATE-----\n...\n-----END CERTIFICATE-----\n"],
    "x509_subject_alternative_name": [b"gpu-1", b"weft://node/gpu-1", b"10.0.0.1", b"gpu-1.example"],
    "peer_dns": [b"gpu-1", b"gpu-1.example"],
    "peer_uri": [b"weft://node/gpu-1"],
    "peer_ip": [b"10.0.0.1"],
}
# Older grpcio lists every SAN under one key and has no peer_uri.
OLD_GRPC_CONTEXT = {k: v for k, v in GRPC_CONTEXT.items() if not k.startswith("peer_")}


def _with_uris(*uris: bytes) -> dict[str, list[bytes]]:
    return {**GRPC_CONTEXT, "peer_uri": list(uris),
            "x509_subject_alternative_name": [b"gpu-1", *uris]}


@pytest.mark.parametrize(("ctx", "node"), [
    pytest.param(GRPC_CONTEXT, "gpu-1", id="uri-san-from-peer-uri"),
    pytest.param(OLD_GRPC_CONTEXT, "gpu-1", id="uri-san-among-all-sans-on-older-grpcio"),
    pytest.param(_with_uris(), None, id="dns-name-alone-names-no-node"),
    pytest.param(_with_uris(b"spiffe://cluster/ns/x", b"weft://node/"), None, id="other-and-empty-uris-name-no-node"),
    pytest.param(_with_uris(b"weft://node/a", b"weft://node/b"), None, id="two-nodes-are-ambiguous"),
    pytest.param(_with_uris(b"weft://node/a", b"weft://node/a"), "a", id="same-node-twice-is-that-node"),
    pytest.param({"transport_security_type": [b"insecure"]}, None, id="no-certificate"),
])
def test_node_of_peer(ctx: dict[str, list[bytes]], node: str | None) -> None:
    assert node_of_peer(ctx) == node


def test_policy_admits_a_known_node() -> None:
    assert PeerPolicy({"gpu-1", "cpu-1"}).check(GRPC_CONTEXT) == "gpu-1"


def test_policy_refuses_an_unknown_node_naming_it() -> None:
    with pytest.raises(PeerRefused, match="'gpu-1' is not a known peer") as err:
        PeerPolicy({"cpu-1"}).check(GRPC_CONTEXT)
    assert (err.value.code, err.value.node) == (grpc.StatusCode.PERMISSION_DENIED, "gpu-1")


def test_policy_refuses_a_certificate_that_names_no_node() -> None:
    with pytest.raises(PeerRefused, match="names no single weft node") as err:
        PeerPolicy({"gpu-1"}).check(_with_uris())
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_policy_refuses_a_peer_without_certificate_as_unauthenticated() -> None:
    with pytest.raises(PeerRefused) as err:
        PeerPolicy({"gpu-1"}).check({"transport_security_type": [b"insecure"]})
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_replacing_the_known_set_takes_effect_for_the_next_peer() -> None:
    policy = PeerPolicy({"cpu-1"})
    policy.set_known({"gpu-1"})
    assert policy.check(GRPC_CONTEXT) == "gpu-1"
    policy.set_known(set())
    with pytest.raises(PeerRefused):
        policy.check(GRPC_CONTEXT)


def test_a_peer_speaks_only_for_its_own_node() -> None:
    PeerPolicy.check_claim("gpu-1", "gpu-1", "Hello")
    with pytest.raises(PeerRefused, match="'gpu-1' claims to be 'cpu-1' in Hello"):
        PeerPolicy.check_claim("gpu-1", "cpu-1", "Hello")
