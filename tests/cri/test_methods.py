"""Method shapes come from the CRI descriptors; unknown methods still get a shape."""

import pytest

from shim.cri.methods import KNOWN, Shape, lookup


@pytest.mark.parametrize(
    ("path", "shape", "polling"),
    [
        pytest.param("/runtime.v1.RuntimeService/Version", Shape.UNARY, True, id="version-polls"),
        pytest.param("/runtime.v1.RuntimeService/RunPodSandbox", Shape.UNARY, False, id="run-mutates"),
        pytest.param("/runtime.v1.RuntimeService/ListContainers", Shape.UNARY, True, id="list-polls"),
        pytest.param("/runtime.v1.RuntimeService/GetContainerEvents", Shape.SERVER_STREAM, False, id="events-stream"),
        pytest.param("/runtime.v1.ImageService/PullImage", Shape.UNARY, False, id="pull-mutates"),
    ],
)
def test_known_methods(path: str, shape: Shape, polling: bool) -> None:
    m = lookup(path)
    assert (m.shape, m.polling) == (shape, polling)


def test_every_runtime_and_image_method_is_known() -> None:
    names = {m.name for m in KNOWN.values()}
    assert {"Version", "RunPodSandbox", "CreateContainer", "ExecSync", "ListImages", "ImageFsInfo"} <= names
    assert all(p.startswith(("/runtime.v1.RuntimeService/", "/runtime.v1.ImageService/", "/weft.agent.v1.Admin/"))
               for p in KNOWN)


@pytest.mark.parametrize(
    ("path", "label"),
    [
        pytest.param("/runtime.v1.RuntimeService/FutureMethod", "FutureMethod", id="newer-cri-method"),
        pytest.param("/runtime.v1alpha2.RuntimeService/Version", "other", id="old-api-version"),
        pytest.param("/made.up/Path", "other", id="invented-path-bounded-label"),
    ],
)
def test_unknown_methods_are_forwarded_as_streams(path: str, label: str) -> None:
    m = lookup(path)
    assert m.shape is Shape.ANY and m.name == label
