"""The one place every CRI call is measured, logged and given its status.

Pass-through calls are recorded when the relay sees containerd's final status;
intercepted calls run their handler here, and weft's typed errors become
gRPC statuses here and nowhere else. Every call is counted and timed by
method, status code and kind (``intercepted`` or ``passthrough``), and logged
as ``cri.call`` (info for mutating verbs, debug for polling ones) with the
container or sandbox the call is about (read off the request's first field)
and, where weft knows it, the pod. An intercepted call also records how much
of its time was containerd's (``upstream_ms``, and
``weft_cri_upstream_duration_seconds``), so weft's own share is the rest.
containerd becoming unreachable, and reachable again, is logged once per
change (``upstream.unavailable``/``upstream.recovered``), not once per call.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from shim import log
from shim.cri.methods import Method
from shim.cri.wire import string_field
from shim.errors import UpstreamError, UpstreamUnavailable, WeftError
from shim.metrics import Metrics

_log = log.get("weft.cri")


class Aborted(Exception):
    """A handler called ``context.abort``: the call ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


@dataclass(frozen=True)
class Outcome:
    code: grpc.StatusCode
    details: str
    response: bytes | None
    trailing_metadata: tuple = ()


@dataclass
class CallNote:
    """What the call being served is about, and containerd's share of its time, for its ``cri.call`` line."""

    ids: dict[str, str]
    pod: str = ""
    namespace: str = ""
    upstream_s: float = 0.0


_CALL: contextvars.ContextVar[CallNote | None] = contextvars.ContextVar("weft_cri_call", default=None)


def note_pod(name: str, namespace: str) -> None:
    """The pod the intercepted call being served is about (a verb that knows it says so)."""
    call = _CALL.get()
    if call is not None:
        call.pod, call.namespace = name, namespace


def upstream_took(seconds: float) -> None:
    """An intercepted call waited this long on containerd (``passthrough.Upstream`` reports each call)."""
    call = _CALL.get()
    if call is not None:
        call.upstream_s += seconds


def ids_of(method: Method, body: bytes) -> dict[str, str]:
    """``{"container_id": ...}`` or ``{"pod_sandbox_id": ...}`` from a request body (or its start), if it has one."""
    if not method.id_field:
        return {}
    value = string_field(body, 1)
    return {method.id_field: value} if value else {}


class Instrument:
    def __init__(self, metrics: Metrics, pod_of: Callable[[str, str], tuple[str, str] | None] | None = None) -> None:
        self.metrics = metrics
        # (id field, id) -> (pod, namespace) for what this node keeps in memory; None where it knows nothing.
        self.pod_of = pod_of
        self._lock = threading.Lock()
        self.upstream_ok = True
        metrics.upstream_up.set(1)

    # -- containerd reachability ---------------------------------------------------
    def upstream_reached(self) -> None:
        if not self.upstream_ok:
            with self._lock:
                if not self.upstream_ok:
                    self.upstream_ok = True
                    self.metrics.upstream_up.set(1)
                    _log.info("upstream.recovered")

    def upstream_unavailable(self, socket: str, reason: str) -> None:
        if self.upstream_ok:
            with self._lock:
                if self.upstream_ok:
                    self.upstream_ok = False
                    self.metrics.upstream_up.set(0)
                    _log.warning("upstream.unavailable", socket=socket, error=reason)

    # -- calls ---------------------------------------------------------------------
    def passthrough(self, method: Method, code: grpc.StatusCode, details: str, seconds: float,
                    ids: dict[str, str] | None = None) -> None:
        self.metrics.observe_cri(method.name, code.name, "passthrough", seconds)
        if code is not grpc.StatusCode.UNAVAILABLE or not details.startswith("weft:"):
            self.upstream_reached()
        (_log.debug if method.polling else _log.info)(
            "cri.call", method=method.name, kind="passthrough", code=code.name, ms=round(seconds * 1e3, 3),
            **(ids or {}))

    def intercepted(self, method: Method, fn: Callable[[bytes, Any], bytes], request: bytes | None,
                    context: Any) -> Outcome:
        start = time.perf_counter()
        call = CallNote(ids_of(method, request) if request else {})
        token = _CALL.set(call)
        if request is None:
            outcome = Outcome(grpc.StatusCode.INTERNAL, f"weft: malformed gRPC request body for {method.name}", None)
        else:
            try:
                outcome = Outcome(grpc.StatusCode.OK, "", fn(request, context), context.trailing_metadata)
            except Aborted as exc:
                outcome = Outcome(exc.code, exc.details, None, context.trailing_metadata)
            except UpstreamUnavailable as exc:
                self.upstream_unavailable(exc.socket, exc.message)
                outcome = Outcome(exc.code, exc.message, None)
            except UpstreamError as exc:  # containerd's own answer, unchanged
                self.upstream_reached()
                outcome = Outcome(exc.code, exc.message, None, exc.trailing_metadata)
            except WeftError as exc:
                _log.warning("cri.failed", method=method.name, code=exc.code.name, error=exc.message)
                outcome = Outcome(exc.code, exc.message, None)
            except Exception as exc:  # noqa: BLE001 - a bug: the client gets a clear INTERNAL, the log its traceback
                _log.exception("cri.crashed", method=method.name)
                outcome = Outcome(grpc.StatusCode.INTERNAL, f"weft: internal error in {method.name}: {exc!r}", None)
        _CALL.reset(token)
        elapsed = time.perf_counter() - start
        self.metrics.observe_cri(method.name, outcome.code.name, "intercepted", elapsed)
        self.metrics.observe_cri_upstream(method.name, outcome.code.name, call.upstream_s)
        if not call.pod and call.ids and self.pod_of is not None:
            field, value = next(iter(call.ids.items()))
            call.pod, call.namespace = self.pod_of(field, value) or ("", "")
        pod = {"pod": call.pod, "namespace": call.namespace} if call.pod else {}
        (_log.debug if method.polling else _log.info)(
            "cri.call", method=method.name, kind="intercepted", code=outcome.code.name, ms=round(elapsed * 1e3, 3),
            upstream_ms=round(call.upstream_s * 1e3, 3), **call.ids, **pod)
        return outcome

    def stream_opened(self, method: Method) -> None:
        self.metrics.cri_streams.labels(method.name).inc()

    def stream_closed(self, method: Method) -> None:
        self.metrics.cri_streams.labels(method.name).dec()
