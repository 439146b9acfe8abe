"""An upstream that records every call: the oracle for what containerd 1.6 cannot show.

criproxy and cri-tools test a proxy between a real client and an upstream that
records what it receives. The agent is pointed at this server (a real gRPC
server on a unix socket) for the parts of the contract the Debian containerd
cannot exercise: it does not implement ``GetContainerEvents`` (containerd 1.7
does), never sends rich status details, and knows no method newer than CRI v1.
Everything else is tested against the real containerd.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as cri

EVENTS = "/runtime.v1.RuntimeService/GetContainerEvents"
FUTURE_UNARY = "/runtime.v1.RuntimeService/FutureUnaryMethod"
FUTURE_BIDI = "/runtime.v1.RuntimeService/FutureBidiMethod"
FAILING = "/runtime.v1.RuntimeService/ContainerStatus"

# A google.rpc.Status (code 9, message "rich", one empty Any detail) encoded by hand,
# as containerd would put it in grpc-status-details-bin.
RICH_STATUS = bytes.fromhex("0809120472696368") + b"\x1a\x00"


@dataclass
class Recorded:
    method: str
    request: bytes
    metadata: dict[str, str | bytes]


@dataclass
class RecordingUpstream:
    socket: Path
    calls: list[Recorded] = field(default_factory=list)
    events: queue.Queue[bytes | None] = field(default_factory=queue.Queue)
    stream_ended: threading.Event = field(default_factory=threading.Event)
    stream_cancelled: threading.Event = field(default_factory=threading.Event)
    _server: grpc.Server | None = None

    def __enter__(self) -> RecordingUpstream:
        outer = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
                method = details.method  # type: ignore[attr-defined]
                if method == EVENTS:
                    return grpc.unary_stream_rpc_method_handler(lambda req, ctx: outer._events(req, ctx))
                if method == FUTURE_BIDI:
                    return grpc.stream_stream_rpc_method_handler(lambda reqs, ctx: outer._bidi(reqs, ctx))
                return grpc.unary_unary_rpc_method_handler(lambda req, ctx: outer._unary(method, req, ctx))

        self._server = grpc.server(ThreadPoolExecutor(8), handlers=[Handler()])
        self._server.add_insecure_port(f"unix:{self.socket}")
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.events.put(None)
        assert self._server is not None
        self._server.stop(0).wait()

    def _record(self, method: str, request: bytes, ctx: grpc.ServicerContext) -> None:
        self.calls.append(Recorded(method, request, dict(ctx.invocation_metadata())))

    def _unary(self, method: str, request: bytes, ctx: grpc.ServicerContext) -> bytes:
        self._record(method, request, ctx)
        if method == FAILING:
            ctx.set_trailing_metadata((("grpc-status-details-bin", RICH_STATUS), ("x-upstream", "trailer")))
            ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, "rich")
        ctx.send_initial_metadata((("x-upstream", "initial"),))
        ctx.set_trailing_metadata((("x-upstream", "trailer"),))
        return b"echo:" + request

    def _events(self, request: bytes, ctx: grpc.ServicerContext) -> Iterator[bytes]:
        self._record(EVENTS, request, ctx)
        ctx.add_callback(lambda: self.stream_cancelled.set() if not self.stream_ended.is_set() else None)
        while ctx.is_active():
            try:
                item = self.events.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:
                break
            yield item
        self.stream_ended.set()

    def _bidi(self, requests: Iterator[bytes], ctx: grpc.ServicerContext) -> Iterator[bytes]:
        self._record(FUTURE_BIDI, b"", ctx)
        for item in requests:
            yield item[::-1]


def container_event(container_id: str, kind: int) -> bytes:
    return cri.ContainerEventResponse(container_id=container_id, container_event_type=kind,
                                      created_at=1).SerializeToString()
