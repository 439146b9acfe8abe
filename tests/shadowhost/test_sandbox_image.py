"""The pause image an agent started by hand gives reservation pods: containerd's own, as its Status says."""

from __future__ import annotations

import json
from concurrent import futures

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from shim.shadowhost.sandbox_image import FALLBACK, SandboxImage, from_status


class _Runtime(cri_grpc.RuntimeServiceServicer):
    def __init__(self) -> None:
        self.info: dict[str, str] = {}
        self.fail = False
        self.calls = 0

    def Status(self, request, context):  # noqa: N802 (the CRI's name)
        self.calls += 1
        if self.fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "containerd is restarting")
        assert request.verbose, "only a verbose Status carries the configuration"
        return cri.StatusResponse(info=self.info)


@pytest.fixture
def runtime(tmp_path):
    servicer = _Runtime()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    cri_grpc.add_RuntimeServiceServicer_to_server(servicer, server)
    sock = f"unix://{tmp_path}/containerd.sock"
    server.add_insecure_port(sock)
    server.start()
    with grpc.insecure_channel(sock) as channel:
        yield servicer, channel
    server.stop(0)


def test_containerd_s_own_sandbox_image_is_asked_once(runtime) -> None:
    servicer, channel = runtime
    servicer.info = {"config": json.dumps({"sandboxImage": "mirror.example:5000/pause:3.9", "cni": {}})}
    image = SandboxImage(channel)
    assert image() == "mirror.example:5000/pause:3.9"
    assert image() == "mirror.example:5000/pause:3.9"
    assert servicer.calls == 1


def test_a_configured_image_is_never_asked_for(runtime) -> None:
    servicer, channel = runtime
    assert SandboxImage(channel, "local/pause:1")() == "local/pause:1"
    assert servicer.calls == 0


def test_containerd_away_gives_the_fallback_for_now_and_is_asked_again(runtime) -> None:
    servicer, channel = runtime
    servicer.fail = True
    image = SandboxImage(channel)
    assert image() == FALLBACK
    servicer.fail = False
    servicer.info = {"config": json.dumps({"sandboxImage": "registry.k8s.io/pause:3.6"})}
    assert image() == "registry.k8s.io/pause:3.6"


@pytest.mark.parametrize(("info", "want"), [
    ({"config": json.dumps({"sandboxImage": "a/pause:1"})}, "a/pause:1"),
    ({"config": json.dumps({"pinnedImages": {"sandbox": "b/pause:2"}})}, "b/pause:2"),
    ({"config": json.dumps({"sandboxImage": ""})}, None),
    ({"config": "not json"}, None),
    ({}, None),
])
def test_the_image_is_read_from_what_each_release_reports(info: dict[str, str], want: str | None) -> None:
    assert from_status(info) == want


def test_where_the_status_names_none_containerd_s_files_say_it(runtime) -> None:
    """containerd 2.x's verbose Status carries no image configuration: the agent reads containerd's files."""
    servicer, channel = runtime
    servicer.info = {"config": json.dumps({"containerd": {}, "cni": {}})}
    asked = []

    def from_host() -> str | None:
        asked.append(1)
        return "mirror.example:5000/pause:3.10.2"

    image = SandboxImage(channel, from_host=from_host)
    assert image() == image() == "mirror.example:5000/pause:3.10.2"
    assert (servicer.calls, len(asked)) == (1, 1)
    assert SandboxImage(channel, from_host=lambda: None)() == FALLBACK  # neither can tell: containerd's default
