"""What every source of peers gives: ``Peer`` values, and the errors it may raise."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

from shim.errors import WeftError

DEFAULT_PORT = 7443
DEFAULT_PORT_NAME = "mesh"
# Set by the EndpointSlice controller on every slice it makes for a Service.
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


class DiscoveryError(WeftError):
    """Peers cannot be discovered until someone fixes something: the message says what.

    No Kubernetes configuration, no RBAC to read EndpointSlices, or a Service
    without the mesh port.
    """

    code = grpc.StatusCode.FAILED_PRECONDITION


class DiscoveryUnavailable(DiscoveryError):
    """The Kubernetes API did not answer, or answered with an error that may pass."""

    code = grpc.StatusCode.UNAVAILABLE


@dataclass(frozen=True)
class Peer:
    """Another weft agent: the node it runs on and where its mesh listens."""

    node: str
    address: str
    port: int
    ready: bool = True

    @property
    def target(self) -> str:
        """``host:port`` as gRPC dials it (IPv6 addresses bracketed)."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"


class Discovery(Protocol):
    """What the mesh needs from a source of peers."""

    def list(self) -> list[Peer]: ...

    def watch(self, on_change: Callable[[list[Peer]], None], stop: threading.Event) -> None: ...


