"""Whether reservation pods get their preStop hook, and where it points, from the agent's settings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shim.agent import Agent
from shim.config import AgentConfig, Config, KubernetesConfig


def _host() -> SimpleNamespace:
    return SimpleNamespace(reservations=SimpleNamespace(stop_endpoint=None, stop_token=None),
                           lifecycle=SimpleNamespace(mark=SimpleNamespace(reservation_stop=lambda name: "t")))


@pytest.mark.parametrize(("metrics", "hook", "endpoint"), [
    ("0.0.0.0:9464", True, ("127.0.0.1", 9464)),  # every interface: kubelet reaches it on loopback
    ("10.0.0.5:9464", True, ("10.0.0.5", 9464)),
    ("0.0.0.0:9464", False, None),  # switched off: kubelet cannot reach the endpoint, say
    ("", True, None),  # no endpoint at all
    ("127.0.0.1:0", True, None),  # a port chosen at bind time, unknown when a reservation is made
])
def test_the_stop_hook_points_at_the_agents_endpoint_unless_switched_off(
        metrics: str, hook: bool, endpoint: tuple[str, int] | None) -> None:
    host = _host()
    cfg = Config(agent=AgentConfig(metrics_address=metrics),
                 kubernetes=KubernetesConfig(reservation_stop_hook=hook))
    Agent._stop_hook(None, cfg, host)  # type: ignore[arg-type]
    assert host.reservations.stop_endpoint == endpoint
    assert (host.reservations.stop_token is not None) == (endpoint is not None)
