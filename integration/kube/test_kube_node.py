"""One real node: kubelet v1.34 with a ``weft agent`` as its runtime and image endpoint, under a real API server.

What a cluster user sees: a plain pod and a ``runtimeClassName: weft`` pod both run and turn Ready
through HTTP probes; ``kubectl logs``, ``exec`` (stdin, exit codes) and ``port-forward`` work on
both; the plain pod's sandbox never runs on the ``weft`` handler (asked of containerd itself). And
the faults: with the agent gone kubelet reports the runtime down (the Node turns NotReady) and
recovers when it is back; with the API server gone, running pods and CRI through the agent carry on;
kubelet restarted without its records of what it gave each container keeps its pods and lives.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from cri_api.v1.api_pb2 import CONTAINER_RUNNING

from harness import fixture
from harness.cluster import KubeCluster, NodeSpec
from harness.workloads import (
    Terminal,
    apply,
    container,
    container_status,
    crictl,
    delete,
    get_pod,
    http_get,
    pod,
    port_forward,
    sandbox_of,
    wait_ready,
    web,
)
from shim.localfabric.waiting import wait_for

pytestmark = pytest.mark.slow

NODE = "gpu-1"


@pytest.fixture(scope="module")
def kube(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    yield from fixture.cluster(request, tmp_path_factory, [NodeSpec(NODE, "gpu")])


@pytest.fixture(scope="module")
def two_pods(kube: KubeCluster) -> Iterator[tuple[str, str]]:
    """A plain pod (placed by the scheduler) and an opted-in one, both Ready."""
    apply(kube, pod("plain", [web("web", 8080, "page-of-plain")]),
          pod("opted", [web("web", 8080, "page-of-opted")], runtime_class="weft"))
    try:
        wait_ready(kube, "plain")
        wait_ready(kube, "opted")
        yield "plain", "opted"
    finally:
        delete(kube, "plain", "opted")


@pytest.mark.pinned_kubelet(
    "the InPlacePodVerticalScaling gate is locked on from v1.35, and kubelet v1.36.3 without pod cgroups still "
    "crashes on a running container with no actuated-resources record (kubernetes/kubernetes#137993)")
def test_kubelet_restarted_without_its_resize_records_keeps_running(kube: KubeCluster) -> None:
    """kubelet v1.34 with in-place resize on and no pod cgroups (``cgroupsPerQOS: false``, as in the harness)
    dereferences a nil pod cgroup config in ``doPodResizeAction`` when a running container with requests has no
    actuated-resources record (kubernetes/kubernetes#137999), and exits. Under load, a running pod deleted
    (its records with it) while kubelet still synced it got there: kubelet died between a call and its answer,
    and the node's next pods never started. Here the records go over a restart, every time. The harness
    turns the gate off (``Kubelet.config``). First in the module: ``two_pods``' token volumes, mounted by
    the first kubelet, would not unmount under the second."""
    sized = pod("sized", [container("c", "sleep 3600", resources={"requests": {"cpu": "100m", "memory": "32Mi"}})])
    # No token volume: a second kubelet, in a mount namespace of its own, could not unmount the first one's.
    sized["spec"]["automountServiceAccountToken"] = False
    apply(kube, sized)
    try:
        wait_ready(kube, "sized")
        kubelet = kube.kubelets[NODE]
        kubelet.stop()
        (kubelet.root_dir / "actuated_pods_state").unlink(missing_ok=True)  # absent with the gate off
        seen = kubelet.log_path.stat().st_size
        kubelet.start()
        synced = '"SyncLoop ADD" source="api" pods=["default/sized"]'

        def first_sync() -> bool:
            assert kubelet.running, kubelet.log_tail(40)
            with open(kubelet.log_path, errors="replace") as f:
                f.seek(seen)
                return synced in f.read()

        wait_for(first_sync, timeout=120, what="kubelet's first sync of the pod after its restart")
        for _ in range(20):  # the pod's sync, where kubelet would crash, follows the ADD at once
            assert kubelet.running, kubelet.log_tail(40)
            time.sleep(0.5)
        kube.wait_node_ready(NODE, timeout=120)
        assert container_status(wait_ready(kube, "sized"), "c")["restartCount"] == 0
    finally:
        delete(kube, "sized")


def test_plain_and_opted_in_pods_run_and_answer_kubectl(kube: KubeCluster, two_pods: tuple[str, str]) -> None:
    for name in two_pods:
        assert get_pod(kube, name)["spec"]["nodeName"] == NODE  # the scheduler placed it
        assert "web starting" in kube.kubectl("logs", name).stdout
        assert kube.kubectl("exec", name, "--", "cat", "/www/index.html").stdout.strip() == f"page-of-{name}"
        echoed = kube.kubectl("exec", "-i", name, "--", "sh", "-c", "read x; echo got-$x", stdin="hello\n")
        assert echoed.stdout.strip() == "got-hello"
        assert kube.kubectl("exec", name, "--", "sh", "-c", "exit 3", check=False).returncode == 3
        with Terminal(kube.control.kubectl_argv("exec", "-it", name, "--", "sh")) as tty:
            tty.send("echo $((6*7))x\n")
            tty.expect("42x")
            tty.send("exit 5\n")
            assert tty.wait() == 5
        with port_forward(kube, f"pod/{name}", 8080) as local:
            assert http_get(f"http://127.0.0.1:{local}/").strip() == f"page-of-{name}"


def test_only_the_opted_in_pod_runs_on_the_weft_handler(kube: KubeCluster, two_pods: tuple[str, str]) -> None:
    plain, opted = (sandbox_of(kube, NODE, name) for name in two_pods)
    assert plain and opted
    assert {s.runtime_handler for s in plain} <= {"", "runc"}
    assert {s.runtime_handler for s in opted} == {"weft"}


def test_kubelet_reports_the_runtime_down_while_the_agent_is_away(kube: KubeCluster,
                                                                   two_pods: tuple[str, str]) -> None:
    agent = kube.agents[NODE]
    before = {name: container_status(get_pod(kube, name), "web")["containerID"] for name in two_pods}
    agent.stop()
    try:
        kube.wait_node_ready(NODE, timeout=120, ready=False)
        node = kube.api(f"/api/v1/nodes/{NODE}")
        message = next(c["message"] for c in node["status"]["conditions"] if c["type"] == "Ready")
        assert "container runtime" in message.lower() or "pleg" in message.lower(), message
    finally:
        agent.start(timeout=60)
    kube.wait_node_ready(NODE, timeout=120)
    for name in two_pods:
        p = wait_ready(kube, name)
        status = container_status(p, "web")
        assert status["containerID"] == before[name] and status["restartCount"] == 0


def test_pods_and_cri_carry_on_without_the_api_server(kube: KubeCluster, two_pods: tuple[str, str]) -> None:
    assert kube.control is not None
    agent = kube.agents[NODE]
    netns = kube.node(NODE).netns_path
    ids = {c.id for c in kube.containers(NODE) if c.metadata.name == "web"}
    kube.control.stop_apiserver()
    try:
        # Over several of kubelet's sync periods (10 s here) its pods run on and CRI answers through the agent.
        for _ in range(4):
            running = {c.id for c in kube.containers(NODE) if c.metadata.name == "web" and c.state == CONTAINER_RUNNING}
            assert running == ids
            listed = crictl(agent.socket, "ps", "--name", "web", "-q", netns=netns).stdout.split()
            assert set(listed) == ids
            for cid in ids:
                assert crictl(agent.socket, "exec", cid, "cat", "/www/index.html", netns=netns).stdout.startswith(
                    "page-of-")
            time.sleep(5)
    finally:
        kube.control.start_apiserver()
    kube.wait_node_ready(NODE, timeout=120)
    for name in two_pods:
        assert container_status(wait_ready(kube, name), "web")["restartCount"] == 0
