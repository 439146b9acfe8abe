"""PullImage: on a node with a mesh, the image kubelet pulled is remembered with its credentials for a host's pull.

The request goes to containerd unchanged and its answer comes back unchanged;
only an answered pull is remembered, by name and by the ID containerd gave.
"""

from __future__ import annotations

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri

from shim.cri.verbs import pull_image
from shim.errors import UpstreamError
from shim.origin.context import Origin
from tests.cri.verbs.fakes import FakeMesh, ctx

IMAGE = "registry.example/team/tokenizer:v3"
REF = "sha256:" + "9f" * 32
AUTH = cri.AuthConfig(username="robot", password="s3cret", server_address="registry.example")


def body(auth: cri.AuthConfig | None = AUTH) -> bytes:
    req = cri.PullImageRequest(image=cri.ImageSpec(image=IMAGE))
    if auth is not None:
        req.auth.CopyFrom(auth)
    return req.SerializeToString()


@pytest.fixture
def route(fabric, containerd):
    containerd.answer("PullImage", cri.PullImageResponse(image_ref=REF))
    return pull_image.route(fabric)


def test_intercepted_only_on_a_node_with_a_mesh(fabric, route) -> None:
    assert not route.applies()
    fabric.origin = Origin(FakeMesh())
    assert route.applies()


def test_the_pull_is_containerds_unchanged_and_the_image_remembered_with_its_credentials(fabric, containerd, mesh,
                                                                                         route) -> None:
    answer = route.handle(body(), ctx())
    assert containerd.only_request("PullImage") == body()
    assert cri.PullImageResponse.FromString(answer).image_ref == REF
    assert fabric.origin.images.lookup(REF) == (IMAGE, AUTH), "CreateContainer names the image by containerd's ID"
    assert fabric.origin.images.lookup(IMAGE) == (IMAGE, AUTH)


def test_a_pull_without_credentials_is_remembered_without_them(fabric, mesh, route) -> None:
    route.handle(body(auth=None), ctx())
    assert fabric.origin.images.lookup(REF) == (IMAGE, None)


def test_a_failed_pull_is_handed_on_and_nothing_remembered(fabric, containerd, mesh, route) -> None:
    containerd.refuse("PullImage", grpc.StatusCode.NOT_FOUND, "manifest unknown")
    with pytest.raises(UpstreamError) as err:
        route.handle(body(), ctx())
    assert (err.value.code, err.value.message) == (grpc.StatusCode.NOT_FOUND, "manifest unknown")
    assert fabric.origin.images.lookup(IMAGE) is None and fabric.origin.images.lookup(REF) is None


def test_a_request_that_does_not_parse_is_containerds_and_nothing_is_remembered(fabric, containerd, mesh,
                                                                               route) -> None:
    garbage = b"\x0a\x04\x0a\x02\xff\xfe"
    route.handle(garbage, ctx())
    assert containerd.only_request("PullImage") == garbage
    assert fabric.origin.images.lookup(REF) is None
