"""What an intercepted handler sees of its call: gRPC metadata and a servicer context, made from HTTP/2 headers.

weft's handlers are written against the part of ``grpc.ServicerContext``
they use, so the same handler serves a call the relay read off the wire.
"""

from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import Callable

import grpc

from shim.cri.instrument import Aborted

# Request headers that are transport, not metadata (grpc's own reserved names).
_RESERVED = frozenset({b"content-type", b"te", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding",
                       b"user-agent", b"grpc-message-type"})


class RelayContext:
    """The part of ``grpc.ServicerContext`` weft's intercepted handlers use."""

    def __init__(self, metadata: list[tuple[str, str | bytes]], deadline: float | None) -> None:
        self._metadata = tuple(metadata)
        self._deadline = deadline
        self._cancelled = False
        self._callbacks: list[Callable[[], None]] = []
        self.initial_metadata: tuple = ()
        self.trailing_metadata: tuple = ()

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def set_trailing_metadata(self, md) -> None:
        self.trailing_metadata = tuple(md)

    def send_initial_metadata(self, md) -> None:
        self.initial_metadata = tuple(md)

    def is_active(self) -> bool:
        return not self._cancelled

    def add_callback(self, cb: Callable[[], None]) -> bool:
        """As grpc's: False (and ``cb`` never called) once the call has ended, so the caller must check."""
        if self._cancelled:
            return False
        self._callbacks.append(cb)
        return True

    def cancel(self) -> None:
        if not self._cancelled:
            self._cancelled = True
            for cb in self._callbacks:
                with contextlib.suppress(Exception):
                    cb()


def metadata_of(headers: list[tuple[bytes, bytes]]) -> list[tuple[str, str | bytes]]:
    out: list[tuple[str, str | bytes]] = []
    for k, v in headers:
        if k.startswith(b":") or k in _RESERVED:
            continue
        key = k.decode("latin-1")
        if key.endswith("-bin"):
            out.append((key, base64.b64decode(v + b"=" * (-len(v) % 4))))
        else:
            out.append((key, v.decode("latin-1")))
    return out


def header_fields(md) -> list[tuple[bytes, bytes]]:
    out = []
    for k, v in md or ():
        if k.endswith("-bin"):
            raw = v if isinstance(v, bytes) else v.encode()
            out.append((k.encode(), base64.b64encode(raw).rstrip(b"=")))
        else:
            out.append((k.encode(), v.encode() if isinstance(v, str) else v))
    return out
