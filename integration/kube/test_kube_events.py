"""A kubelet with evented PLEG (feature gate ``EventedPLEG``) over weft, on containerd 2.x: it sees rerouted
containers change state as it sees local ones.

With evented PLEG, kubelet relists only every five minutes and otherwise
learns of a container's changes from the runtime's ``GetContainerEvents``
stream alone, taking each event's list of the pod's containers as the whole
pod. So through weft: a rerouted container's start and exit reach kubelet as
events (kubelet would otherwise see them minutes later); the events of the
pod's local containers list the rerouted one too (kubelet would otherwise
take it for gone and start it again); and the host's kubelet, on the same
stream through its own agent, never hears of the shadow (it would otherwise
remove the exited shadow, an unknown pod's container, before the origin has
read it). The figure is how soon a container's start and exit show in the
API, rerouted against pinned local, one pod after the other.
"""

from __future__ import annotations

import re
import ssl
import time
import urllib.request
from collections.abc import Iterator

import pytest
from cri_api.v1.api_pb2 import CONTAINER_EXITED

from harness import fixture
from harness.cluster import KubeCluster, NodeSpec
from harness.workloads import apply, container, container_status, delete, get_pod, pod, sandbox_of
from shim.localfabric.waiting import wait_for

pytestmark = pytest.mark.slow

ORIGIN, HOST = "gpu-1", "cpu-1"
# Well inside evented PLEG's five-minute relist: a change seen sooner came through the event stream.
SEEN_WITHIN_S = 60.0
EXIT_CODE = 3


@pytest.fixture(scope="module")
def kube(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    yield from fixture.cluster(request, tmp_path_factory, [NodeSpec(ORIGIN, "gpu"), NodeSpec(HOST, "cpu")],
                               containerd_line="2", kubelet_config={"featureGates": {"EventedPLEG": True}})


def staged(name: str, *, rerouted: bool) -> dict:
    """A GPU stage that stays up and a CPU stage that runs a few seconds and exits ``EXIT_CODE``; never restarted."""
    annotations = {"weft.io/gpu-memory.model": "20Gi"}
    if not rerouted:
        annotations["weft.io/stage.prep"] = "local"
    model = container("model", "exec sleep 3600", env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}])
    prep = container("prep", f"echo prep up; sleep 4; exit {EXIT_CODE}",
                     resources={"requests": {"cpu": "50m", "memory": "16Mi"},
                                "limits": {"cpu": "200m", "memory": "32Mi"}})
    p = pod(name, [model, prep], runtime_class="weft", annotations=annotations,
            node_selector={"weft.io/role": "gpu"})
    p["spec"]["restartPolicy"] = "Never"
    return p


def _state(kube: KubeCluster, name: str, container_name: str) -> dict:
    with_status = get_pod(kube, name).get("status", {})
    if not with_status.get("containerStatuses"):
        return {}
    return container_status(get_pod(kube, name), container_name)


def run_to_exit(kube: KubeCluster, name: str, *, rerouted: bool) -> dict[str, float]:
    """Apply the pod; seconds until the API shows ``prep`` running, then exited."""
    t0 = time.monotonic()
    apply(kube, staged(name, rerouted=rerouted))
    wait_for(lambda: "running" in _state(kube, name, "prep").get("state", {}) or
             "terminated" in _state(kube, name, "prep").get("state", {}),
             timeout=SEEN_WITHIN_S + 60, what=f"{name}: prep running in the API", every=0.1)
    running = time.monotonic() - t0
    wait_for(lambda: "terminated" in _state(kube, name, "prep").get("state", {}),
             timeout=SEEN_WITHIN_S, what=f"{name}: prep's exit in the API", every=0.1)
    return {"running": running, "exited": time.monotonic() - t0}


def shadows(kube: KubeCluster, name: str = "prep") -> list:
    return [c for c in kube.containers(HOST)
            if c.labels.get("weft.io/origin-node") == ORIGIN and c.metadata.name == name]


def kubelet_metric(kube: KubeCluster, node: str, metric: str) -> float:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # kubelet's self-signed serving certificate
    with urllib.request.urlopen(f"https://{kube.node(node).mesh_ip}:10250/metrics", timeout=10, context=ctx) as r:
        text = r.read().decode()
    found = re.search(rf"^{metric}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert found, f"kubelet on {node} exports no {metric}"
    return float(found.group(1))


def agent_streams(kube: KubeCluster, node: str) -> float:
    found = re.search(r'^weft_cri_open_streams\{method="GetContainerEvents"\} (\S+)$',
                      kube.agents[node].metrics_text(), re.M)
    return float(found.group(1)) if found else 0.0


def test_each_kubelet_holds_its_event_stream_through_weft(kube: KubeCluster) -> None:
    for node in (ORIGIN, HOST):
        wait_for(lambda node=node: agent_streams(kube, node) >= 1, timeout=30,
                 what=f"kubelet on {node} holding GetContainerEvents through its agent")
        assert kubelet_metric(kube, node, "kubelet_evented_pleg_connection_success_count") >= 1
        assert kubelet_metric(kube, node, "kubelet_evented_pleg_connection_error_count") == 0


@pytest.fixture(scope="module")
def timings(kube: KubeCluster) -> Iterator[dict[str, dict[str, float]]]:
    out: dict[str, dict[str, float]] = {}
    try:
        out["local"] = run_to_exit(kube, "events-local", rerouted=False)
        out["rerouted"] = run_to_exit(kube, "events-rerouted", rerouted=True)
        yield out
    finally:
        delete(kube, "events-local", "events-rerouted")


def test_a_rerouted_containers_start_and_exit_reach_kubelet_as_events(kube: KubeCluster, timings) -> None:
    p = get_pod(kube, "events-rerouted")
    prep = container_status(p, "prep")
    assert prep["state"]["terminated"]["exitCode"] == EXIT_CODE, prep
    assert prep["restartCount"] == 0
    assert prep["lastState"] == {}, "kubelet never took the rerouted container for another"
    model = container_status(p, "model")
    assert "running" in model["state"] and model["restartCount"] == 0
    # It ran on the host, once: the events of the pod's local container listed it, so kubelet never started
    # it again.
    placed = [e for e in kube.agents[ORIGIN].events() if e.get("event") == "placement.decided"]
    assert len(shadows(kube)) == 1, (placed, kube.containers(HOST))
    (sandbox,) = [s.id for s in sandbox_of(kube, ORIGIN, "events-rerouted")]
    assert not any(c.metadata.name == "prep" and c.pod_sandbox_id == sandbox for c in kube.containers(ORIGIN))
    assert timings["rerouted"]["exited"] < SEEN_WITHIN_S + 60


def test_the_hosts_kubelet_leaves_the_exited_shadow_alone(kube: KubeCluster, timings) -> None:
    """Its events never reach the host's kubelet, which would remove an unknown pod's exited container."""
    time.sleep(5)
    (shadow,) = shadows(kube)
    assert shadow.state == CONTAINER_EXITED


def test_figures_rerouted_against_local_under_evented_pleg(request: pytest.FixtureRequest, timings) -> None:
    local, rerouted = timings["local"], timings["rerouted"]
    fixture.report(request.config, "evented PLEG, pod applied to prep running in the API: "
                   f"rerouted {rerouted['running']:.2f} s, local {local['running']:.2f} s "
                   f"({rerouted['running'] / local['running']:.2f}x); to its exit: "
                   f"rerouted {rerouted['exited']:.2f} s, local {local['exited']:.2f} s "
                   f"({rerouted['exited'] / local['exited']:.2f}x)")
    assert local["exited"] > local["running"] and rerouted["exited"] > rerouted["running"]


def test_after_an_agent_restart_kubelet_relists_and_still_sees_rerouted_containers(kube: KubeCluster,
                                                                                   timings) -> None:
    """kubelet retries its event stream five times without a pause, then relists for the rest of its life, as
    after a containerd restart: the stream ends with the agent, and the rerouted stages carry on being seen."""
    agent = kube.agents[ORIGIN]
    agent.stop()
    try:
        wait_for(lambda: kubelet_metric(kube, ORIGIN, "kubelet_evented_pleg_connection_error_count") >= 1,
                 timeout=30, what="kubelet noticing its event stream ended")
    finally:
        agent.start(timeout=60)
    try:
        seen = run_to_exit(kube, "events-after-restart", rerouted=True)
        prep = container_status(get_pod(kube, "events-after-restart"), "prep")
        assert prep["state"]["terminated"]["exitCode"] == EXIT_CODE and prep["restartCount"] == 0
        assert seen["exited"] < SEEN_WITHIN_S + 60
    finally:
        delete(kube, "events-after-restart")
