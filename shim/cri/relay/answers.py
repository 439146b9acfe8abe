"""weft's own answers on a kubelet connection: the frames of an intercepted call's response or error.

Header blocks weft writes never touch HPACK's dynamic table
(``h2.encode_headers``), so kubelet's decoder stays in step with
containerd's encoder, whose blocks pass through untouched (or, on a
connection where they could not, re-encoded the same way). An error before
any response HEADERS is a trailers-only response, as grpc-go sends one.
"""

from __future__ import annotations

import time

import grpc

from shim.cri.instrument import Outcome
from shim.cri.relay import h2

Headers = list[tuple[bytes, bytes]]


def deadline(headers: Headers) -> float | None:
    """The call's deadline on the monotonic clock, from its ``grpc-timeout`` header; None without one."""
    timeout = next((v for k, v in headers if k == b"grpc-timeout"), None)
    seconds = h2.parse_timeout(timeout) if timeout is not None else None
    return None if seconds is None else time.monotonic() + seconds


def request_of(body: bytes) -> bytes | None:
    """The one gRPC message of a unary request's body; None when it holds anything else."""
    messages = h2.split_grpc_messages(body)
    return messages[0] if messages is not None and len(messages) == 1 else None


def response_frames(sid: int, outcome: Outcome, initial: Headers, trailing: Headers,
                    max_frame: int) -> list[tuple[int, bytes]]:
    """(DATA length, frame) for each frame of a successful answer, in order; the last one ends the stream."""
    block = h2.encode_headers([(b":status", b"200"), (b"content-type", b"application/grpc"), *initial])
    out = [(0, h2.headers_frames(sid, block, end_stream=False, max_frame=max_frame))]
    body = h2.grpc_message(outcome.response or b"")
    for i in range(0, len(body), max_frame):
        chunk = body[i:i + max_frame]
        out.append((len(chunk), h2.frame(h2.DATA, 0, sid, chunk)))
    tblock = h2.encode_headers([(b"grpc-status", b"0"), *trailing])
    out.append((0, h2.headers_frames(sid, tblock, end_stream=True, max_frame=max_frame)))
    return out


def stream_headers(sid: int, initial: Headers, max_frame: int) -> bytes:
    """The response HEADERS of a streamed answer, sent before its first message."""
    block = h2.encode_headers([(b":status", b"200"), (b"content-type", b"application/grpc"), *initial])
    return h2.headers_frames(sid, block, end_stream=False, max_frame=max_frame)


def message_frames(sid: int, message: bytes, max_frame: int) -> list[tuple[int, bytes]]:
    """(DATA length, frame) for one message of a streamed answer."""
    body = h2.grpc_message(message)
    return [(len(body[i:i + max_frame]), h2.frame(h2.DATA, 0, sid, body[i:i + max_frame]))
            for i in range(0, len(body), max_frame)]


def stream_end_frames(sid: int, initial: Headers, trailing: Headers, *, responded: bool, max_frame: int) -> bytes:
    """The frames that end a streamed answer with OK: trailers, after the HEADERS if none went yet."""
    out = b"" if responded else stream_headers(sid, initial, max_frame)
    tblock = h2.encode_headers([(b"grpc-status", b"0"), *trailing])
    return out + h2.headers_frames(sid, tblock, end_stream=True, max_frame=max_frame)


def error_frames(sid: int, code: grpc.StatusCode, details: str, trailing: Headers, initial: Headers, *,
                 responded: bool, max_frame: int) -> bytes:
    """The frames that end a call with a status (trailers-only unless response HEADERS already went)."""
    fields = [(b"grpc-status", str(code.value[0]).encode()), (b"grpc-message", h2.percent_encode(details)),
              *trailing]
    if not responded:
        fields = [(b":status", b"200"), (b"content-type", b"application/grpc"), *initial, *fields]
    return h2.headers_frames(sid, h2.encode_headers(fields), end_stream=True, max_frame=max_frame)
