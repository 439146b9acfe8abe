"""critest, cri-tools' CRI validation suite, through a ``weft agent`` ends every spec as containerd alone does.

Two identical test nodes, each its own containerd, in the same run: critest drives one directly
and the other through a ``weft agent`` (what kubelet would talk to). The specs containerd itself
fails here (the baseline: this machine, the containerd release ``WEFT_CONTAINERD`` chose, stand-in
images) must fail through the agent too, and every other spec must pass through it: weft changes
nothing for a pod that did not opt in. The offline image set comes from a local registry
(``harness.critest``). The figures name the containerd release, one line per run.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from harness import fixture
from harness.critest import REGISTRY_HOSTS, critest_images, repository_path, start_critest
from harness.registry import Registry
from shim.localfabric.agent import AgentProcess
from shim.localfabric.containerd import IMAGE_CACHE
from shim.localfabric.nodes import Cluster

pytestmark = pytest.mark.slow

CRITEST_TIMEOUT_S = 1800


def test_critest_through_the_agent_ends_every_spec_as_containerd_does(request: pytest.FixtureRequest,
                                                                       tmp_path: Path) -> None:
    archives = critest_images(IMAGE_CACHE / "critest")
    with Cluster(n=2, names=["direct", "through-weft"]) as nodes:
        direct, via = nodes.nodes
        with direct.containerd.channel() as ch:
            version = cri_grpc.RuntimeServiceStub(ch).Version(cri.VersionRequest(), timeout=10).runtime_version
        registry = Registry(direct.containerd, address=nodes.bridge_ip, clients=(via.containerd,), auth=False)
        with registry, AgentProcess(via.containerd, tmp_path / "agent", netns=via.netns,
                                    metrics_host=via.mesh_ip) as agent:
            for ref, archive in archives.items():
                registry.push(archive, repository_path(ref))
            for node in (direct, via):
                for host in REGISTRY_HOSTS:
                    hosts = node.containerd.registry_config_dir / host
                    hosts.mkdir(parents=True, exist_ok=True)
                    (hosts / "hosts.toml").write_text(
                        f'server = "http://{registry.host}"\n\n[host."http://{registry.host}"]\n'
                        '  capabilities = ["pull", "resolve"]\n')
            runs = [start_critest("direct", direct.containerd.socket, direct.netns_path, tmp_path / "direct"),
                    start_critest("through-weft", agent.socket, via.netns_path, tmp_path / "through-weft")]
            try:
                baseline, through = (run.wait(CRITEST_TIMEOUT_S) for run in runs)
            finally:
                for run in runs:
                    if run.proc.poll() is None:
                        run.proc.kill()
                        run.proc.wait()
    counts = {name: collections.Counter(outcomes.values()) for name, outcomes in
              (("containerd directly", baseline), ("through weft", through))}
    fixture.report(request.config, f"critest, containerd {direct.containerd.line} ({version}): " + "; ".join(
        f"{name}: " + ", ".join(f"{n} {state}" for state, n in sorted(c.items())) for name, c in counts.items()))
    failed = sorted(spec for spec, state in baseline.items() if state == "failed")
    fixture.report(request.config, f"critest, containerd {direct.containerd.line}: failed directly: {failed}")
    for run in runs:
        if run.flaky:
            fixture.report(request.config, f"critest {run.name}: passed at the second attempt: {run.flaky}")
    assert baseline and set(through) == set(baseline)
    differ = {spec: (baseline[spec], through[spec]) for spec in baseline if through[spec] != baseline[spec]}
    assert not differ, f"specs that end otherwise through weft (direct, through weft): {differ}"
    assert counts["containerd directly"]["passed"] > 50
