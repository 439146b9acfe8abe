"""A node's own mesh certificate, asked of the mesh signer through the CSR API (``weft mesh-identity``).

The DaemonSet runs it on every node, with the kubelet's credentials (the
kubelet's kubeconfig and client certificate, mounted read-only from the
host), so the API server records the request as made by
``system:node:<node>``, an identity no other node holds. It:

- makes the node's key in ``<dir>/<node>.key`` (EC P-256, mode 0600, the
  directory 0700) on the host, once; the key never leaves the node and is
  in no Secret;
- asks for a certificate: a CertificateSigningRequest with signerName
  ``weft.io/mesh``, ``expirationSeconds`` the lifetime it wants, the
  PKCS#10 request signed by the key (``shim.mesh.csr``); then reads it until
  the signer has issued it or refused it (a ``Denied`` or ``Failed``
  condition, whose reason it logs and, with ``--once``, exits with);
- writes ``ca.crt`` and ``<node>.crt`` (atomically, 0644) where the agent
  reads them (``mesh.tls_dir``), which reloads them for new connections
  (``shim.mesh.tlsreload``);
- renews when ``share`` of the certificate's life has passed (two thirds by
  default), retrying every ``retry_s`` on failure while the certificate
  lasts (``mesh.cert.failed``, ``mesh.cert.denied``).

``--once`` (the DaemonSet's init container, before ``weft install``) returns
as soon as the node has a certificate that is not yet due for renewal.
"""

from __future__ import annotations

import base64
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import lightkube
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from lightkube.config.kubeconfig import KubeConfig
from lightkube.models.certificates_v1 import CertificateSigningRequestSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.certificates_v1 import CertificateSigningRequest

from shim import log, stopping
from shim.core.meshcsr import MIN_REQUEST_S, SIGNER_NAME, renew_at
from shim.errors import ConfigError, WeftError
from shim.kube.credentials import check_renewal
from shim.mesh import csr
from shim.mesh.certs import cert_nodes, check_node_name, write_file

_log = log.get("weft.mesh")

DEFAULT_LIFETIME_S = 3600
DEFAULT_SHARE = 2 / 3
RETRY_S = 10.0
WAIT_S = 60.0  # for the signer to answer one request
POLL_S = 1.0
USAGES = ["digital signature", "server auth", "client auth"]


class EnrollError(WeftError):
    """No mesh certificate from the API now (unreachable, no answer from the signer); the keeper retries."""


class CertificateDenied(EnrollError):
    """The signer refused this node's request; ``reason`` is its condition's reason."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class Enroller:
    def __init__(self, client: lightkube.Client, directory: Path, node: str, *,
                 lifetime_s: int = DEFAULT_LIFETIME_S, share: float = DEFAULT_SHARE, retry_s: float = RETRY_S,
                 wait_s: float = WAIT_S, poll_s: float = POLL_S, clock: Callable[[], float] = time.time) -> None:
        check_node_name(node)
        check_renewal("mesh-identity", lifetime_s, MIN_REQUEST_S, "--renew-at", share, "certificate")
        self.client, self.dir, self.node = client, Path(directory), node
        self.lifetime_s, self.share, self.retry_s = lifetime_s, share, retry_s
        self.wait_s, self.poll_s, self.clock = wait_s, poll_s, clock
        self.key_path = self.dir / f"{node}.key"
        self.cert_path = self.dir / f"{node}.crt"
        self.ca_path = self.dir / "ca.crt"
        self.not_after: float | None = None

    # -- files -----------------------------------------------------------------------------------------------
    def ensure_key(self) -> bytes:
        """The node's key, made here (0600) if there is none or it cannot be read."""
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        try:
            key = self.key_path.read_bytes()
            csr.load_key(key)
            os.chmod(self.key_path, 0o600)
            return key
        except (OSError, ValueError, TypeError):
            pass
        key = csr.new_key()
        write_file(self.key_path, key, 0o600)
        _log.info("mesh.cert.key_made", node=self.node, path=str(self.key_path))
        return key

    def current(self) -> x509.Certificate | None:
        """The certificate in place, if it is this node's, for its key, from the CA in place and unexpired."""
        try:
            cert = x509.load_pem_x509_certificate(self.cert_path.read_bytes())
            ca = x509.load_pem_x509_certificate(self.ca_path.read_bytes())
            key = serialization.load_pem_private_key(self.key_path.read_bytes(), password=None)
            cert.verify_directly_issued_by(ca)
        except Exception:  # noqa: BLE001 - any missing or unusable file: ask anew
            return None
        if key.public_key() != cert.public_key() or cert_nodes(cert.public_bytes(serialization.Encoding.PEM)) != \
                [self.node] or cert.not_valid_after_utc.timestamp() <= self.clock():
            return None
        return cert

    def due(self) -> float:
        """When the certificate in place is due for renewal (now when there is none)."""
        cert = self.current()
        if cert is None:
            return self.clock()
        self.not_after = cert.not_valid_after_utc.timestamp()
        # Its life counted from when it arrived here (the file's time): the signer backdates notBefore.
        got = max(cert.not_valid_before_utc.timestamp(), self.cert_path.stat().st_mtime)
        return renew_at(got, self.not_after, self.share)

    # -- the request ---------------------------------------------------------------------------------------------
    def request(self, key_pem: bytes) -> tuple[bytes, bytes]:
        """Ask the signer; ``(cert, ca)`` once issued. Raises CertificateDenied or EnrollError."""
        spec = CertificateSigningRequestSpec(
            request=base64.b64encode(csr.request_pem(key_pem, self.node)).decode(), signerName=SIGNER_NAME,
            expirationSeconds=self.lifetime_s, usages=USAGES)
        obj = CertificateSigningRequest(metadata=ObjectMeta(generateName=f"weft-mesh-{self.node[:40]}-",
                                                            labels={"app.kubernetes.io/name": "weft"}), spec=spec)
        try:
            name = self.client.create(obj).metadata.name
        except lightkube.ApiError as exc:
            raise EnrollError(f"the API refused the mesh certificate request: {exc.status.message}") from exc
        except Exception as exc:
            raise EnrollError(f"the mesh certificate request could not be made: {exc}") from exc
        # Said at once: until the signer answers (its pods wait for the mesh CA Secret), this is all a node says.
        _log.info("mesh.cert.requested", node=self.node, csr=name, signer=SIGNER_NAME, wait_s=self.wait_s)
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                got = self.client.get(CertificateSigningRequest, name)
            except lightkube.ApiError as exc:
                raise EnrollError(f"CSR {name}: {exc.status.message}") from exc
            except Exception as exc:
                raise EnrollError(f"CSR {name}: {exc}") from exc
            status = got.status
            for cond in (status.conditions or []) if status is not None else []:
                if cond.type in ("Denied", "Failed"):
                    raise CertificateDenied(f"CSR {name} {cond.type.lower()} by the signer: {cond.reason}: "
                                            f"{cond.message}", cond.reason or cond.type)
            if status is not None and status.certificate:
                try:
                    cert, ca = csr.split_issued(base64.b64decode(status.certificate))
                except ValueError as exc:
                    raise EnrollError(f"CSR {name}: {exc}") from exc
                return cert, ca
            if time.monotonic() > deadline:
                raise EnrollError(f"CSR {name}: not issued within {self.wait_s:.0f} s (is weft mesh-signer "
                                  "running?)")
            time.sleep(self.poll_s)

    def renew(self) -> float:
        """Get and write a certificate; returns when to renew next."""
        key = self.ensure_key()
        cert_pem, ca_pem = self.request(key)
        got = self.clock()
        cert = x509.load_pem_x509_certificate(cert_pem)
        if cert.public_key() != csr.load_key(key).public_key() or cert_nodes(cert_pem) != [self.node]:
            raise EnrollError("the issued certificate is not for this node's key and name")
        with stopping.writing():  # both or neither, when SIGTERM ends the process
            write_file(self.ca_path, ca_pem, 0o644)
            write_file(self.cert_path, cert_pem, 0o644)
        self.not_after = cert.not_valid_after_utc.timestamp()
        _log.info("mesh.cert.issued", node=self.node, path=str(self.cert_path),
                  expires_in_s=round(self.not_after - got))
        return renew_at(got, self.not_after, self.share)

    def run(self, stop: threading.Event, *, once: bool = False, timeout_s: float = 0.0) -> None:
        """Keep a certificate until ``stop``; ``once``: return when one is in place (raise after ``timeout_s``)."""
        self.ensure_key()
        next_at = self.due()
        give_up = time.monotonic() + timeout_s if timeout_s > 0 else None
        while not stop.is_set():
            if next_at <= self.clock():
                try:
                    next_at = self.renew()
                except EnrollError as exc:
                    left = (self.not_after - self.clock()) if self.not_after else 0.0
                    fields = {"node": self.node, "error": exc.message, "cert_left_s": round(max(left, 0.0))}
                    if isinstance(exc, CertificateDenied):
                        _log.warning("mesh.cert.denied", reason=exc.reason, **fields)
                    else:
                        _log.warning("mesh.cert.failed", **fields)
                    if once and (isinstance(exc, CertificateDenied)
                                 or (give_up is not None and time.monotonic() > give_up)):
                        raise
                    next_at = self.clock() + self.retry_s
                    if stop.wait(self.retry_s):
                        return
                    continue
            if once:
                _log.info("mesh.cert.ready", node=self.node, path=str(self.cert_path))
                return
            if stop.wait(max(0.0, next_at - self.clock())):
                return


def main(directory: Path, node: str, kubeconfig: Path, *, lifetime_s: int, share: float, once: bool,
         timeout_s: float) -> int:
    """``weft mesh-identity``: keep this node's mesh certificate (``--once``: get one, then exit).

    The keeper runs on a thread of its own and the main thread takes SIGTERM (``shim.stopping``), so a request
    that hangs does not keep the process; ``--once`` ended by a signal exits 128 plus its number (143).
    """
    try:
        client = lightkube.Client(config=KubeConfig.from_file(kubeconfig))
    except (OSError, lightkube.ConfigError) as exc:
        raise ConfigError(f"mesh-identity: --kubeconfig {kubeconfig} cannot be used: {exc}") from exc
    enroller = Enroller(client, directory, node, lifetime_s=lifetime_s, share=share)
    try:
        code = stopping.serve(lambda stop: enroller.run(stop, once=once, timeout_s=timeout_s),
                              name="weft-mesh-identity", stopped=None if once else 0)
    except EnrollError as exc:
        print(f"weft mesh-identity: {exc.message}")
        return 2
    return code or 0
