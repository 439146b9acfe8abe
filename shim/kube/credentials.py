"""The credentials keeper: a kubeconfig for the host agent, with a service-account token renewed before it expires.

CNI plugins that run on the host do the same (Calico's writes a kubeconfig
for its host binary with a short-lived token of its service account). The
DaemonSet's long-running container runs ``weft kube-credentials``: it asks
the TokenRequest API for a token of its own service account (bound to no
object, so it outlives this pod's restarts, and expiring after
``lifetime``), writes it to ``<dir>/token`` (0600, replaced atomically) and
writes ``<dir>/kubeconfig`` once, naming the API server, its CA and the token
*file* (``tokenFile``), which the agent's client re-reads when the API
answers 401. It renews the token when ``refresh`` of its lifetime has passed
(half, by default), and on a failure keeps the token it has and tries again
soon, logging ``kube.credentials.failed``, until the token is close to its
end.

Pure parts (the kubeconfig's content, when to renew) are plain functions; the
API call goes through ``TokenSource``, a small interface with lightkube behind
it.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import lightkube
from lightkube.config.kubeconfig import KubeConfig
from lightkube.models.authentication_v1 import TokenRequestSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ServiceAccountToken

from shim import log, stopping
from shim.errors import ConfigError, WeftError

_log = log.get("weft.kube")

DEFAULT_LIFETIME_S = 3600
MIN_LIFETIME_S = 600  # the API server refuses a TokenRequest for less
RETRY_S = 10.0


@dataclass(frozen=True)
class Token:
    value: str
    expires: float  # Unix time


class TokenSource(Protocol):
    def request(self, lifetime_s: int) -> Token: ...


@dataclass(frozen=True)
class Identity:
    namespace: str
    service_account: str


def identity_from_token(token: str) -> Identity:
    """The service account a (projected) token belongs to, read from its claims (not verified: it is ours)."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        sub = claims["sub"]
    except (IndexError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError("kube-credentials: the service account token does not name its account") from exc
    parts = sub.split(":")
    if len(parts) != 4 or parts[:2] != ["system", "serviceaccount"]:
        raise ConfigError(f"kube-credentials: the token belongs to {sub!r}, not a service account")
    return Identity(parts[2], parts[3])


class ApiTokens:
    """TokenRequest for ``identity`` through a lightkube client."""

    def __init__(self, client: lightkube.Client, identity: Identity) -> None:
        self.client, self.identity = client, identity

    def request(self, lifetime_s: int) -> Token:
        req = ServiceAccountToken(
            metadata=ObjectMeta(name=self.identity.service_account, namespace=self.identity.namespace),
            spec=TokenRequestSpec(audiences=[], expirationSeconds=lifetime_s))
        try:
            got = self.client.create(req, self.identity.service_account, namespace=self.identity.namespace)
        except lightkube.ApiError as exc:
            raise CredentialsError(f"TokenRequest for {self.identity.namespace}/{self.identity.service_account}: "
                                   f"{exc.status.message}") from exc
        except Exception as exc:
            raise CredentialsError(f"TokenRequest for {self.identity.namespace}/{self.identity.service_account}: "
                                   f"{exc}") from exc
        expires = got.status.expirationTimestamp.timestamp()
        return Token(got.status.token, expires)


class CredentialsError(WeftError):
    """A token could not be had from the API server now; the keeper keeps the one it has and retries."""


def kubeconfig_text(server: str, ca_pem: bytes | None, token_file: Path, *, insecure: bool = False) -> str:
    """A kubeconfig for the agent: one cluster, one user that reads its bearer token from ``token_file``."""
    cluster: dict = {"server": server}
    if ca_pem:
        cluster["certificate-authority-data"] = base64.b64encode(ca_pem).decode()
    elif insecure:
        cluster["insecure-skip-tls-verify"] = True
    doc = {
        "apiVersion": "v1", "kind": "Config", "current-context": "weft",
        "clusters": [{"name": "weft", "cluster": cluster}],
        "users": [{"name": "weft", "user": {"tokenFile": str(token_file)}}],
        "contexts": [{"name": "weft", "context": {"cluster": "weft", "user": "weft"}}],
    }
    return json.dumps(doc, indent=2) + "\n"  # JSON is YAML: any kubeconfig reader takes it


def renew_at(token: Token, issued: float, refresh: float) -> float:
    """When to ask for the next token: ``refresh`` of the way from issue to expiry."""
    return issued + refresh * max(0.0, token.expires - issued)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` 0600, replacing it atomically (a reader never sees half a token).

    Under ``shim.stopping.writing``: a process SIGTERM ends does not end in the middle, leaving the temporary
    file.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with stopping.writing():
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def check_renewal(command: str, lifetime_s: int, minimum_s: int, share_flag: str, share: float, what: str) -> None:
    """ConfigError for a lifetime the API server refuses, or a renewal point that is not a share of it:
    the token keeper and the mesh identity (``shim.mesh.enroll``) take the same two settings."""
    if lifetime_s < minimum_s:
        raise ConfigError(f"{command}: --lifetime {lifetime_s} is under {minimum_s} s, which the API server refuses")
    if not 0.0 < share < 1.0:
        raise ConfigError(f"{command}: {share_flag} {share} must be between 0 and 1 (a share of the {what}'s "
                          "lifetime)")


class Keeper:
    def __init__(self, tokens: TokenSource, directory: Path, *, server: str, ca_pem: bytes | None,
                 lifetime_s: int = DEFAULT_LIFETIME_S, refresh: float = 0.5, retry_s: float = RETRY_S,
                 clock: Callable[[], float] = time.time) -> None:
        check_renewal("kube-credentials", lifetime_s, MIN_LIFETIME_S, "--refresh", refresh, "token")
        self.tokens, self.dir = tokens, directory
        self.server, self.ca_pem = server, ca_pem
        self.lifetime_s, self.refresh, self.retry_s, self.clock = lifetime_s, refresh, retry_s, clock
        self.token_file = directory / "token"
        self.kubeconfig = directory / "kubeconfig"
        self.current: Token | None = None

    def renew(self) -> float:
        """Get and write a token (and the kubeconfig); returns when to renew next. Raises CredentialsError."""
        issued = self.clock()
        token = self.tokens.request(self.lifetime_s)
        text = kubeconfig_text(self.server, self.ca_pem, self.token_file)
        with stopping.writing():  # the token and the kubeconfig that names it, when SIGTERM ends the process
            write_private(self.token_file, token.value + "\n")
            if not self.kubeconfig.exists() or self.kubeconfig.read_text() != text:
                write_private(self.kubeconfig, text)
        self.current = token
        _log.info("kube.credentials.renewed", expires_in_s=round(token.expires - issued), path=str(self.kubeconfig))
        return renew_at(token, issued, self.refresh)

    def run(self, stop: threading.Event) -> None:
        """Renew until ``stop``; a failure is retried every ``retry_s`` while the last token lasts."""
        next_at = self.clock()
        while not stop.is_set():
            try:
                next_at = self.renew()
            except CredentialsError as exc:
                left = self.current.expires - self.clock() if self.current else 0.0
                _log.warning("kube.credentials.failed", error=exc.message, token_left_s=round(max(left, 0.0)))
                next_at = self.clock() + self.retry_s
            if stop.wait(max(0.0, next_at - self.clock())):
                return


def in_cluster_keeper(directory: Path, lifetime_s: int, refresh: float,
                      kubeconfig: Path | None = None, identity: Identity | None = None) -> Keeper:
    """A keeper for this pod's own service account (or, with ``kubeconfig``, for ``identity`` as that user)."""
    if kubeconfig is not None:
        config = KubeConfig.from_file(kubeconfig)
        if identity is None:
            raise ConfigError("kube-credentials: with --kubeconfig, name --namespace and --service-account")
    else:
        from shim.kube.access import SERVICE_ACCOUNT_DIR

        try:
            config = KubeConfig.from_service_account(SERVICE_ACCOUNT_DIR)
        except (OSError, lightkube.ConfigError, KeyError) as exc:
            raise ConfigError(f"kube-credentials: no in-cluster configuration ({exc}); run it in the weft pod, "
                              "or give --kubeconfig") from exc
        identity = identity or identity_from_token((SERVICE_ACCOUNT_DIR / "token").read_text().strip())
    cluster = config.get().cluster
    ca_pem = None
    if cluster.certificate_auth_data:
        ca_pem = base64.b64decode(cluster.certificate_auth_data)
    elif cluster.certificate_auth:
        ca_pem = Path(cluster.certificate_auth).read_bytes()
    client = lightkube.Client(config=config)
    return Keeper(ApiTokens(client, identity), directory, server=cluster.server, ca_pem=ca_pem,
                  lifetime_s=lifetime_s, refresh=refresh)
