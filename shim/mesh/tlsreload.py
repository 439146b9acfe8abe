"""The agent's mesh TLS, re-read when its files change: a renewed certificate is used without a restart.

``NodeTls`` holds this node's pair and the CA from ``tls_dir`` (as
``shim.mesh.certs.load_node_tls`` reads them). At most once every
``CHECK_S`` on use, it looks at the files' identity (inode, size, mtime);
when they changed, it loads and checks them again (the certificate names
this node, the key is the certificate's) and from then on hands out the new
ones (``mesh.tls.reloaded``). A half-written or mismatched set is not taken:
the old one stays and the next check tries again (``mesh.tls.reload_failed``,
once per change).

Who reads it, and when the new certificate shows:

- the mesh server's credentials (``server_credentials``): gRPC asks for them
  at every new connection, so a new connection gets the new certificate;
- a peer client unpacks ``(key, cert, ca)`` when it opens its channel, and
  opens a new one for its next call once the generation changed
  (``generation_of``), so new connections present the new certificate and
  no reconnect presents one that expired;
- the tunnel contexts (``shim.mesh.tunnel.ends.contexts``): each new tunnel
  wraps its socket with a context built from the current files.

Connections already open keep the certificate they were made with: TLS
checks a certificate at the handshake only.
"""

from __future__ import annotations

import os
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from shim import log
from shim.errors import ConfigError
from shim.mesh.certs import MeshTls, load_node_tls

_log = log.get("weft.mesh")

CHECK_S = 1.0

Stamp = tuple[tuple[int, int, int], ...]


class NodeTls:
    """This node's mesh TLS from ``tls_dir``, reloaded when the files change (see the module's doc)."""

    def __init__(self, tls_dir: str | Path, node: str, *, check_s: float = CHECK_S) -> None:
        self.dir, self.node, self.check_s = Path(tls_dir), node, check_s
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._tls = _load_checked(self.dir, node)
        self._checked = time.monotonic()
        self._failed: Stamp | None = None
        self.generation = 0

    def not_after(self) -> float:
        """When the certificate in use expires (Unix time), after checking the files as ``current`` does."""
        return x509.load_pem_x509_certificate(self.current().cert_pem).not_valid_after_utc.timestamp()

    def _paths(self) -> tuple[Path, Path, Path]:
        return self.dir / f"{self.node}.key", self.dir / f"{self.node}.crt", self.dir / "ca.crt"

    def _stat(self) -> Stamp:
        out = []
        for p in self._paths():
            try:
                st = os.stat(p)
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                out.append((0, 0, 0))
        return tuple(out)

    def current(self) -> MeshTls:
        """The pair and CA to use now (reloaded first when the files changed since the last check)."""
        now = time.monotonic()
        if now - self._checked < self.check_s:
            return self._tls
        with self._lock:
            if now - self._checked < self.check_s:
                return self._tls
            self._checked = now
            stamp = self._stat()
            if stamp == self._stamp or stamp == self._failed:
                return self._tls
            try:
                tls = _load_checked(self.dir, self.node)
            except ConfigError as exc:
                self._failed = stamp
                _log.warning("mesh.tls.reload_failed", node=self.node, error=exc.message)
                return self._tls
            self._tls, self._stamp, self._failed = tls, stamp, None
            self.generation += 1
            not_after = x509.load_pem_x509_certificate(tls.cert_pem).not_valid_after_utc
            _log.info("mesh.tls.reloaded", node=self.node, generation=self.generation,
                      not_after=not_after.isoformat())
            return tls

    def __iter__(self) -> Iterator[bytes]:
        """``key_pem, cert_pem, ca_pem = tls``, as with a ``MeshTls``: the current ones."""
        return iter(self.current())

    def server_credentials(self) -> grpc.ServerCredentials:
        """gRPC server credentials that take the current certificate at every new connection."""
        served = [self.generation]

        def config(tls: MeshTls) -> grpc.ServerCertificateConfiguration:
            return grpc.ssl_server_certificate_configuration([(tls.key_pem, tls.cert_pem)],
                                                             root_certificates=tls.ca_pem)

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            tls = self.current()
            if self.generation == served[0]:
                return None
            served[0] = self.generation
            return config(tls)

        return grpc.dynamic_ssl_server_credentials(config(self._tls), fetch, require_client_authentication=True)


def server_credentials(tls: MeshTls | NodeTls | tuple[bytes, bytes, bytes]) -> grpc.ServerCredentials:
    """The mesh server's credentials: reloading ones for a ``NodeTls``, fixed ones for a plain triple."""
    if isinstance(tls, NodeTls):
        return tls.server_credentials()
    key_pem, cert_pem, ca_pem = tls
    return grpc.ssl_server_credentials([(key_pem, cert_pem)], root_certificates=ca_pem, require_client_auth=True)


def generation_of(tls: object) -> int:
    """How many times ``tls`` was reloaded, checking its files first (0 for a fixed triple): a peer client opens
    a new channel when it changes, so that a channel reconnecting never presents a certificate that expired."""
    if not isinstance(tls, NodeTls):
        return 0
    tls.current()
    return tls.generation


class ReloadingContext:
    """Stands for an ``ssl.SSLContext`` where a socket is wrapped: each wrap uses a context built from the
    files as they are now (rebuilt only when they changed)."""

    def __init__(self, source: NodeTls, build: Callable[[Path, Path, Path], ssl.SSLContext]) -> None:
        self.source, self._build = source, build
        self._generation = source.generation
        self._ctx = build(*source._paths())

    def context(self) -> ssl.SSLContext:
        self.source.current()
        if self.source.generation != self._generation:
            self._generation = self.source.generation
            self._ctx = self._build(*self.source._paths())
        return self._ctx

    def wrap_socket(self, sock, **kwargs):  # type: ignore[no-untyped-def]
        return self.context().wrap_socket(sock, **kwargs)


def _load_checked(tls_dir: Path, node: str) -> MeshTls:
    tls = load_node_tls(tls_dir, node)
    try:
        key = serialization.load_pem_private_key(tls.key_pem, password=None)
        cert = x509.load_pem_x509_certificate(tls.cert_pem)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"mesh TLS in {tls_dir} cannot be read: {exc}") from exc
    if key.public_key() != cert.public_key():
        raise ConfigError(f"mesh key {tls_dir}/{node}.key does not belong to {tls_dir}/{node}.crt")
    return tls
