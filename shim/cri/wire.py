"""Reading one field of a protobuf message that does not parse as a whole (pure).

protobuf refuses a message with, say, invalid UTF-8 anywhere in it, while
containerd (gogo protobuf) accepts it. To decide what such a request is about
(which sandbox), weft reads the one top-level field it needs by hand.
"""

from __future__ import annotations


def _varint(buf: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[at]
        at += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, at
        shift += 7


def string_field(buf: bytes, number: int) -> str:
    """The last top-level length-delimited field ``number``, decoded leniently; "" if absent or unreadable."""
    found = ""
    at = 0
    try:
        while at < len(buf):
            key, at = _varint(buf, at)
            field, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, at = _varint(buf, at)
            elif wire_type == 1:
                at += 8
            elif wire_type == 5:
                at += 4
            elif wire_type == 2:
                length, at = _varint(buf, at)
                if at + length > len(buf):
                    return found
                if field == number:
                    found = buf[at:at + length].decode(errors="replace")
                at += length
            else:
                return found
    except ValueError:
        return found
    return found
