"""KAI's GPU share read as its binder leaves a pod (KAI v0.17.0): fraction or memory, on one GPU, refused clearly."""

from __future__ import annotations

import pytest

from shim.core import kai
from shim.core.quantity import AnnotationError

GIB, MIB = 1 << 30, 1 << 20
GPU = "GPU-5d2c7a0e-1f3b-4c8d-9e6a-0b1c2d3e4f50"
KAI_ENV = {"NVIDIA_VISIBLE_DEVICES": GPU, "GPU_PORTION": "0.50", "RUNAI_NUM_OF_GPUS": "0.50"}


def test_a_fraction_is_that_part_of_the_gpu_s_memory_as_a_hard_limit_and_of_its_compute() -> None:
    s = kai.share("team-a/infer", "app", {"gpu-fraction": "0.5"}, KAI_ENV, 80 * GIB)
    assert (s.memory_bytes, s.compute_percent, s.source) == (40 * GIB, 50, kai.ShareSource.KAI_FRACTION)
    assert "gpu-fraction=0.5" in s.detail and "40960 MiB as a hard limit" in s.detail


def test_memory_in_mib_is_the_limit_and_the_binder_s_portion_the_compute() -> None:
    s = kai.share("team-a/infer", "app", {"gpu-memory": "2000"}, {"GPU_PORTION": "0.03"}, 80 * GIB)
    assert (s.memory_bytes, s.compute_percent, s.source) == (2000 * MIB, 3, kai.ShareSource.KAI_MEMORY)


def test_without_the_binder_s_portion_compute_follows_the_share() -> None:
    assert kai.share("p", "app", {"gpu-memory": "20480"}, {}, 80 * GIB).compute_percent == 25
    assert kai.share("p", "app", {"gpu-fraction": "0.25"}, {}, 80 * GIB).compute_percent == 25


@pytest.mark.parametrize(("annotations", "env", "said"), [
    ({"gpu-fraction": "1.5"}, {}, 'gpu-fraction: "1.5" of pod team-a/infer is not a fraction of one GPU'),
    ({"gpu-fraction": "0"}, {}, "is not a fraction of one GPU"),
    ({"gpu-fraction": "nan"}, {}, "is not a fraction of one GPU"),
    ({"gpu-fraction": "half"}, {}, 'gpu-fraction: "half" of pod team-a/infer is not a number'),
    ({"gpu-memory": "2Gi"}, {}, "is not a positive whole number of MiB"),
    ({"gpu-memory": "0"}, {}, "is not a positive whole number of MiB"),
    ({"gpu-memory": "90000"}, {}, 'gpu-memory: "90000" MiB of pod team-a/infer is larger than the GPU it was given'
                                  " (81920 MiB)"),
    ({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"}, {}, "a share on several GPUs"),
    ({"gpu-fraction": "0.5"}, {"GPU_PORTION": "2"}, "is not a portion of one GPU"),
])
def test_what_no_lease_can_honour_is_refused_naming_the_pod(annotations: dict, env: dict, said: str) -> None:
    with pytest.raises(AnnotationError) as err:
        kai.share("team-a/infer", "app", annotations, env, 80 * GIB)
    assert said in str(err.value)


def test_the_share_is_the_container_kai_gave_it_to() -> None:
    ann = {"gpu-fraction": "0.5"}
    assert kai.is_kai_container("app", ann, KAI_ENV), "the one the binder gave GPU_PORTION"
    assert not kai.is_kai_container("sidecar", ann, {})
    named = {**ann, "gpu-fraction-container-name": "model"}
    assert kai.is_kai_container("model", named, {}) and not kai.is_kai_container("app", named, KAI_ENV)
    assert not kai.is_kai_container("app", {}, KAI_ENV), "no KAI annotations, no KAI share"


def test_the_gpu_is_the_uuid_kai_s_binder_put_in_the_variable_in_either_form() -> None:
    assert kai.gpus({"NVIDIA_VISIBLE_DEVICES": GPU}) == [GPU]
    assert kai.gpus({"NVIDIA_VISIBLE_DEVICES": f"k8s.device-plugin.nvidia.com/gpu={GPU}"}) == [GPU]
    assert kai.gpus({}) == []
