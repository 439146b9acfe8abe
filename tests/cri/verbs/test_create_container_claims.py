"""CreateContainer of a container whose GPU comes from a DRA claim: classified, leased within the claim, narrowed to it.

kubelet hands the claim's devices over as CDI names only (``<driver>/<class>=<claim UID>-<device>``);
the driver's spec for the claim names each device's GPU by UUID in its edits. The container is a GPU
stage (``dra-claim``), the broker leases within the claim's GPUs only, and what reaches containerd
names exactly the leased devices: the claim's CDI devices of leased GPUs and nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cri_api.v1 import api_pb2 as cri

from shim._pb import broker_pb2 as pb
from shim.broker.simulated import simulated_uuid
from shim.core.placement import LEASE_ANNOTATION, PLACEMENT_REASON_ANNOTATION, PlacementReason
from shim.cri.cdi import CdiSpecs
from shim.cri.verbs import create_container
from shim.cri.verbs.create_container import rewrite_for_lease
from shim.errors import BadAnnotation
from tests.cri.verbs.fakes import ctx, opt_in

G0, G1 = simulated_uuid(0), simulated_uuid(1)  # the test broker's two simulated GPUs
SANDBOX_ID = "5b" * 32
CONTAINER_ID = "c1" * 32
KIND = "gpu.weft.test/claim"
CLAIM = "0c1a1e55-0000-4000-8000-00000000c1a1"


def claim_device(device: str) -> str:
    return f"{KIND}={CLAIM}-{device}"


def write_claim_spec(cdi_dir: Path, gpus: dict[str, str]) -> None:
    """What a DRA driver writes when kubelet prepares the claim: one CDI device per allocated GPU."""
    devices = [{"name": f"{CLAIM}-{dev}", "containerEdits": {"env": [f"WEFT_DRA_{dev.upper().replace('-', '_')}={u}"]}}
               for dev, u in gpus.items()]
    cdi_dir.mkdir(parents=True, exist_ok=True)
    (cdi_dir / f"gpu.weft.test-{CLAIM}.json").write_text(json.dumps({"cdiVersion": "0.5.0", "kind": KIND,
                                                                     "devices": devices}))


# -- rewrite_for_lease ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("claimed", "leased", "after"),
    [
        pytest.param({"gpu-1": {G1}}, [G1], ["gpu-1"], id="the-claims-leased-device-stays"),
        pytest.param({"gpu-0": {G0}, "gpu-1": {G1}}, [G1], ["gpu-1"], id="a-share-keeps-only-its-device"),
        pytest.param({"gpu-0": {G0}, "gpu-1": {G1}}, [G0, G1], ["gpu-0", "gpu-1"], id="whole-claim-keeps-both"),
        pytest.param({"gpus": {G0, G1}}, [G1], [], id="a-device-naming-an-unleased-gpu-goes"),
    ],
)
def test_a_claims_cdi_devices_are_narrowed_to_the_leased_gpus(claimed: dict[str, set[str]], leased: list[str],
                                                             after: list[str]) -> None:
    c = cri.ContainerConfig(metadata=cri.ContainerMetadata(name="model"))
    c.CDI_devices.add(name="vendor.com/fpga=1")
    for dev in claimed:
        c.CDI_devices.add(name=claim_device(dev))
    rewrite_for_lease(c, pb.Lease(lease_id="l-1", device_uuids=leased),
                      {claim_device(d): frozenset(u) for d, u in claimed.items()})
    # No vendor name is added for a claim's GPUs: the driver's own edits are what the container gets.
    assert [d.name for d in c.CDI_devices] == ["vendor.com/fpga=1", *map(claim_device, after)]
    assert [e.value for e in c.envs if e.key == "NVIDIA_VISIBLE_DEVICES"] == [",".join(leased)]


# -- the verb -----------------------------------------------------------------------------------------
@pytest.fixture
def create(tmp_path: Path, fabric, containerd, broker):
    containerd.answer("CreateContainer", cri.CreateContainerResponse(container_id=CONTAINER_ID))
    fabric.cdi_specs = CdiSpecs([tmp_path / "etc-cdi", tmp_path / "run-cdi"])
    opt_in(fabric, SANDBOX_ID)
    return create_container.route(fabric)


def request(cdi: list[str], pod_annotations: dict[str, str] | None = None) -> bytes:
    c = cri.ContainerConfig(metadata=cri.ContainerMetadata(name="model"))
    c.image.image = "busybox:1.36"
    for name in cdi:
        c.CDI_devices.add(name=name)
    sandbox = cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="infer", namespace="default", uid="uid-1"),
                                   annotations=pod_annotations or {})
    return cri.CreateContainerRequest(pod_sandbox_id=SANDBOX_ID, config=c, sandbox_config=sandbox).SerializeToString()


def sent(containerd) -> cri.ContainerConfig:
    return cri.CreateContainerRequest.FromString(containerd.only_request("CreateContainer")).config


@pytest.mark.parametrize(
    "annotations",
    [pytest.param({}, id="whole-device"), pytest.param({"weft.io/gpu-memory.model": "20Gi"}, id="share")],
)
def test_a_claims_gpu_is_the_one_leased_and_the_only_one_the_container_gets(tmp_path: Path, fabric, containerd,
                                                                            broker, create, annotations) -> None:
    # The claim holds the second GPU: best fit alone would take the first.
    write_claim_spec(tmp_path / "run-cdi", {"gpu-1": G1})
    create.handle(request([claim_device("gpu-1")], annotations), ctx())
    [lease] = broker.leases()
    assert lease.device_uuids == (G1,)
    config = sent(containerd)
    assert [d.name for d in config.CDI_devices] == [claim_device("gpu-1")]
    assert config.annotations[LEASE_ANNOTATION] == lease.lease_id
    assert config.annotations[PLACEMENT_REASON_ANNOTATION] == PlacementReason.GPU_LEASED.value
    rec = fabric.store.placement(CONTAINER_ID)
    assert (rec.stage, rec.stage_reason) == ("gpu", "dra-claim") and G1 in rec.stage_detail


def test_a_share_of_a_two_gpu_claim_gets_the_cdi_device_of_its_gpu_only(tmp_path: Path, containerd, broker,
                                                                         create) -> None:
    write_claim_spec(tmp_path / "etc-cdi", {"gpu-0": G0, "gpu-1": G1})
    create.handle(request([claim_device("gpu-0"), claim_device("gpu-1")], {"weft.io/gpu-memory.model": "20Gi"}),
                  ctx())
    [lease] = broker.leases()
    [uuid] = lease.device_uuids
    assert [d.name for d in sent(containerd).CDI_devices] == [claim_device("gpu-0" if uuid == G0 else "gpu-1")]


def test_a_claim_of_a_gpu_the_broker_does_not_have_is_refused_not_leased_elsewhere(tmp_path: Path, fabric,
                                                                                   containerd, broker,
                                                                                   create) -> None:
    write_claim_spec(tmp_path / "run-cdi", {"gpu-7": "GPU-5e1a0000-0000-4000-8000-000000000077"})
    with pytest.raises(BadAnnotation, match="not on this node"):
        create.handle(request([claim_device("gpu-7")]), ctx())
    assert broker.leases() == [] and containerd.calls == [] and fabric.store.placements() == []


def test_a_gpu_named_by_its_device_node_in_the_drivers_spec_is_leased_and_given_alone(tmp_path: Path, fabric,
                                                                                    containerd, broker,
                                                                                    create) -> None:
    # NVIDIA's DRA driver hands out names from its node-wide spec, each device edited with its GPU's node.
    devices = [{"name": f"gpu-{i}", "containerEdits": {"deviceNodes": [{"path": f"/dev/nvidia{i}"}]}} for i in (0, 1)]
    spec = {"cdiVersion": "0.5.0", "kind": "k8s.gpu.nvidia.com/device", "devices": devices,
            "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}}
    (tmp_path / "run-cdi").mkdir()
    (tmp_path / "run-cdi" / "k8s.gpu.nvidia.com-device_base.json").write_text(json.dumps(spec))
    create.handle(request(["k8s.gpu.nvidia.com/device=gpu-1"], {"weft.io/gpu-memory.model": "20Gi"}), ctx())
    [lease] = broker.leases()
    assert lease.device_uuids == (G1,)
    assert [d.name for d in sent(containerd).CDI_devices] == ["k8s.gpu.nvidia.com/device=gpu-1"]
    assert fabric.store.placement(CONTAINER_ID).stage_reason == "dra-claim"


def test_an_opaque_cdi_device_without_a_spec_naming_a_gpu_is_not_a_gpu_stage(fabric, containerd, broker,
                                                                             create) -> None:
    create.handle(request([claim_device("gpu-1")]), ctx())
    assert broker.leases() == []
    assert [d.name for d in sent(containerd).CDI_devices] == [claim_device("gpu-1")], "passed as kubelet sent it"
    assert fabric.store.placement(CONTAINER_ID).stage == "cpu"
