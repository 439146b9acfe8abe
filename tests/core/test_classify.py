"""Which stage a container is, and which GPUs it asked for, read from its CreateContainer request.

The table reads as the rules a pod author relies on: the stage annotation
wins, then a GPU device node, then a DRA claim's CDI device, then a GPU CDI
device, then the visible-devices variables; anything else is a CPU stage.
"""

from __future__ import annotations

import pytest

from shim.core.classify import (
    Classification,
    ContainerAsk,
    Stage,
    StageAnnotationError,
    StageReason,
    classify,
    requested_gpus,
)

U0 = "GPU-00000000-0000-4000-8000-000000000000"
U1 = "GPU-00000000-0000-4000-8000-000000000001"
ALL = [U0, U1]
BY_INDEX = {0: U0, 1: U1}


CLAIM0 = "gpu.weft.test/claim=3f1e-gpu-0"  # a DRA driver's CDI names: opaque, unique per claim
CLAIM1 = "gpu.weft.test/claim=3f1e-gpu-1"


def ask(devices=(), cdi=(), envs=None, name="app", claims=None) -> ContainerAsk:
    claims = claims or {}
    return ContainerAsk(name, list(devices), [*cdi, *claims], envs, {n: frozenset(u) for n, u in claims.items()})


# -- classify: the stage annotation ----------------------------------------------
@pytest.mark.parametrize(
    ("value", "stage"),
    [
        pytest.param("cpu", Stage.CPU, id="cpu"),
        pytest.param("gpu", Stage.GPU, id="gpu"),
        pytest.param("local", Stage.LOCAL, id="local"),
        pytest.param("GPU", Stage.GPU, id="upper-case-accepted"),
        pytest.param("  Local\n", Stage.LOCAL, id="surrounding-whitespace-accepted"),
    ],
)
def test_stage_annotation_names_the_stage(value: str, stage: Stage) -> None:
    got = classify(ask(), {"weft.io/stage.app": value})
    assert got.stage is stage
    assert got.reason is StageReason.ANNOTATION
    assert got.detail == f"weft.io/stage.app={stage.value}"


def test_stage_annotation_for_another_container_is_ignored() -> None:
    got = classify(ask(devices=["/dev/nvidia0"]), {"weft.io/stage.sidecar": "cpu"})
    assert (got.stage, got.reason) == (Stage.GPU, StageReason.GPU_DEVICE)


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("gpus", id="typo"),
        pytest.param("remote", id="unknown-stage"),
        pytest.param("", id="empty"),
    ],
)
def test_bad_stage_annotation_is_refused_naming_annotation_and_value(value: str) -> None:
    with pytest.raises(StageAnnotationError) as err:
        classify(ask(), {"weft.io/stage.app": value})
    assert err.value.annotation == "weft.io/stage.app"
    assert err.value.value == value
    assert "weft.io/stage.app" in str(err.value)
    assert repr(value) in str(err.value)


# -- classify: what the request asks for -------------------------------------------
@pytest.mark.parametrize(
    ("container", "stage", "reason"),
    [
        pytest.param(ask(devices=["/dev/nvidia0"]), Stage.GPU, StageReason.GPU_DEVICE, id="nvidia-device-node"),
        pytest.param(ask(devices=["/dev/nvidia12"]), Stage.GPU, StageReason.GPU_DEVICE, id="two-digit-nvidia-node"),
        pytest.param(ask(devices=["/dev/nvidia-caps/nvidia-cap21"]), Stage.GPU, StageReason.GPU_DEVICE,
                     id="mig-capability-node"),
        pytest.param(ask(devices=["/dev/dri/renderD128"]), Stage.GPU, StageReason.GPU_DEVICE, id="dri-render-node"),
        pytest.param(ask(devices=["/dev/dri/card0"]), Stage.GPU, StageReason.GPU_DEVICE, id="dri-card-node"),
        pytest.param(ask(devices=["/dev/nvidiactl"]), Stage.CPU, StageReason.NO_GPU_REQUEST,
                     id="control-node-alone-is-not-a-gpu"),
        pytest.param(ask(devices=["/dev/nvidia-uvm"]), Stage.CPU, StageReason.NO_GPU_REQUEST,
                     id="uvm-node-alone-is-not-a-gpu"),
        pytest.param(ask(devices=["/dev/fuse", "/dev/net/tun"]), Stage.CPU, StageReason.NO_GPU_REQUEST,
                     id="unrelated-device-nodes"),
        pytest.param(ask(cdi=["nvidia.com/gpu=0"]), Stage.GPU, StageReason.CDI_DEVICE, id="nvidia-cdi-index"),
        pytest.param(ask(cdi=["nvidia.com/gpu=all"]), Stage.GPU, StageReason.CDI_DEVICE, id="nvidia-cdi-all"),
        pytest.param(ask(cdi=[f"nvidia.com/gpu={U1}"]), Stage.GPU, StageReason.CDI_DEVICE, id="nvidia-cdi-uuid"),
        pytest.param(ask(cdi=["amd.com/gpu=all"]), Stage.GPU, StageReason.CDI_DEVICE, id="amd-cdi"),
        pytest.param(ask(cdi=["vendor.com/fpga=1"]), Stage.CPU, StageReason.NO_GPU_REQUEST, id="non-gpu-cdi"),
        pytest.param(ask(claims={CLAIM1: [U1]}), Stage.GPU, StageReason.DRA_CLAIM, id="dra-claim-cdi-device"),
        pytest.param(ask(cdi=[CLAIM1]), Stage.CPU, StageReason.NO_GPU_REQUEST,
                     id="opaque-cdi-device-whose-spec-names-no-gpu"),
        pytest.param(ask(envs={"NVIDIA_VISIBLE_DEVICES": "all"}), Stage.GPU, StageReason.VISIBLE_DEVICES_ENV,
                     id="nvidia-visible-all"),
        pytest.param(ask(envs={"NVIDIA_VISIBLE_DEVICES": "0"}), Stage.GPU, StageReason.VISIBLE_DEVICES_ENV,
                     id="nvidia-visible-index"),
        pytest.param(ask(envs={"CUDA_VISIBLE_DEVICES": U0}), Stage.GPU, StageReason.VISIBLE_DEVICES_ENV,
                     id="cuda-visible-uuid"),
        pytest.param(ask(envs={"NVIDIA_VISIBLE_DEVICES": "void"}), Stage.CPU, StageReason.NO_GPU_REQUEST,
                     id="nvidia-visible-void"),
        pytest.param(ask(envs={"NVIDIA_VISIBLE_DEVICES": "None"}), Stage.CPU, StageReason.NO_GPU_REQUEST,
                     id="nvidia-visible-none-any-case"),
        pytest.param(ask(envs={"NVIDIA_VISIBLE_DEVICES": ""}), Stage.CPU, StageReason.NO_GPU_REQUEST,
                     id="nvidia-visible-empty"),
        pytest.param(ask(envs={"CUDA_VISIBLE_DEVICES": "-1"}), Stage.CPU, StageReason.NO_GPU_REQUEST,
                     id="cuda-visible-minus-one"),
        pytest.param(ask(envs={"NVIDIA_VISIBLE_DEVICES": "void", "CUDA_VISIBLE_DEVICES": "1"}), Stage.GPU,
                     StageReason.VISIBLE_DEVICES_ENV, id="either-variable-naming-a-gpu-is-enough"),
        pytest.param(ask(envs={"PATH": "/bin"}), Stage.CPU, StageReason.NO_GPU_REQUEST, id="no-gpu-env"),
        pytest.param(ask(envs=None), Stage.CPU, StageReason.NO_GPU_REQUEST, id="no-env-at-all"),
    ],
)
def test_request_decides_the_stage(container: ContainerAsk, stage: Stage, reason: StageReason) -> None:
    got = classify(container, {})
    assert (got.stage, got.reason) == (stage, reason)


@pytest.mark.parametrize(
    ("container", "annotations", "reason", "detail_mentions"),
    [
        pytest.param(ask(devices=["/dev/nvidia0"], cdi=["nvidia.com/gpu=0"], envs={"NVIDIA_VISIBLE_DEVICES": "0"}),
                     {"weft.io/stage.app": "cpu"}, StageReason.ANNOTATION, "weft.io/stage.app=cpu",
                     id="annotation-beats-everything"),
        pytest.param(ask(devices=["/dev/nvidia1"], cdi=["nvidia.com/gpu=0"], envs={"NVIDIA_VISIBLE_DEVICES": "0"}),
                     {}, StageReason.GPU_DEVICE, "/dev/nvidia1", id="device-node-beats-cdi-and-env"),
        pytest.param(ask(cdi=["nvidia.com/gpu=0"], envs={"NVIDIA_VISIBLE_DEVICES": "1"}),
                     {}, StageReason.CDI_DEVICE, "nvidia.com/gpu=0", id="cdi-beats-env"),
        pytest.param(ask(cdi=["nvidia.com/gpu=0"], claims={CLAIM1: [U1]}), {}, StageReason.DRA_CLAIM, U1,
                     id="claim-beats-vendor-cdi-and-detail-names-its-gpu"),
        pytest.param(ask(devices=["/dev/nvidia0"], claims={CLAIM1: [U1]}), {}, StageReason.GPU_DEVICE,
                     "/dev/nvidia0", id="device-node-beats-claim"),
        pytest.param(ask(envs={"CUDA_VISIBLE_DEVICES": "3"}), {}, StageReason.VISIBLE_DEVICES_ENV,
                     "CUDA_VISIBLE_DEVICES=3", id="env-detail-names-the-variable"),
    ],
)
def test_precedence_and_detail(container: ContainerAsk, annotations: dict[str, str], reason: StageReason,
                               detail_mentions: str) -> None:
    got = classify(container, annotations)
    assert got.reason is reason
    assert detail_mentions in got.detail


def test_classification_is_a_frozen_value() -> None:
    got = classify(ask(), {})
    assert got == Classification(Stage.CPU, StageReason.NO_GPU_REQUEST, got.detail)
    with pytest.raises(AttributeError):
        got.stage = Stage.GPU  # type: ignore[misc]


# -- requested_gpus ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("container", "count", "domain"),
    [
        pytest.param(ask(devices=["/dev/nvidia0"]), 1, {U0}, id="device-node-by-index"),
        pytest.param(ask(devices=["/dev/nvidia0", "/dev/nvidia1"]), 2, {U0, U1}, id="two-device-nodes"),
        pytest.param(ask(devices=["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia1"]), 1, {U1},
                     id="control-nodes-are-not-counted"),
        pytest.param(ask(devices=["/dev/nvidia7"]), 1, None, id="device-node-not-on-this-node-means-any"),
        pytest.param(ask(devices=["/dev/nvidia0"], envs={"NVIDIA_VISIBLE_DEVICES": "1"}), 1, {U0},
                     id="device-nodes-beat-env"),
        pytest.param(ask(cdi=["nvidia.com/gpu=1"]), 1, {U1}, id="cdi-index"),
        pytest.param(ask(cdi=[f"nvidia.com/gpu={U0}"]), 1, {U0}, id="cdi-uuid"),
        pytest.param(ask(cdi=["nvidia.com/gpu=0", "nvidia.com/gpu=1"]), 2, {U0, U1}, id="two-cdi-devices"),
        pytest.param(ask(cdi=["nvidia.com/gpu=all"]), 2, None, id="cdi-all-is-every-device-any-domain"),
        pytest.param(ask(cdi=["nvidia.com/gpu=GPU-not-here"]), 1, None, id="cdi-unknown-uuid-means-any"),
        pytest.param(ask(cdi=["vendor.com/fpga=0"]), 1, None, id="non-gpu-cdi-not-counted"),
        pytest.param(ask(envs={"NVIDIA_VISIBLE_DEVICES": "0,1"}), 2, {U0, U1}, id="env-index-list"),
        pytest.param(ask(envs={"NVIDIA_VISIBLE_DEVICES": " 0 , 1 "}), 2, {U0, U1}, id="env-list-with-spaces"),
        pytest.param(ask(envs={"NVIDIA_VISIBLE_DEVICES": U1}), 1, {U1}, id="env-uuid"),
        pytest.param(ask(envs={"CUDA_VISIBLE_DEVICES": "1"}), 1, {U1}, id="cuda-env-index"),
        pytest.param(ask(envs={"NVIDIA_VISIBLE_DEVICES": "all"}), 2, None, id="env-all"),
        pytest.param(ask(envs={"NVIDIA_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "1"}), 1, {U0},
                     id="nvidia-variable-read-before-cuda"),
        pytest.param(ask(envs={"NVIDIA_VISIBLE_DEVICES": "void", "CUDA_VISIBLE_DEVICES": "1"}), 1, {U1},
                     id="void-nvidia-variable-falls-through-to-cuda"),
        pytest.param(ask(envs={"NVIDIA_VISIBLE_DEVICES": "0,7"}), 2, None,
                     id="partly-unknown-list-means-any"),
        pytest.param(ask(envs={"NVIDIA_VISIBLE_DEVICES": "MIG-abc"}), 1, None, id="env-unknown-identifier"),
        pytest.param(ask(), 1, None, id="nothing-named-means-one-device-anywhere"),
        pytest.param(ask(claims={CLAIM1: [U1]}), 1, {U1}, id="claim-device-is-the-domain"),
        pytest.param(ask(claims={CLAIM0: [U0], CLAIM1: [U1]}), 2, {U0, U1}, id="claim-of-two-devices"),
        pytest.param(ask(claims={CLAIM0: [U0, U1]}), 2, {U0, U1}, id="one-cdi-device-naming-two-gpus"),
        pytest.param(ask(cdi=["nvidia.com/gpu=all"], claims={CLAIM1: [U1]}), 1, {U1},
                     id="claim-narrows-whatever-else-was-asked"),
        pytest.param(ask(claims={CLAIM1: ["/dev/nvidia1"]}), 1, {U1}, id="claim-device-named-by-its-node"),
        pytest.param(ask(claims={CLAIM1: ["GPU-not-on-this-node"]}), 1, {"GPU-not-on-this-node"},
                     id="claim-of-an-unknown-gpu-stays-its-domain-for-the-broker-to-refuse"),
    ],
)
def test_requested_gpus(container: ContainerAsk, count: int, domain: set[str] | None) -> None:
    got_count, got_domain = requested_gpus(container, ALL, BY_INDEX)
    assert got_count == count
    assert got_domain == (frozenset(domain) if domain is not None else None)
