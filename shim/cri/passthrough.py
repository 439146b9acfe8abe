"""The intercepted verbs' own connection to containerd: raw bytes over grpcio.

A verb weft intercepts (``routes``) is answered by weft, which usually asks
containerd itself: the request goes as ``bytes`` on a channel that registers
no serializer and the response comes back the same way, so a field newer than
our stubs survives. Metadata is forwarded, and containerd's status code,
details and trailing metadata come back as ``UpstreamError`` for the
instrumentation to hand on unchanged. Everything not intercepted never comes
here: the relay passes it through frame by frame.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from shim.cri.instrument import upstream_took
from shim.errors import UpstreamError, UpstreamUnavailable

# Keys a gRPC client library sets itself; forwarding them would be refused or
# would duplicate what our own channel sends.
_HOP_BY_HOP = frozenset({"user-agent", "te", "content-type", "grpc-accept-encoding", "grpc-encoding",
                         "grpc-timeout", "grpc-message-type", "authority"})

# Transport failures (no socket, refused, reset) as grpc core words them; an
# UNAVAILABLE that containerd itself returns passes unchanged.
_TRANSPORT_MARKERS = ("failed to connect", "Connection refused", "No such file or directory",
                      "Socket closed", "Connection reset", "connections to all backends failing",
                      "Broken pipe", "GOAWAY", "Transport closed", "Cancelling all calls")

UPSTREAM_OPTIONS: Sequence[tuple[str, Any]] = (
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    # Back on its feet within a second after containerd restarts; the default
    # exponential backoff can reach two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
)


def outgoing_metadata(md: Sequence[tuple[str, Any]] | None) -> list[tuple[str, Any]] | None:
    if not md:
        return None
    out = [(k, v) for k, v in md if k not in _HOP_BY_HOP and not k.startswith(":")]
    return out or None


def timeout_of(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    # grpc reports "no deadline" as a huge number of seconds.
    if remaining is None or remaining > 1e7:
        return None
    return max(remaining, 0.0)


class Within:
    """The context of a call weft makes of its own accord (no kubelet call behind it): a timeout, no metadata."""

    def __init__(self, seconds: float) -> None:
        self._deadline = time.monotonic() + seconds

    def time_remaining(self) -> float:
        return max(self._deadline - time.monotonic(), 0.0)

    def invocation_metadata(self) -> tuple:
        return ()

    def send_initial_metadata(self, md) -> None:
        pass

    def set_trailing_metadata(self, md) -> None:
        pass


class StreamCall:
    """containerd's messages of a server-streaming call, as they come.

    containerd's error (UNIMPLEMENTED from a release without the method, say)
    comes as ``UpstreamError`` when iteration reaches it; a cancelled call just
    ends.
    """

    def __init__(self, upstream: Upstream, call) -> None:
        self._upstream, self._call = upstream, call
        self.cancelled = False

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self._call
        except grpc.RpcError as exc:
            if self.cancelled or exc.code() is grpc.StatusCode.CANCELLED:  # type: ignore[attr-defined]
                return
            raise self._upstream.translate(exc) from None

    def cancel(self) -> None:
        self.cancelled = True
        self._call.cancel()


class Upstream:
    """A channel to containerd and the three ways of forwarding over it."""

    def __init__(self, socket: str) -> None:
        self.socket = socket
        self.channel = grpc.insecure_channel(f"unix://{socket}", options=UPSTREAM_OPTIONS)
        self._unary: dict[str, Callable[..., Any]] = {}

    def close(self) -> None:
        self.channel.close()

    def translate(self, exc: grpc.RpcError) -> UpstreamError:
        code = exc.code()  # type: ignore[attr-defined]
        details = exc.details() or ""  # type: ignore[attr-defined]
        if code is grpc.StatusCode.UNAVAILABLE and any(m in details for m in _TRANSPORT_MARKERS):
            return UpstreamUnavailable(self.socket, details)
        return UpstreamError(code, details, exc.trailing_metadata())  # type: ignore[attr-defined]

    def unary(self, path: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        call_fn = self._unary.get(path)
        if call_fn is None:
            call_fn = self._unary[path] = self.channel.unary_unary(path).with_call
        start = time.perf_counter()
        try:
            response, call = call_fn(
                request, timeout=timeout_of(context), metadata=outgoing_metadata(context.invocation_metadata())
            )
        except grpc.RpcError as exc:
            raise self.translate(exc) from None
        finally:
            upstream_took(time.perf_counter() - start)
        initial = call.initial_metadata()
        if initial:
            context.send_initial_metadata(initial)
        trailing = call.trailing_metadata()
        if trailing:
            context.set_trailing_metadata(trailing)
        return response

    def server_stream(self, path: str, request: bytes, context: grpc.ServicerContext) -> StreamCall:
        """A server-streaming call to containerd, cancelled with ``context`` (or ``cancel()``)."""
        call = self.channel.unary_stream(path)(
            request, timeout=timeout_of(context), metadata=outgoing_metadata(context.invocation_metadata()))
        if not context.add_callback(call.cancel):  # the client went away already
            call.cancel()
        return StreamCall(self, call)

    def unary_or_missing(self, path: str, request: bytes, context: grpc.ServicerContext) -> tuple[
            bytes, UpstreamError | None]:
        """Like ``unary``, but containerd's NOT_FOUND comes back as a value: removal verbs clean up
        weft's own records for an object containerd no longer has, then hand the same answer on."""
        try:
            return self.unary(path, request, context), None
        except UpstreamError as exc:
            if exc.code is not grpc.StatusCode.NOT_FOUND:
                raise
            return b"", exc
