"""A node's mesh key and certificate request, and what a request says (for the signer's rule).

The key is made where it is used (``new_key``) and never leaves that node:
the node sends only a PKCS#10 request (``request_pem``) naming itself as a
mesh certificate names a node (CN and SAN DNS ``<node>``, SAN URI
``weft://node/<node>``), signed by the key. The signer reads it back with
``facts`` and decides with ``shim.core.meshcsr.decide``.
"""

from __future__ import annotations

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from shim.core.meshcsr import CsrFacts
from shim.mesh.certs import check_node_name, node_uri

PEM_CERT_END = b"-----END CERTIFICATE-----"


def new_key() -> bytes:
    """A new EC P-256 private key, PEM (PKCS#8, unencrypted: the file's mode protects it)."""
    key = ec.generate_private_key(ec.SECP256R1())
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def load_key(key_pem: bytes) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise ValueError("the mesh key is not an EC P-256 key")
    return key


def request_pem(key_pem: bytes, node: str, *, names: tuple[str, ...] | None = None) -> bytes:
    """A PKCS#10 request for ``node``'s mesh certificate, signed by its key.

    ``names`` (tests only) replaces the node in the CN, SAN DNS and SAN URI, to ask for another node's name.
    """
    check_node_name(node)
    key = load_key(key_pem)
    named = names or (node,)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, n) for n in named[:1]]))
        .add_extension(x509.SubjectAlternativeName(
            [x509.DNSName(n) for n in named] + [x509.UniformResourceIdentifier(node_uri(n)) for n in named]),
            critical=False)
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)


def facts(request: bytes, username: str, groups: list[str] | tuple[str, ...],
          usages: list[str] | tuple[str, ...]) -> CsrFacts:
    """What a CSR says: its requester (from the API object) and the names, key and signature of its request."""
    who = {"username": username or "", "groups": tuple(groups or ()), "usages": tuple(usages or ())}
    try:
        csr = x509.load_pem_x509_csr(request)
    except ValueError as exc:
        return CsrFacts(**who, malformed=f"not a PEM certificate request ({exc})")
    cns, others = [], []
    for attr in csr.subject:
        if attr.oid == NameOID.COMMON_NAME:
            cns.append(str(attr.value))
        else:
            others.append(f"subject {attr.oid.dotted_string}={attr.value}")
    dns: list[str] = []
    uris: list[str] = []
    try:
        for ext in csr.extensions:
            if isinstance(ext.value, x509.SubjectAlternativeName):
                for name in ext.value:
                    if isinstance(name, x509.DNSName):
                        dns.append(name.value)
                    elif isinstance(name, x509.UniformResourceIdentifier):
                        uris.append(name.value)
                    else:
                        others.append(f"{type(name).__name__} {name.value}")
        key = csr.public_key()
        signature_ok = csr.is_signature_valid
    except (ValueError, x509.DuplicateExtension, x509.UnsupportedGeneralNameType) as exc:
        return CsrFacts(**who, malformed=str(exc))
    return CsrFacts(**who, common_names=tuple(cns), dns=tuple(dns), uris=tuple(uris), other_names=tuple(others),
                    ec_p256=isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1),
                    signature_ok=signature_ok)


def public_key_of(request: bytes) -> ec.EllipticCurvePublicKey:
    key = x509.load_pem_x509_csr(request).public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey)
    return key


def split_issued(pem: bytes) -> tuple[bytes, bytes]:
    """``status.certificate`` as the signer writes it (the node's certificate, then the CA's): ``(cert, ca)``."""
    blocks = [b + PEM_CERT_END + b"\n" for b in pem.split(PEM_CERT_END) if b.strip()]
    blocks = [b.lstrip() for b in blocks]
    if len(blocks) != 2:
        raise ValueError(f"the issued certificate has {len(blocks)} PEM blocks, not the node's and the CA's")
    for b in blocks:
        x509.load_pem_x509_certificate(b)
    return blocks[0], blocks[1]
