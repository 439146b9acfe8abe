"""The cluster's certificates and keys: a CA, the API server's serving certificate, the service-account key pair.

Everything is written once into the control plane's work directory. The harness's clients authenticate
with static tokens (``--token-auth-file``); nodes laid out as kubeadm lays them get client certificates
from the CA (:meth:`Pki.client_certificate`), as the API server's ``--client-ca-file`` accepts. The CA is
what kubelets, kubectl and the ``kube-root-ca.crt`` ConfigMap trust.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    sa_public: Path
    sa_private: Path
    ca_key: Path | None = None  # kept for client certificates of nodes laid out as kubeadm lays them

    def client_certificate(self, common_name: str, organization: str) -> tuple[bytes, bytes]:
        """A client certificate and key (PEM) signed by the cluster CA: a kubelet's ``system:node:<name>``
        in ``system:nodes``, as kubeadm's TLS bootstrap leaves it in /var/lib/kubelet/pki."""
        assert self.ca_key is not None, "this PKI kept no CA key"
        ca = x509.load_pem_x509_certificate(self.ca_cert.read_bytes())
        ca_key = serialization.load_pem_private_key(self.ca_key.read_bytes(), None)
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization),
                                         x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
                .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now).not_valid_after(now + dt.timedelta(days=2))
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
        return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_pki(out: Path, ips: list[str], names: list[str]) -> Pki:
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    later = now + dt.timedelta(days=2)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "weft test cluster CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(later)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    san = [x509.DNSName(n) for n in names] + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    serving = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
               .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now).not_valid_after(later)
               .add_extension(x509.SubjectAlternativeName(san), critical=False)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
               .sign(ca_key, hashes.SHA256()))
    sa_key = ec.generate_private_key(ec.SECP256R1())
    pki = Pki(out / "ca.crt", out / "apiserver.crt", out / "apiserver.key", out / "sa.pub", out / "sa.key",
              out / "ca.key")
    pki.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    assert pki.ca_key is not None
    pki.ca_key.write_bytes(_key_pem(ca_key))
    pki.serving_cert.write_bytes(serving.public_bytes(serialization.Encoding.PEM))
    pki.serving_key.write_bytes(_key_pem(key))
    pki.sa_private.write_bytes(_key_pem(sa_key))
    pki.sa_public.write_bytes(sa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                               serialization.PublicFormat.SubjectPublicKeyInfo))
    for p in (pki.serving_key, pki.sa_private, pki.ca_key):
        p.chmod(0o600)
    return pki
