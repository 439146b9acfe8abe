"""Where the agent's Kubernetes API access comes from: a kubeconfig, in-cluster configuration, or none."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from shim.errors import ConfigError
from shim.kube import access
from shim.kube.credentials import kubeconfig_text


def _sa_dir(tmp_path: Path) -> Path:
    d = tmp_path / "sa"
    d.mkdir()
    (d / "token").write_text("header.eyJzdWIiOiJ4In0.sig")
    (d / "namespace").write_text("weft-system")
    (d / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    return d


def test_a_named_kubeconfig_wins_over_in_cluster_and_is_read_by_each_client(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(kubeconfig_text("https://10.0.0.1:6443", None, tmp_path / "token", insecure=True))
    got = access.resolve(path, service_account=_sa_dir(tmp_path), environ={"KUBERNETES_SERVICE_HOST": "10.96.0.1",
                                                                        "KUBERNETES_SERVICE_PORT": "443"})
    assert got.source is access.Source.KUBECONFIG and got.available and got.where == str(path)
    client = got.client()
    try:
        assert str(client._client._client.base_url).startswith("https://10.0.0.1:6443")
    finally:
        client._client._client.close()


def test_a_named_kubeconfig_not_written_yet_is_used_once_it_is(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    got = access.resolve(path)  # the keeper writes it after the installer started the agent
    assert got.source is access.Source.KUBECONFIG and "not written yet" in got.describe()
    with pytest.raises(access.KubeconfigNotYet, match=r"kubernetes\.kubeconfig: .*/kubeconfig is not written yet"):
        got.client()
    path.write_text(kubeconfig_text("https://10.0.0.1:6443", None, tmp_path / "token", insecure=True))
    client = got.client()
    client._client._client.close()
    assert "not written yet" not in got.describe()


def test_a_named_kubeconfig_that_is_there_but_unreadable_is_a_configuration_error(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text("clusters: [oops")
    with pytest.raises(ConfigError, match=r"kubernetes\.kubeconfig: cannot read .*/kubeconfig"):
        access.resolve(path)


def test_in_cluster_configuration_is_used_where_the_process_has_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    got = access.resolve(None, service_account=_sa_dir(tmp_path))
    assert got.source is access.Source.IN_CLUSTER and got.available
    assert got.config.get().cluster.server == "https://10.96.0.1:443"


@pytest.mark.parametrize("environ", [{}, {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}], ids=["no-env", "no-token"])
def test_without_either_the_agent_runs_without_the_api_and_says_so_once(tmp_path: Path, environ) -> None:
    got = access.resolve(None, service_account=tmp_path / "absent", environ=environ)
    assert got.source is access.Source.NONE and not got.available
    with pytest.raises(ConfigError, match="--kubeconfig"):
        got.client()
    with capture_logs() as logs:
        access.announce(got)
    (line,) = [e for e in logs if e["event"] == "kube.access"]
    assert line["source"] == "none" and "static peers" in line["detail"]
