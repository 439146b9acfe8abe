"""GPUs requested through DRA, under the real control plane, on containerd 2.x (CDI on).

The API server serves ``resource.k8s.io/v1``; kube-controller-manager's resourceclaim controller
makes each pod's ResourceClaim from a ResourceClaimTemplate; the scheduler allocates it from the
ResourceSlice the test DRA driver (``components/dra/gpudriver``) publishes for the node's GPUs, which are
the broker's simulated GPUs by their UUIDs (passed to the driver from the broker's own inventory);
kubelet has the driver prepare the claim, and hands the container the claim's CDI device, named by
the claim's UID, whose spec names the GPU by UUID.

The claim asks for the broker's second GPU by its ``uuid`` attribute, so a broker that ignored the
claim would lease the first (best fit on an idle node): the opted-in pod is Ready, classified
``gpu`` for its claim (``dra-claim``, ``weft explain``), leased that GPU and no other, whole or as
a 20 GiB share (``weft.io/gpu-memory.model``), and its container has that GPU's CDI edits and
names it alone. The same pod without the ``weft`` runtime
class is the plain baseline: Ready, its claim's CDI device applied by containerd, no lease.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from harness import fixture
from harness.cluster import KubeCluster, NodeSpec
from harness.dra import DraDriver, claim_template, device_class, with_claim
from harness.workloads import apply, container, container_status, delete, pod, wait_ready
from shim._pb import broker_pb2 as pb
from shim.localfabric.waiting import wait_for

pytestmark = pytest.mark.slow

NODE = "gpu-1"
TEMPLATE = "second-gpu"
ROUNDS = 3
ready_s: dict[str, float] = {}  # kubectl apply to Ready, by pod


@pytest.fixture(scope="module")
def kube(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    # CDI is on by default from containerd 2.0 (1.6 has none, 1.7 only when configured).
    yield from fixture.cluster(request, tmp_path_factory, [NodeSpec(NODE, "gpu")], containerd_line="2")


@pytest.fixture(scope="module")
def gpus(kube: KubeCluster) -> list[str]:
    """The broker's GPU UUIDs, in index order: what the driver publishes, so the two agree by configuration."""
    assert kube.broker is not None
    ch, stub = kube.broker.stub()
    with ch:
        devices = sorted(stub.Devices(pb.DevicesRequest(), timeout=10).devices, key=lambda d: d.index)
    assert len(devices) >= 2, "the claim asks for the second GPU"
    return [d.uuid for d in devices]


@pytest.fixture(scope="module")
def dra(request: pytest.FixtureRequest, kube: KubeCluster, gpus: list[str]) -> Iterator[DraDriver]:
    assert kube.control is not None
    t0 = time.monotonic()
    kube.control.start_controller_manager(["resourceclaim-controller"])
    node = kube.node(NODE)
    driver = DraDriver(NODE, kube.kubelets[NODE].root_dir, kube.control.kubeconfig("admin"), gpus,
                       node.containerd.cdi_spec_dir, node.workdir)
    try:
        registered = driver.start()
        apply(kube, device_class(), claim_template(TEMPLATE, gpus[1]))
        wait_for(lambda: _published(kube), timeout=60, what="the driver's ResourceSlice", every=0.2)
        fixture.report(request.config, f"DRA: controller-manager and driver up, driver registered with kubelet "
                                       f"{registered:.1f} s after its start, slice published "
                                       f"{time.monotonic() - t0:.1f} s after the controller-manager's")
        yield driver
    finally:
        driver.stop()


def _published(kube: KubeCluster) -> bool:
    slices = kube.api("/apis/resource.k8s.io/v1/resourceslices")["items"]
    return any(s["spec"].get("nodeName") == NODE and s["spec"]["driver"] == "gpu.weft.test" for s in slices)


def _gpu_pod(name: str, runtime_class: str | None, annotations: dict[str, str] | None) -> dict:
    return with_claim(pod(name, [container("model", "echo model up; exec sleep 3600")], runtime_class=runtime_class,
                          annotations=annotations), "model", TEMPLATE)


def _run(kube: KubeCluster, name: str, runtime_class: str | None, annotations: dict[str, str] | None = None) -> dict:
    # The claim from the template is the pod's own and holds the second GPU: one pod at a time.
    wait_for(lambda: not kube.api("/apis/resource.k8s.io/v1/namespaces/default/resourceclaims")["items"],
             timeout=120, what="no claim left from an earlier pod", every=0.2)
    t0 = time.monotonic()
    apply(kube, _gpu_pod(name, runtime_class, annotations))
    p = wait_ready(kube, name)
    ready_s[name] = time.monotonic() - t0
    return p


def _claim_of(kube: KubeCluster, p: dict) -> dict:
    [status] = p["status"]["resourceClaimStatuses"]
    return kube.api(f"/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{status['resourceClaimName']}")


def _env(kube: KubeCluster, name: str) -> dict[str, str]:
    out = kube.kubectl("exec", name, "-c", "model", "--", "env").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _explain(kube: KubeCluster, container_id: str) -> dict:
    res = subprocess.run([sys.executable, "-m", "shim", "explain", "--socket", str(kube.agents[NODE].socket),
                          "--json", container_id], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(res.stdout)


@pytest.mark.parametrize("share", [pytest.param(False, id="whole-gpu"), pytest.param(True, id="20Gi-share")])
def test_an_opted_in_pod_is_leased_its_claims_gpu_and_sees_only_it(kube: KubeCluster, dra: DraDriver,
                                                                   gpus: list[str], share: bool) -> None:
    name = "dra-share" if share else "dra-opted"
    p = _run(kube, name, "weft", {"weft.io/gpu-memory.model": "20Gi"} if share else None)
    try:
        [result] = _claim_of(kube, p)["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["device"]) == ("gpu.weft.test", "gpu-1"), result
        cid = container_status(p, "model")["containerID"].removeprefix("containerd://")
        doc = _explain(kube, cid)
        assert (doc["stage"], doc["stage_reason"], doc["reason"]) == ("gpu", "dra-claim", "gpu-leased"), doc
        assert gpus[1] in doc["stage_detail"], doc
        [lease] = kube.broker.leases()
        assert lease.container_id == cid and lease.state == "bound", lease
        assert list(lease.device_uuids) == [gpus[1]], "leased within the claim: the second GPU, not the first"
        assert lease.shared is share and (lease.memory_bytes == 20 << 30 or not share), lease
        env = _env(kube, name)
        # containerd applied the driver's edits for the leased device, and the variables name it alone.
        assert {k: v for k, v in env.items() if k.startswith("WEFT_DRA_")} == {"WEFT_DRA_GPU_1": gpus[1]}, env
        assert env["NVIDIA_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"] == gpus[1]
        assert ("CUDA_MPS_PIPE_DIRECTORY" in env) is share, env
    finally:
        delete(kube, name)
    assert kube.broker.leases() == [], "the lease went with the container"


def test_the_same_pod_without_weft_gets_its_claims_device_from_containerd(kube: KubeCluster, dra: DraDriver,
                                                                          gpus: list[str]) -> None:
    p = _run(kube, "dra-plain", None)
    try:
        [result] = _claim_of(kube, p)["status"]["allocation"]["devices"]["results"]
        assert result["device"] == "gpu-1", result
        assert kube.broker.leases() == []
        env = _env(kube, "dra-plain")
        assert {k: v for k, v in env.items() if k.startswith("WEFT_DRA_")} == {"WEFT_DRA_GPU_1": gpus[1]}, env
        assert "NVIDIA_VISIBLE_DEVICES" not in env, "nothing of weft's"
    finally:
        delete(kube, "dra-plain")


def test_time_to_ready_opted_in_and_plain(request: pytest.FixtureRequest, kube: KubeCluster, dra: DraDriver,
                                          gpus: list[str]) -> None:
    """The figure: the same DRA GPU pod, opted in (a whole GPU) and plain, in turn, a few rounds each; each opted-in
    round holds its claim's GPU through the broker, each plain one nothing."""
    times: dict[str, list[float]] = {"opted": [], "plain": []}
    for i in range(ROUNDS):
        for kind, runtime_class in (("opted", "weft"), ("plain", None)):
            name = f"dra-{kind}-{i}"
            _run(kube, name, runtime_class)
            times[kind].append(ready_s[name])
            held = [list(lease.device_uuids) for lease in kube.broker.leases()]
            delete(kube, name)
            assert held == ([[gpus[1]]] if runtime_class else []), (name, held)
    opted, plain = statistics.median(times["opted"]), statistics.median(times["plain"])
    rounds = ", ".join(f"{o:.2f}/{p:.2f}" for o, p in zip(times["opted"], times["plain"], strict=True))
    fixture.report(request.config, f"DRA GPU pod, kubectl apply to Ready, median of {ROUNDS}: opted in {opted:.2f} s, "
                                   f"plain {plain:.2f} s ({opted / plain:.2f}x; rounds opted/plain {rounds} s)")
