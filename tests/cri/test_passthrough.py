"""Metadata filtering and error translation of the raw-bytes pass-through."""

import grpc
import pytest

from shim.cri.passthrough import Upstream, outgoing_metadata
from shim.errors import UpstreamError, UpstreamUnavailable


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details, trailing=()):
        self._c, self._d, self._t = code, details, trailing

    def code(self):
        return self._c

    def details(self):
        return self._d

    def trailing_metadata(self):
        return self._t


def test_hop_by_hop_metadata_is_dropped_and_the_rest_kept() -> None:
    md = [("user-agent", "kubelet"), (":authority", "x"), ("x-request-id", "42"), ("trace-bin", b"\x01")]
    assert outgoing_metadata(md) == [("x-request-id", "42"), ("trace-bin", b"\x01")]
    assert outgoing_metadata([("user-agent", "k")]) is None
    assert outgoing_metadata(None) is None


@pytest.fixture
def upstream():
    up = Upstream("/run/containerd/containerd.sock")
    yield up
    up.close()


def test_transport_failure_names_the_socket(upstream) -> None:
    err = upstream.translate(FakeRpcError(
        grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: No such file"))
    assert isinstance(err, UpstreamUnavailable)
    assert err.code is grpc.StatusCode.UNAVAILABLE
    assert "/run/containerd/containerd.sock" in err.message


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE],
    ids=["not-found", "invalid-argument", "containerd-own-unavailable"],
)
def test_containerd_status_passes_unchanged(upstream, code) -> None:
    trailing = (("grpc-status-details-bin", b"\x08\x05"),)
    err = upstream.translate(FakeRpcError(code, "containerd said so", trailing))
    assert type(err) is UpstreamError
    assert (err.code, err.message, err.trailing_metadata) == (code, "containerd said so", trailing)
