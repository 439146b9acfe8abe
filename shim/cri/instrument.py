"""The one wrapper every CRI handler runs in.

It times the call, records it by method, status code and kind
(``intercepted`` or ``passthrough``), writes the ``cri.call`` log event (info
for mutating verbs, debug for polling ones, warning for weft's own failures)
and turns weft's typed errors into gRPC statuses. Handlers never touch status
codes themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from shim import log
from shim.cri.methods import Method, Shape
from shim.errors import UpstreamError, UpstreamUnavailable, WeftError
from shim.metrics import Metrics

_log = log.get("weft.cri")

UnaryFn = Callable[[bytes, grpc.ServicerContext], bytes]
StreamFn = Callable[[Any, grpc.ServicerContext], Iterator[bytes]]


class Instrument:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        # Whether containerd answered last time; logged and exported on change
        # only, so a containerd restart is two log lines, not one per call.
        self.upstream_ok = True
        metrics.upstream_up.set(1)

    def _reached_upstream(self) -> None:
        if not self.upstream_ok:
            self.upstream_ok = True
            self.metrics.upstream_up.set(1)
            _log.info("upstream.recovered")

    def _abort(self, method: Method, kind: str, exc: WeftError, context: grpc.ServicerContext, start: float) -> None:
        code = exc.code
        elapsed = time.perf_counter() - start
        self.metrics.observe_cri(method.name, code.name, kind, elapsed)
        if isinstance(exc, UpstreamUnavailable):
            if self.upstream_ok:
                self.upstream_ok = False
                self.metrics.upstream_up.set(0)
                _log.warning("upstream.unavailable", method=method.name, socket=exc.socket, error=exc.message)
        elif isinstance(exc, UpstreamError):
            self._reached_upstream()
            # containerd's own answer (NotFound for an unknown ID and the like):
            # the client's business, logged like a success.
            (_log.debug if method.polling else _log.info)(
                "cri.call", method=method.name, kind=kind, code=code.name, ms=round(elapsed * 1e3, 3)
            )
        else:
            _log.warning("cri.failed", method=method.name, kind=kind, code=code.name, error=exc.message)
        if isinstance(exc, UpstreamError) and exc.trailing_metadata:
            context.set_trailing_metadata(exc.trailing_metadata)
        context.abort(code, exc.message)

    def unary(self, method: Method, kind: str, fn: UnaryFn) -> grpc.RpcMethodHandler:
        observe = self.metrics.observe_cri
        name = method.name
        logger = _log.debug if method.polling else _log.info

        def handler(request: bytes, context: grpc.ServicerContext) -> bytes:
            start = time.perf_counter()
            try:
                response = fn(request, context)
            except WeftError as exc:
                self._abort(method, kind, exc, context, start)
                raise  # unreachable: abort raises
            elapsed = time.perf_counter() - start
            if not self.upstream_ok:
                self._reached_upstream()
            observe(name, "OK", kind, elapsed)
            logger("cri.call", method=name, kind=kind, code="OK", ms=round(elapsed * 1e3, 3))
            return response

        return grpc.unary_unary_rpc_method_handler(handler)

    def stream(self, method: Method, kind: str, fn: StreamFn) -> grpc.RpcMethodHandler:
        gauge = self.metrics.cri_streams.labels(method.name)

        def handler(request: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
            start = time.perf_counter()
            gauge.inc()
            _log.debug("cri.stream.open", method=method.name, kind=kind)
            try:
                yield from fn(request, context)
            except WeftError as exc:
                self._abort(method, kind, exc, context, start)
            else:
                self.metrics.observe_cri(method.name, "OK", kind, time.perf_counter() - start)
            finally:
                gauge.dec()
                _log.debug("cri.stream.closed", method=method.name, kind=kind, active=context.is_active())

        if method.shape is Shape.SERVER_STREAM:
            return grpc.unary_stream_rpc_method_handler(handler)
        return grpc.stream_stream_rpc_method_handler(handler)
