"""Fixtures for tests against real containerd, runc and CNI (root only).

``containerd`` is one throwaway containerd for the whole session; every test
that uses it gets its pods removed afterwards, pass or fail. ``fresh_containerd``
is a private one for tests that stop or restart it. ``agent`` is a real
``weft agent`` process in front of the shared containerd.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from harness import binaries
from harness.fixture import FIGURES_ENV
from harness.leaks import leaked_node_namespaces, netns
from shim.localfabric.agent import AgentProcess
from shim.localfabric.containerd import Containerd

# Modules that run real Kubernetes components (components/build.sh's binaries). They go last, so that the build
# scripts/test.sh starts in the background has the whole run before them to finish in. The nodes booted with
# systemd go with them (the cluster's are kube modules anyway): each runs a whole node's services, which beside
# the throughput-bound tests of the rest (a fast writer's log against its cap) starve them of the two cores.
# Modules that need the background builds (Kubernetes, the nodes' root, syft and cosign): run last, so that on a
# fresh machine the builds have the rest of the suite's time to finish.
_KUBE_MODULES = ("test_kube_", "test_critest", "test_nodes", "test_image_supply_chain")
_FIGURES = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    # The file the workers of a parallel run (pytest-xdist) write their figures to (harness/fixture.report);
    # named here, in the controller, before the workers start, so they inherit it.
    if not hasattr(config, "workerinput") and FIGURES_ENV not in os.environ:
        fd, path = tempfile.mkstemp(prefix="weft-figures-", suffix=".txt")
        os.close(fd)
        os.environ[FIGURES_ENV] = path
        config.stash[_FIGURES] = path


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    path = config.stash.get(_FIGURES, None)
    if path is None:
        return
    with contextlib.suppress(FileNotFoundError):
        lines = Path(path).read_text().splitlines()
        os.unlink(path)
        if lines:
            terminalreporter.section("figures measured by the integration tests")
            for line in lines:
                terminalreporter.write_line(line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("integration" in str(item.path) for item in items) and os.geteuid() != 0:
        raise pytest.UsageError("integration tests drive real containerd, runc and netns: run them as root")
    items.sort(key=lambda item: item.path.name.startswith(_KUBE_MODULES))  # stable: the rest keep their order
    if binaries.next_release():
        # A test of what the newest release no longer allows (a feature gate it locks on) is not run on it;
        # it is deselected, with its reason on the terminal, rather than failed and left to wedge the node.
        pinned = [item for item in items if item.get_closest_marker("pinned_kubelet")]
        for item in pinned:
            reason = item.get_closest_marker("pinned_kubelet").args[0]
            if not hasattr(config, "workerinput"):  # a pytest-xdist worker's terminal is nobody's
                config.get_terminal_writer().line(f"weft: {item.nodeid} not run on the newest release: {reason}")
        if pinned:
            config.hook.pytest_deselected(items=pinned)
            items[:] = [item for item in items if item not in pinned]


@pytest.fixture(scope="session")
def containerd_session() -> Iterator[Containerd]:
    with Containerd() as c:
        yield c


@pytest.fixture
def containerd(containerd_session: Containerd) -> Iterator[Containerd]:
    yield containerd_session
    # Whatever the test left, the next test starts from an empty node.
    if not containerd_session.running:
        containerd_session.start()
    with containerd_session.channel() as ch:
        rt = cri_grpc.RuntimeServiceStub(ch)
        for sb in rt.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=30).items:
            rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sb.id), timeout=60)
            rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sb.id), timeout=60)


@pytest.fixture
def fresh_containerd() -> Iterator[Containerd]:
    with Containerd() as c:
        yield c


@pytest.fixture
def agent(containerd: Containerd, tmp_path: Path) -> Iterator[AgentProcess]:
    with AgentProcess(containerd, tmp_path / "agent") as a:
        yield a


@pytest.fixture
def direct_rt(containerd: Containerd) -> Iterator[cri_grpc.RuntimeServiceStub]:
    with containerd.channel() as ch:
        yield cri_grpc.RuntimeServiceStub(ch)


@pytest.fixture
def agent_channel(agent: AgentProcess) -> Iterator[grpc.Channel]:
    with agent.channel() as ch:
        yield ch


@pytest.fixture(autouse=True, scope="session")
def no_leaked_namespaces() -> Iterator[None]:
    """The harness must leave no node namespace behind when the session ends."""
    before = netns()
    yield
    leaked = leaked_node_namespaces(before)
    assert not leaked, f"harness leaked network namespaces: {sorted(leaked)}"
