"""What the two sides ask of the node's containerd connection: its channel, and containerd's errors as weft's.

The proxy's ``shim.cri.passthrough.Upstream`` is one; the sides take this
instead so that neither imports the proxy.
"""

from __future__ import annotations

from typing import Protocol

import grpc

from shim.errors import UpstreamError


class Containerd(Protocol):
    # containerd's CRI socket as a grpcio channel (calls made with their own serializers).
    channel: grpc.Channel

    def translate(self, exc: grpc.RpcError) -> UpstreamError: ...
