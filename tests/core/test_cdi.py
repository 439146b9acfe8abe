"""CDI names and specs as weft reads them: which names say their GPU, which specs name one, which are a claim's."""

from __future__ import annotations

import pytest

from shim.core.cdi import claim_gpus, names_gpu_itself, resolve, spec_gpus, uuids_in_env

U0 = "GPU-00000000-0000-4000-8000-000000000000"
U1 = "GPU-00000000-0000-4000-8000-000000000001"


@pytest.mark.parametrize(
    ("name", "itself"),
    [
        pytest.param("nvidia.com/gpu=0", True, id="vendor-index"),
        pytest.param("nvidia.com/gpu=all", True, id="vendor-all"),
        pytest.param(f"nvidia.com/gpu={U1}", True, id="vendor-uuid"),
        pytest.param("nvidia.com/mig=MIG-1234-abcd", True, id="vendor-mig-uuid"),
        pytest.param("k8s.gpu.example.com/gpu=3f1e-gpu-0", False, id="gpu-kind-with-a-claims-opaque-name"),
        pytest.param("gpu.weft.test/claim=3f1e-gpu-0", False, id="claim-kind"),
        pytest.param("vendor.com/fpga=1", False, id="not-a-gpu-kind"),
    ],
)
def test_which_names_say_their_gpu(name: str, itself: bool) -> None:
    assert names_gpu_itself(name) is itself


@pytest.mark.parametrize(
    ("env", "uuids"),
    [
        pytest.param([f"WEFT_DRA_GPU_1={U1}"], {U1}, id="a-drivers-own-variable"),
        pytest.param([f"NVIDIA_VISIBLE_DEVICES={U0},{U1}"], {U0, U1}, id="a-comma-separated-list"),
        pytest.param(["NVIDIA_VISIBLE_DEVICES=0", "PATH=/bin"], set(), id="indices-and-other-values-name-no-uuid"),
        pytest.param(["NO_EQUALS_SIGN", f"A= {U0} "], {U0}, id="spaces-trimmed-and-bare-keys-ignored"),
    ],
)
def test_uuids_named_in_the_environment(env: list[str], uuids: set[str]) -> None:
    assert uuids_in_env(env) == uuids


def test_a_spec_maps_each_device_to_the_gpus_its_own_edits_name() -> None:
    spec = {"cdiVersion": "0.5.0", "kind": "gpu.weft.test/claim",
            "containerEdits": {"env": [f"COMMON={U0}"]},
            "devices": [{"name": "c-gpu-1", "containerEdits": {"env": [f"WEFT_DRA_GPU_1={U1}"]}},
                        {"name": "c-helper", "containerEdits": {"env": ["X=1"]}},
                        {"name": "c-nodes", "containerEdits": {"deviceNodes": [{"path": "/dev/x"}]}}]}
    assert spec_gpus(spec) == {"gpu.weft.test/claim=c-gpu-1": frozenset({U1})}


def test_a_device_named_by_its_gpus_device_node_as_nvidias_dra_driver_writes_it() -> None:
    # The shape of NVIDIA's DRA driver's node-wide spec: per device its GPU's node, the rest spec-wide.
    spec = {"cdiVersion": "0.5.0", "kind": "k8s.gpu.nvidia.com/device",
            "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=void"],
                               "deviceNodes": [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia-uvm"}]},
            "devices": [{"name": "gpu-0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}},
                        {"name": "gpu-1", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia1", "hostPath": "/x"},
                                                                             {"path": "/dev/nvidia-caps/cap1"}]}}]}
    assert spec_gpus(spec) == {"k8s.gpu.nvidia.com/device=gpu-0": frozenset({"/dev/nvidia0"}),
                               "k8s.gpu.nvidia.com/device=gpu-1": frozenset({"/dev/nvidia1"})}


@pytest.mark.parametrize(
    ("named", "uuids"),
    [
        pytest.param({U1}, {U1}, id="a-uuid-is-itself"),
        pytest.param({"/dev/nvidia1"}, {U1}, id="a-device-node-by-this-nodes-index"),
        pytest.param({"/dev/nvidia7"}, {"/dev/nvidia7"}, id="a-node-of-no-gpu-here-stays-for-the-broker-to-refuse"),
    ],
)
def test_resolve(named: set[str], uuids: set[str]) -> None:
    assert resolve(named, {0: U0, 1: U1}) == uuids


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param({}, id="empty"),
        pytest.param({"kind": "a.b/c", "devices": "nope"}, id="devices-not-a-list"),
        pytest.param({"kind": 3, "devices": []}, id="kind-not-a-string"),
        pytest.param({"kind": "a.b/c", "devices": [7, {"name": 1}, {"name": "x", "containerEdits": []},
                                                    {"name": "y", "containerEdits": {"env": [None, 2]}}]},
                     id="malformed-devices-skipped"),
    ],
)
def test_a_malformed_spec_names_nothing(spec: dict) -> None:
    assert spec_gpus(spec) == {}


def test_a_claims_devices_are_the_opaque_names_whose_specs_name_a_gpu() -> None:
    known = {"gpu.weft.test/claim=c-gpu-1": frozenset({U1}), "nvidia.com/gpu=0": frozenset({U0})}
    asked = ["gpu.weft.test/claim=c-gpu-1", "nvidia.com/gpu=0", "vendor.com/fpga=1", "gpu.weft.test/claim=gone"]
    # A vendor's self-naming CDI device keeps its own meaning even where a spec names its GPU too.
    assert claim_gpus(asked, known) == {"gpu.weft.test/claim=c-gpu-1": frozenset({U1})}
