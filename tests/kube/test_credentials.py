"""The credentials keeper: the kubeconfig it writes, when it renews, what it does when the API is away."""

from __future__ import annotations

import base64
import json
import stat
import threading
from pathlib import Path

import pytest
from lightkube.config.kubeconfig import KubeConfig
from structlog.testing import capture_logs

from shim.errors import ConfigError
from shim.kube import credentials
from shim.kube.credentials import CredentialsError, Identity, Keeper, Token, identity_from_token


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Tokens:
    """Hands out numbered tokens living ``lifetime`` from the clock's now; fails when told to."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.n, self.fail, self.asked = clock, 0, False, []

    def request(self, lifetime_s: int) -> Token:
        self.asked.append(lifetime_s)
        if self.fail:
            raise CredentialsError("TokenRequest for weft-system/weft: connection refused")
        self.n += 1
        return Token(f"token-{self.n}", self.clock() + lifetime_s)


def _keeper(tmp_path: Path, clock: Clock, tokens: Tokens, **kw) -> Keeper:
    return Keeper(tokens, tmp_path / "weft", server="https://10.0.0.1:6443", ca_pem=b"CA PEM", clock=clock, **kw)


def test_it_writes_a_private_kubeconfig_that_reads_the_token_from_its_file(tmp_path: Path) -> None:
    clock = Clock()
    keeper = _keeper(tmp_path, clock, Tokens(clock))
    keeper.renew()
    d = tmp_path / "weft"
    assert (d / "token").read_text() == "token-1\n"
    for f in ("token", "kubeconfig"):
        assert stat.S_IMODE((d / f).stat().st_mode) == 0o600, f
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    cfg = KubeConfig.from_file(d / "kubeconfig").get()
    assert cfg.cluster.server == "https://10.0.0.1:6443"
    assert base64.b64decode(cfg.cluster.certificate_auth_data) == b"CA PEM"
    assert cfg.user.token_file == str(d / "token") and cfg.user.token is None  # the token itself is not in it


def test_it_renews_when_half_the_lifetime_has_passed_and_only_the_token_changes(tmp_path: Path) -> None:
    clock, d = Clock(), tmp_path / "weft"
    tokens = Tokens(clock)
    keeper = _keeper(tmp_path, clock, tokens, lifetime_s=3600)
    assert keeper.renew() == clock.t + 1800
    before = (d / "kubeconfig").stat().st_mtime_ns
    clock.t += 1800
    keeper.renew()
    assert (d / "token").read_text() == "token-2\n" and tokens.asked == [3600, 3600]
    assert (d / "kubeconfig").stat().st_mtime_ns == before  # unchanged, not rewritten


def test_a_failure_keeps_the_token_it_has_and_retries_soon(tmp_path: Path) -> None:
    clock = Clock()
    tokens = Tokens(clock)
    keeper = _keeper(tmp_path, clock, tokens, retry_s=0.01)
    keeper.renew()
    tokens.fail = True
    stop = threading.Event()

    def request(lifetime_s: int) -> Token:
        if len(tokens.asked) >= 3:
            stop.set()
        return Tokens.request(tokens, lifetime_s)

    tokens.request = request  # type: ignore[method-assign]
    with capture_logs() as logs:
        keeper.run(stop)
    failures = [e for e in logs if e["event"] == "kube.credentials.failed"]
    assert failures and failures[0]["token_left_s"] == 3600 and "connection refused" in failures[0]["error"]
    assert (tmp_path / "weft" / "token").read_text() == "token-1\n"


@pytest.mark.parametrize(("kw", "words"), [
    ({"lifetime_s": 599}, "--lifetime 599"),
    ({"refresh": 1.0}, "--refresh 1.0"),
    ({"refresh": 0.0}, "--refresh 0.0"),
], ids=["too-short-for-the-api-server", "renew-at-expiry", "renew-at-once"])
def test_bad_settings_are_refused_naming_the_flag(tmp_path: Path, kw, words) -> None:
    clock = Clock()
    with pytest.raises(ConfigError, match=words):
        _keeper(tmp_path, clock, Tokens(clock), **kw)


def _jwt(claims: dict) -> str:
    body = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"eyJhbGciOiJSUzI1NiJ9.{body}.c2ln"


def test_the_pod_s_own_service_account_is_read_from_its_token() -> None:
    assert identity_from_token(_jwt({"sub": "system:serviceaccount:weft-system:weft"})) == Identity("weft-system",
                                                                                                     "weft")


@pytest.mark.parametrize("token", [_jwt({"sub": "admin"}), "not-a-jwt", _jwt({"iss": "x"})],
                         ids=["a-user", "garbage", "no-subject"])
def test_a_token_that_is_not_a_service_account_s_is_refused(token: str) -> None:
    with pytest.raises(ConfigError, match="kube-credentials"):
        identity_from_token(token)


def test_with_a_kubeconfig_the_account_must_be_named(tmp_path: Path) -> None:
    path = tmp_path / "admin.kubeconfig"
    path.write_text(credentials.kubeconfig_text("https://10.0.0.1:6443", b"CA", tmp_path / "t"))
    with pytest.raises(ConfigError, match="--namespace and --service-account"):
        credentials.in_cluster_keeper(tmp_path / "out", 3600, 0.5, kubeconfig=path)
