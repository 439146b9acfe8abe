"""What the pod spec says about a container that its CRI request does not."""

from __future__ import annotations

import pytest

from shim.core.podspec import spec_facts
from shim.core.quantity import AnnotationError, parse_cpu
from shim.core.reroute import Resources

GI = 1 << 30


def _pod(**spec) -> dict:
    return {"metadata": {"name": "infer", "namespace": "ml"}, "spec": spec}


POD = _pod(
    priorityClassName="batch",
    volumes=[{"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}}, {"name": "shared", "emptyDir": {}},
             {"name": "cfg", "configMap": {"name": "c"}}, {"name": "staged", "emptyDir": {"medium": "Memory"}}],
    initContainers=[{"name": "fetch", "volumeMounts": [{"name": "staged", "mountPath": "/in"}]}],
    containers=[
        {"name": "prep", "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}},
         "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}, {"name": "shared", "mountPath": "/out"},
                          {"name": "cfg", "mountPath": "/cfg"}]},
        {"name": "model", "volumeMounts": [{"name": "shared", "mountPath": "/in"},
                                           {"name": "staged", "mountPath": "/data"}]},
    ])


def test_an_empty_dir_only_this_container_mounts_can_follow_it_with_its_size_limit() -> None:
    facts = spec_facts(POD, "prep")
    assert facts.private_empty_dirs == {"scratch": GI}
    assert facts.shared_empty_dirs == ("shared",)
    assert facts.requests == Resources(0.5, 256 << 20) and not facts.init
    assert facts.priority_class == "batch"


def test_one_shared_with_an_init_container_counts_as_shared() -> None:
    facts = spec_facts(POD, "model")
    assert facts.private_empty_dirs == {} and set(facts.shared_empty_dirs) == {"shared", "staged"}
    assert facts.requests is None  # it declares none


def test_an_init_container_is_known_as_one() -> None:
    assert spec_facts(POD, "fetch").init


def test_a_container_the_pod_does_not_have_gives_nothing() -> None:
    assert spec_facts(POD, "sidecar") is None


@pytest.mark.parametrize(("text", "cores"), [("500m", 0.5), ("2", 2.0), ("0.25", 0.25), (" 1500m ", 1.5)])
def test_cpu_quantities(text: str, cores: float) -> None:
    assert parse_cpu("requests.cpu", text) == cores


@pytest.mark.parametrize("text", ["", "1Gi", "-1", "m"])
def test_a_bad_cpu_quantity_names_the_field(text: str) -> None:
    with pytest.raises(AnnotationError, match=r"requests\.cpu"):
        parse_cpu("requests.cpu", text)
