"""The mesh's cluster CA and node certificates (``weft mesh-certs``).

The mesh trusts one cluster CA and nothing else, and a peer is the node its
certificate names. So each node certificate carries its node twice: SAN URI
``weft://node/<node>`` (what ``shim.mesh.identity`` reads, unambiguous among
other names) and SAN DNS ``<node>`` (what TLS hostname verification checks
when a client dials the node with ``grpc.ssl_target_name_override``), plus
the node's addresses so that tools dialling an IP also verify. Both server
and client authentication are allowed: every agent is both ends.

Keys are EC P-256: gRPC's BoringSSL accepts it on every platform grpcio ships
for, and it is cheap to handshake.

``write_mesh_certs`` keeps an existing CA in the output directory, so adding a
node later does not invalidate the certificates already handed out, and it
keeps a node's certificate that still matches what was asked, so running it
twice changes nothing.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shim import stopping
from shim.core import meshcsr
from shim.errors import ConfigError

NODE_URI_PREFIX = meshcsr.NODE_URI_PREFIX

CA_VALID_DAYS = 3650
NODE_VALID_DAYS = 365

# Kubernetes node names are DNS subdomains (RFC 1123); the name also becomes a
# file name here, so nothing else may pass.
_NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# Clocks across a cluster disagree a little; a certificate valid from "now" on
# a node whose clock is behind would be refused for its first minutes.
_BACKDATE = dt.timedelta(minutes=5)


class MeshTls(NamedTuple):
    """What one agent needs to speak on the mesh: its own pair and the cluster CA (all PEM)."""

    key_pem: bytes
    cert_pem: bytes
    ca_pem: bytes


def load_node_tls(cert_dir: Path, node: str) -> MeshTls:
    """``<node>.key``, ``<node>.crt`` and ``ca.crt`` from a directory ``write_mesh_certs`` filled."""
    check_node_name(node)
    paths = [Path(cert_dir) / f"{node}.key", Path(cert_dir) / f"{node}.crt", Path(cert_dir) / "ca.crt"]
    try:
        key, cert, ca = (p.read_bytes() for p in paths)
    except OSError as exc:
        raise ConfigError(f"mesh TLS for node {node!r} cannot be read: {exc}") from exc
    if cert_nodes(cert) != [node]:
        raise ConfigError(f"mesh certificate {paths[1]} names {cert_nodes(cert)}, not node {node!r}")
    return MeshTls(key, cert, ca)


def cert_nodes(cert_pem: bytes) -> list[str]:
    """The nodes a certificate names by SAN URI (one, for a certificate this module issued)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return []
    uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
    return [u[len(NODE_URI_PREFIX):] for u in uris if u.startswith(NODE_URI_PREFIX)]


def node_uri(node: str) -> str:
    return NODE_URI_PREFIX + node


def check_node_name(node: str) -> str:
    if len(node) > 253 or not _NODE_NAME.fullmatch(node):
        raise ConfigError(f"mesh node name {node!r} is not a lowercase DNS name (a Kubernetes node name)")
    return node


def generate_ca(common_name: str = "weft mesh CA", *, valid_days: int = CA_VALID_DAYS) -> tuple[bytes, bytes]:
    """A new cluster CA: ``(key_pem, cert_pem)``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + dt.timedelta(days=valid_days))
        # path_length=0: the CA signs node certificates only, never another CA.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _key_pem(key), cert.public_bytes(serialization.Encoding.PEM)


def issue_node_cert(
    ca_key_pem: bytes,
    ca_cert_pem: bytes,
    node: str,
    addresses: Sequence[str] = (),
    *,
    valid_days: int = NODE_VALID_DAYS,
) -> tuple[bytes, bytes]:
    """A key and certificate for ``node``, signed by the CA: ``(key_pem, cert_pem)``.

    ``addresses`` are extra names: IP addresses become IP SANs, anything else a DNS SAN.
    """
    check_node_name(node)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert_pem = sign_node_cert(ca_key_pem, ca_cert_pem, node, key.public_key(), addresses,
                              not_after=now + dt.timedelta(days=valid_days))
    return _key_pem(key), cert_pem


def sign_node_cert(
    ca_key_pem: bytes,
    ca_cert_pem: bytes,
    node: str,
    public_key: ec.EllipticCurvePublicKey,
    addresses: Sequence[str] = (),
    *,
    not_after: dt.datetime,
    backdate: dt.timedelta = _BACKDATE,
) -> bytes:
    """A node certificate for a public key (the node keeps the private one): PEM, signed by the CA.

    ``not_after`` is cut to the CA's own end; ``backdate`` allows for clocks a little behind.
    """
    check_node_name(node)
    ca_key, ca_cert = _load_ca(ca_key_pem, ca_cert_pem)
    now = dt.datetime.now(dt.UTC)
    not_after = min(not_after, ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - backdate)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(_san(node, addresses)), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def write_mesh_certs(
    out_dir: Path,
    nodes: Sequence[str],
    addresses: Mapping[str, Sequence[str]] = {},
    *,
    valid_days: int = NODE_VALID_DAYS,
) -> dict[str, Path]:
    """Write ``ca.crt``, ``ca.key`` and ``<node>.crt``/``<node>.key`` under ``out_dir``; file name -> path."""
    return _write_mesh_certs(Path(out_dir), nodes, addresses, valid_days)[0]


def parse_node_spec(spec: str) -> tuple[str, list[str]]:
    """``NAME[=ADDR,...]`` (the ``--node`` flag) -> ``(name, [addr, ...])``."""
    name, _, rest = spec.partition("=")
    addrs = [a.strip() for a in rest.split(",") if a.strip()]
    return check_node_name(name.strip()), addrs


def main(out_dir: Path, nodes: Sequence[str], addresses: Mapping[str, Sequence[str]] = {}) -> int:
    """``weft mesh-certs``: print one line per file, saying whether it was written or kept."""
    if not nodes:
        raise ConfigError("name at least one node (--nodes a,b,c or --node NAME[=ADDR,...])")
    paths, written = _write_mesh_certs(Path(out_dir), nodes, addresses, NODE_VALID_DAYS)
    for name, path in paths.items():
        print(f"{'wrote' if name in written else 'kept '} {path}")
    print(f"mesh CA and {len(nodes)} node certificate(s) in {out_dir}; copy ca.crt and each node's pair to that node")
    return 0


def _write_mesh_certs(
    out_dir: Path, nodes: Sequence[str], addresses: Mapping[str, Sequence[str]], valid_days: int
) -> tuple[dict[str, Path], set[str]]:
    for node in nodes:
        check_node_name(node)
    unknown = set(addresses) - set(nodes)
    if unknown:
        raise ConfigError(f"mesh-certs: addresses given for nodes that are not listed: {sorted(unknown)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    written: set[str] = set()

    ca_key_path, ca_cert_path = out_dir / "ca.key", out_dir / "ca.crt"
    if ca_key_path.exists() or ca_cert_path.exists():
        if not (ca_key_path.exists() and ca_cert_path.exists()):
            missing = ca_cert_path if ca_key_path.exists() else ca_key_path
            raise ConfigError(f"mesh-certs: {missing} is missing beside its pair; restore it, or remove both "
                              "to start a new CA (which invalidates every node certificate)")
        ca_key_pem, ca_cert_pem = ca_key_path.read_bytes(), ca_cert_path.read_bytes()
        _load_ca(ca_key_pem, ca_cert_pem)
        ca_key_path.chmod(0o600)
    else:
        ca_key_pem, ca_cert_pem = generate_ca()
        write_file(ca_key_path, ca_key_pem, 0o600)
        write_file(ca_cert_path, ca_cert_pem, 0o644)
        written |= {"ca.key", "ca.crt"}
    paths["ca.crt"], paths["ca.key"] = ca_cert_path, ca_key_path

    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    for node in nodes:
        addrs = list(addresses.get(node, ()))
        key_path, cert_path = out_dir / f"{node}.key", out_dir / f"{node}.crt"
        if _still_good(key_path, cert_path, ca_cert, node, addrs, valid_days):
            key_path.chmod(0o600)
        else:
            key_pem, cert_pem = issue_node_cert(ca_key_pem, ca_cert_pem, node, addrs, valid_days=valid_days)
            write_file(key_path, key_pem, 0o600)
            write_file(cert_path, cert_pem, 0o644)
            written |= {key_path.name, cert_path.name}
        paths[cert_path.name], paths[key_path.name] = cert_path, key_path
    return paths, written


def _still_good(
    key_path: Path, cert_path: Path, ca_cert: x509.Certificate, node: str, addrs: Sequence[str], valid_days: int
) -> bool:
    """An existing pair is kept only if reissuing it would give the same names, issuer and key."""
    if not (key_path.exists() and cert_path.exists()):
        return False
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        cert.verify_directly_issued_by(ca_cert)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
        return False
    if key.public_key() != cert.public_key() or set(sans) != set(_san(node, addrs)):
        return False
    # Renew once a third of the asked-for lifetime is left, so a rerun before expiry renews.
    return cert.not_valid_after_utc - dt.datetime.now(dt.UTC) > dt.timedelta(days=valid_days) / 3


def _san(node: str, addresses: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName(node), x509.UniformResourceIdentifier(node_uri(node))]
    for addr in addresses:
        try:
            name: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(addr))
        except ValueError:
            name = x509.DNSName(addr)
        if name not in names:
            names.append(name)
    return names


def _load_ca(ca_key_pem: bytes, ca_cert_pem: bytes) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    try:
        key = serialization.load_pem_private_key(ca_key_pem, password=None)
        cert = x509.load_pem_x509_certificate(ca_cert_pem)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"mesh CA key or certificate cannot be read: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"mesh CA key is {type(key).__name__}, not an EC key")
    if key.public_key() != cert.public_key():
        raise ConfigError("mesh CA key does not belong to the CA certificate")
    return key, cert


load_ca = _load_ca
BACKDATE = _BACKDATE


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def write_file(path: Path, data: bytes, mode: int) -> None:
    """Write through a temporary file so a crash never leaves half a key; a key is never readable by others.

    Under ``shim.stopping.writing``: a process SIGTERM ends does not end in the middle of it.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    with stopping.writing():
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.chmod(tmp, mode)  # umask may have narrowed it; a cert must stay readable
        os.replace(tmp, path)
