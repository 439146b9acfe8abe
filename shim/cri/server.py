"""The CRI proxy's gRPC server on a unix socket.

One generic handler resolves every method path: an intercepted method gets
its handler from ``routes.INTERCEPTED``, any other path the raw-bytes
pass-through in the shape the CRI descriptors give it (or a bidirectional
stream for a method our stubs do not know). Both run inside the one
instrumentation wrapper.

The socket is created with mode 0600 (umask held while grpc binds it) and is
claimed first (``shim.unixsock.SocketClaim``), so a second agent on the same
path refuses instead of stealing a live socket.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from shim.cri import routes
from shim.cri.fabric import Fabric
from shim.cri.instrument import Instrument
from shim.cri.methods import KNOWN, Shape, lookup
from shim.cri.passthrough import Upstream
from shim.errors import WeftError
from shim.unixsock import SocketClaim

SERVER_OPTIONS = (
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.so_reuseport", 0),
)


class Router(grpc.GenericRpcHandler):
    """Method path -> instrumented handler; intercepted first, else pass-through."""

    def __init__(self, upstream: Upstream, instrument: Instrument,
                 intercepted: Mapping[str, Callable[..., object]]) -> None:
        self._upstream = upstream
        self._instrument = instrument
        self._intercepted = intercepted
        self._cache: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        path = handler_call_details.method  # type: ignore[attr-defined]
        handler = self._cache.get(path)
        if handler is None:
            handler = self._build(path)
            if path in KNOWN:  # unknown paths are not cached: a client could invent endless ones
                self._cache[path] = handler
        return handler

    def _build(self, path: str) -> grpc.RpcMethodHandler:
        method = lookup(path)
        up = self._upstream
        if path in self._intercepted:
            fn = self._intercepted[path]
            if method.shape is Shape.UNARY:
                return self._instrument.unary(method, "intercepted", fn)  # type: ignore[arg-type]
            return self._instrument.stream(method, "intercepted", fn)  # type: ignore[arg-type]
        if method.shape is Shape.UNARY:
            return self._instrument.unary(method, "passthrough", lambda req, ctx: up.unary(path, req, ctx))
        if method.shape is Shape.SERVER_STREAM:
            return self._instrument.stream(method, "passthrough", lambda req, ctx: up.server_stream(path, req, ctx))
        return self._instrument.stream(method, "passthrough", lambda reqs, ctx: up.stream_stream(path, reqs, ctx))


class CriServer:
    """The proxy server: claim the socket, bind it 0600, serve, stop cleanly."""

    def __init__(self, socket_path: Path, fabric: Fabric, instrument: Instrument, workers: int) -> None:
        self.socket_path = socket_path
        self.claim = SocketClaim(socket_path)
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weft-cri"),
            handlers=[Router(fabric.upstream, instrument, routes.intercepted(fabric))],
            options=SERVER_OPTIONS,
        )

    def start(self) -> None:
        self.claim.acquire()
        old_umask = os.umask(0o177)
        try:
            port = self._server.add_insecure_port(f"unix:{self.socket_path}")
        finally:
            os.umask(old_umask)
        if port == 0:
            self.claim.release()
            raise WeftError(f"could not bind the CRI socket {self.socket_path}")
        os.chmod(self.socket_path, 0o600)
        self.claim.bound()
        self._server.start()

    def stop(self, grace: float = 5.0) -> None:
        self._server.stop(grace).wait()
        self.claim.release()
