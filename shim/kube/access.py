"""Which Kubernetes API configuration the agent uses, decided once at start and said once.

In order: a kubeconfig named by ``--kubeconfig`` or ``[kubernetes]
kubeconfig`` (read by each new client, so one the credentials keeper writes
after the agent started is used then; one that is there but unreadable is a
configuration error); in-cluster configuration when the process has one (a mounted service
account token and ``KUBERNETES_SERVICE_HOST``); otherwise none, and the agent
runs without the API (static peers, placement by its own rules), which it
logs once (``kube.access``). A kubeconfig whose user has a ``tokenFile`` is
re-read by the client when the API answers 401, so the credentials keeper's
renewed token is picked up without a restart.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path

import httpx2
import lightkube
import yaml
from lightkube.config import client_adapter
from lightkube.config.kubeconfig import KubeConfig

from shim import log
from shim.errors import ConfigError

_log = log.get("weft.kube")
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class Source(enum.Enum):
    KUBECONFIG = "kubeconfig"
    IN_CLUSTER = "in-cluster"
    NONE = "none"


@dataclass(frozen=True)
class ApiAccess:
    source: Source
    config: KubeConfig | None = None  # in-cluster; for a kubeconfig, read again by each client()
    where: str = ""  # the kubeconfig's path, or the service account directory

    @property
    def available(self) -> bool:
        return self.source is not Source.NONE

    def client(self) -> lightkube.Client:
        """A client on this access; a kubeconfig is read now, so one the keeper wrote since start is used."""
        if self.source is Source.KUBECONFIG:
            return lightkube.Client(config=_read(Path(self.where)))
        if self.config is None:
            raise ConfigError("no Kubernetes API configuration: give the agent --kubeconfig (or [kubernetes] "
                              "kubeconfig), or run it where in-cluster configuration exists")
        return lightkube.Client(config=self.config)

    def http(self, *, read_timeout: float = 10.0) -> httpx2.Client:
        """A plain HTTP client on this access (base URL, TLS and auth as lightkube's), for a watch whose
        response must be closed exactly when its reader stops."""
        config = _read(Path(self.where)) if self.source is Source.KUBECONFIG else self.config
        if config is None:
            raise ConfigError("no Kubernetes API configuration for an HTTP client")
        params = client_adapter.ConnectionParams(timeout=httpx2.Timeout(10.0, read=read_timeout))
        return client_adapter.Client(config.get(), params)

    def describe(self) -> str:
        if self.source is Source.KUBECONFIG:
            pending = "" if Path(self.where).exists() else " (not written yet: the API is used once it is)"
            return f"kubeconfig {self.where}{pending}"
        if self.source is Source.IN_CLUSTER:
            return f"in-cluster configuration ({self.where})"
        return "no Kubernetes API: static peers and the agent's own placement rules"


class KubeconfigNotYet(ConfigError):
    """The kubeconfig named is not there yet: the DaemonSet's credentials keeper writes it once the install has
    started the agent. Waiters poll for it at a short, steady interval (a local file, cheap to look for) rather
    than backing off as from an API that does not answer, so the agent uses the API within a moment of it."""


def _read(path: Path) -> KubeConfig:
    if not path.exists():
        raise KubeconfigNotYet(f"kubernetes.kubeconfig: {path} is not written yet")
    try:
        return KubeConfig.from_file(path)
    except (OSError, lightkube.ConfigError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"kubernetes.kubeconfig: cannot read {path}: {exc}") from exc


def resolve(kubeconfig: Path | None, *, service_account: Path = SERVICE_ACCOUNT_DIR,
            environ: dict[str, str] | None = None) -> ApiAccess:
    """The access to use. A named kubeconfig that does not exist yet is not an error: the credentials keeper
    writes it after the installer has started the agent, and the agent's clients read it once it is there."""
    env = os.environ if environ is None else environ
    if kubeconfig is not None:
        if kubeconfig.exists():
            _read(kubeconfig)  # a file that is there but unreadable is a mistake to report now
        return ApiAccess(Source.KUBECONFIG, None, str(kubeconfig))
    if env.get("KUBERNETES_SERVICE_HOST") and (service_account / "token").is_file():
        try:
            config = KubeConfig.from_service_account(service_account)
        except (OSError, lightkube.ConfigError, KeyError) as exc:
            _log.warning("kube.in_cluster_unusable", where=str(service_account), error=str(exc))
        else:
            return ApiAccess(Source.IN_CLUSTER, config, str(service_account))
    return ApiAccess(Source.NONE)


def announce(access: ApiAccess) -> None:
    """Say once, at start, where the agent's API access comes from (or that it has none)."""
    _log.info("kube.access", source=access.source.value, detail=access.describe())
