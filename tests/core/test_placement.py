"""Where a classified container runs and why, and the GPU share read from the pod's annotations."""

from __future__ import annotations

import pytest

from shim.core.classify import Classification, Stage, StageReason
from shim.core.placement import LOCAL, GpuAsk, PlacementReason, gpu_ask, place
from shim.core.quantity import AnnotationError

GI = 2**30


@pytest.mark.parametrize(
    ("classification", "reason", "detail"),
    [
        pytest.param(Classification(Stage.GPU, StageReason.GPU_DEVICE, "device /dev/nvidia0"),
                     PlacementReason.GPU_LEASED, "leased GPUs", id="gpu-stage-runs-here-on-leased-gpus"),
        pytest.param(Classification(Stage.LOCAL, StageReason.ANNOTATION, "weft.io/stage.app=local"),
                     PlacementReason.PINNED_LOCAL, "weft.io/stage.app=local",
                     id="local-stage-is-pinned-and-says-by-which-annotation"),
        pytest.param(Classification(Stage.CPU, StageReason.NO_GPU_REQUEST, "no GPU"),
                     PlacementReason.NO_MESH, "no peer mesh", id="cpu-stage-stays-here-without-a-mesh"),
        pytest.param(Classification(Stage.CPU, StageReason.ANNOTATION, "weft.io/stage.app=cpu"),
                     PlacementReason.NO_MESH, "no peer mesh", id="cpu-by-annotation-also-stays-without-a-mesh"),
    ],
)
def test_place_gives_the_reason_for_each_stage(classification: Classification, reason: PlacementReason,
                                               detail: str) -> None:
    got = place(classification)
    assert got.stage is classification.stage
    assert got.target == LOCAL
    assert got.reason is reason
    assert detail in got.detail


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        pytest.param({}, GpuAsk(None, 100), id="no-annotations-whole-device-full-compute"),
        pytest.param({"weft.io/gpu-memory.app": "20Gi"}, GpuAsk(20 * GI, 25),
                     id="memory-only-gets-the-same-fraction-of-compute"),
        pytest.param({"weft.io/gpu-memory.app": "100Mi"}, GpuAsk(100 * 2**20, 1),
                     id="tiny-memory-share-gets-at-least-one-percent"),
        pytest.param({"weft.io/gpu-memory.app": "20Gi", "weft.io/gpu-compute.app": "60"}, GpuAsk(20 * GI, 60),
                     id="explicit-compute-beats-the-memory-fraction"),
        pytest.param({"weft.io/gpu-compute.app": "50%"}, GpuAsk(None, 50), id="compute-only"),
        pytest.param({"weft.io/gpu-memory.app": "512Mi", "weft.io/gpu-compute.app": "25"},
                     GpuAsk(512 * 2**20, 25), id="memory-and-compute"),
        pytest.param({"weft.io/gpu-memory.app": "80Gi"}, GpuAsk(80 * GI, 100),
                     id="exactly-the-largest-device-gets-full-compute"),
        pytest.param({"weft.io/gpu-memory.other": "20Gi", "weft.io/gpu-compute.other": "10"},
                     GpuAsk(None, 100), id="another-containers-annotations-are-ignored"),
    ],
)
def test_gpu_ask_reads_the_containers_annotations(annotations: dict[str, str], expected: GpuAsk) -> None:
    assert gpu_ask("app", annotations, 80 * GI) == expected


def test_gpu_ask_without_known_devices_has_no_upper_bound_and_full_compute() -> None:
    assert gpu_ask("app", {"weft.io/gpu-memory.app": "1Ti"}, None) == GpuAsk(2**40, 100)


@pytest.mark.parametrize(
    ("annotations", "bad", "problem"),
    [
        pytest.param({"weft.io/gpu-memory.app": "20GB"}, "weft.io/gpu-memory.app", 'unknown suffix "GB"',
                     id="memory-decimal-bytes-suffix"),
        pytest.param({"weft.io/gpu-memory.app": "lots"}, "weft.io/gpu-memory.app", "not a quantity",
                     id="memory-not-a-quantity"),
        pytest.param({"weft.io/gpu-memory.app": "81Gi"}, "weft.io/gpu-memory.app", "larger than any device",
                     id="memory-larger-than-the-largest-device"),
        pytest.param({"weft.io/gpu-memory.app": "0"}, "weft.io/gpu-memory.app", "zero", id="memory-zero"),
        pytest.param({"weft.io/gpu-compute.app": "150"}, "weft.io/gpu-compute.app", "over 100",
                     id="compute-over-100"),
        pytest.param({"weft.io/gpu-memory.app": "20Gi", "weft.io/gpu-compute.app": "half"},
                     "weft.io/gpu-compute.app", "not a percent", id="good-memory-bad-compute-names-compute"),
    ],
)
def test_gpu_ask_errors_name_the_annotation(annotations: dict[str, str], bad: str, problem: str) -> None:
    with pytest.raises(AnnotationError) as err:
        gpu_ask("app", annotations, 80 * GI)
    assert err.value.annotation == bad
    assert err.value.value == annotations[bad]
    assert str(err.value).startswith(bad + ":")
    assert problem in str(err.value)
