"""The few pieces of HTTP/2 and gRPC framing the CRI relay needs, as pure functions.

The relay passes frames through verbatim, so it only has to find frame
boundaries, read SETTINGS and header blocks, and write a handful of frames of
its own: WINDOW_UPDATE, RST_STREAM, GOAWAY, and the HEADERS/DATA of answers
to intercepted calls. Header blocks weft writes use only the HPACK static
table and literals *without indexing*, so they never change the peer's
dynamic table: the peer's decoder stays in step with containerd's encoder,
whose blocks pass through untouched (RFC 7541 section 6.2.2).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from hpack import Decoder

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)

FLAG_END_STREAM = 0x1
FLAG_ACK = 0x1
FLAG_END_HEADERS = 0x4
FLAG_PADDED = 0x8
FLAG_PRIORITY = 0x20

SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5

ERROR_NO_ERROR = 0x0
ERROR_PROTOCOL = 0x1
ERROR_CANCEL = 0x8
ERROR_ENHANCE_YOUR_CALM = 0xB  # gRPC reads it as RESOURCE_EXHAUSTED

DEFAULT_WINDOW = 65535
DEFAULT_MAX_FRAME = 16384

_HEADER = struct.Struct(">HBBBI")  # 24-bit length split as 16 + 8 bits


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEADER.pack(n >> 8, n & 0xFF, ftype, flags, stream_id & 0x7FFFFFFF) + payload


def parse_header(buf: bytes | bytearray | memoryview, at: int) -> tuple[int, int, int, int]:
    """(payload length, type, flags, stream id) of the frame starting at ``at``."""
    hi, lo, ftype, flags, sid = _HEADER.unpack_from(buf, at)
    return (hi << 8) | lo, ftype, flags, sid & 0x7FFFFFFF


class ProtocolError(ValueError):
    """A frame that breaks RFC 7540 (e.g. padding longer than the frame): the connection ends with GOAWAY."""


def header_fragment(ftype: int, flags: int, payload: bytes) -> bytes:
    """The header block fragment of a HEADERS or CONTINUATION frame (padding and priority removed)."""
    if ftype == CONTINUATION:
        return payload
    start, end = 0, len(payload)
    if flags & FLAG_PADDED:
        if not payload:
            raise ProtocolError("padded HEADERS frame without a pad length")
        start, end = 1, end - payload[0]
    if flags & FLAG_PRIORITY:
        start += 5
    if start > end:  # RFC 7540 6.2: padding (and priority) longer than the frame is a PROTOCOL_ERROR
        raise ProtocolError(f"HEADERS frame of {len(payload)} bytes is shorter than its padding and priority")
    return payload[start:end]


def data_payload(flags: int, payload: bytes) -> bytes:
    if flags & FLAG_PADDED:
        if not payload or payload[0] >= len(payload):
            raise ProtocolError(f"DATA frame of {len(payload)} bytes is shorter than its padding")
        return payload[1:len(payload) - payload[0]]
    return payload


def parse_settings(payload: bytes) -> dict[int, int]:
    return {k: v for k, v in struct.iter_unpack(">HI", payload)}


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">I", increment & 0x7FFFFFFF))


def window_increment(payload: bytes) -> int:
    return struct.unpack(">I", payload)[0] & 0x7FFFFFFF


def rst_stream(stream_id: int, code: int = ERROR_CANCEL) -> bytes:
    return frame(RST_STREAM, 0, stream_id, struct.pack(">I", code))


def goaway(last_stream_id: int, code: int = ERROR_NO_ERROR, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, struct.pack(">II", last_stream_id & 0x7FFFFFFF, code) + debug)


def settings_ack() -> bytes:
    return frame(SETTINGS, FLAG_ACK, 0)


# -- HPACK, the stateless subset ------------------------------------------------
def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(raw: bytes) -> bytes:
    return _integer(len(raw), 7, 0x00) + raw  # no Huffman: cheaper, and always valid


def encode_headers(fields: Iterable[tuple[bytes, bytes]]) -> bytes:
    """A header block that never touches the dynamic table (literals without indexing)."""
    out = bytearray()
    for name, value in fields:
        if name == b":status" and value == b"200":
            out += b"\x88"  # static table entry 8
        else:
            out += b"\x00" + _string(name) + _string(value)
    return bytes(out)


def headers_frames(stream_id: int, block: bytes, *, end_stream: bool, max_frame: int) -> bytes:
    first, rest = block[:max_frame], block[max_frame:]
    flags = FLAG_END_STREAM if end_stream else 0
    if not rest:
        return frame(HEADERS, flags | FLAG_END_HEADERS, stream_id, first)
    out = [frame(HEADERS, flags, stream_id, first)]
    while rest:
        chunk, rest = rest[:max_frame], rest[max_frame:]
        out.append(frame(CONTINUATION, 0 if rest else FLAG_END_HEADERS, stream_id, chunk))
    return b"".join(out)


class CachingDecoder:
    """An HPACK decoder that remembers blocks which did not change its dynamic table.

    After the first calls, most header blocks a gRPC peer sends are only
    references into the tables (``:status 200``, ``grpc-status 0``, a known
    ``:path``); while the dynamic table stays as it was, the same bytes mean
    the same headers, so decoding them again is wasted work. Any block that
    changes the table empties the cache.
    """

    _MAX = 256

    def __init__(self) -> None:
        # grpc-go allows header lists up to 16 MiB; hpack's default (64 KiB) would tear down a connection
        # over one long grpc-message.
        self._decoder = Decoder(max_header_list_size=16 << 20)
        self._table = self._decoder.header_table
        self._cache: dict[bytes, list[tuple[bytes, bytes]]] = {}
        # Every insertion counts, even one equal to the entry before it: the
        # indices of everything behind it shift all the same.
        self._insertions = 0
        self.changed = False  # whether the last block decoded changed the dynamic table
        add = self._table.add

        def counting_add(name: bytes, value: bytes) -> object:
            self._insertions += 1
            return add(name, value)

        self._table.add = counting_add  # type: ignore[method-assign]

    @property
    def max_allowed_table_size(self) -> int:
        return self._decoder.max_allowed_table_size

    @max_allowed_table_size.setter
    def max_allowed_table_size(self, value: int) -> None:
        self._decoder.max_allowed_table_size = value

    def _signature(self) -> tuple[int, int, int]:
        return self._insertions, self._table.maxsize, len(self._table.dynamic_entries)

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        hit = self._cache.get(block)
        self.changed = False
        if hit is not None:
            return hit
        before = self._signature()
        headers = [(bytes(k), bytes(v)) for k, v in self._decoder.decode(block, raw=True)]
        if self._signature() != before:
            self.changed = True
            self._cache.clear()
        else:
            if len(self._cache) >= self._MAX:
                self._cache.clear()
            self._cache[block] = headers
        return headers


# -- gRPC on top ---------------------------------------------------------------------
def grpc_message(payload: bytes) -> bytes:
    """A length-prefixed, uncompressed gRPC message."""
    return b"\x00" + struct.pack(">I", len(payload)) + payload


def split_grpc_messages(body: bytes) -> list[bytes] | None:
    """The messages in a request body; None if it is truncated or compressed (not ours to read)."""
    out, at = [], 0
    while at < len(body):
        if len(body) - at < 5 or body[at] != 0:
            return None
        n = struct.unpack_from(">I", body, at + 1)[0]
        if len(body) - at - 5 < n:
            return None
        out.append(body[at + 5:at + 5 + n])
        at += 5 + n
    return out


def percent_encode(message: str) -> bytes:
    """grpc-message encoding: printable ASCII except '%' as is, everything else %XX of its UTF-8 bytes."""
    out = bytearray()
    for b in message.encode():
        if 0x20 <= b <= 0x7E and b != 0x25:
            out.append(b)
        else:
            out += f"%{b:02X}".encode()
    return bytes(out)


def percent_decode(raw: bytes) -> str:
    out, i = bytearray(), 0
    while i < len(raw):
        if raw[i] == 0x25 and i + 3 <= len(raw):
            try:
                out.append(int(raw[i + 1:i + 3], 16))
                i += 3
                continue
            except ValueError:
                pass
        out.append(raw[i])
        i += 1
    return out.decode(errors="replace")


_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def parse_timeout(value: bytes) -> float | None:
    """``grpc-timeout`` (e.g. ``2S``, ``100m``) in seconds; None if malformed."""
    unit = _TIMEOUT_UNITS.get(value[-1:])
    if unit is None or not value[:-1].isdigit():
        return None
    return int(value[:-1]) * unit
