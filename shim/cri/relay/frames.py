"""Reading HTTP/2 off a byte stream: whole frames out of a buffer, header blocks out of their frames.

The relay forwards frames as they came, so both keep the raw bytes beside
what they parsed.
"""

from __future__ import annotations

from shim.cri.relay import h2

Frame = tuple[int, int, int, bytes]  # type, flags, stream id, the whole frame as it came (header included)


def take_frames(buf: bytearray) -> list[Frame]:
    """The whole frames at the start of ``buf``, removed from it; a partial frame stays for the next read."""
    at, out = 0, []
    while len(buf) - at >= 9:
        length, ftype, flags, sid = h2.parse_header(buf, at)
        end = at + 9 + length
        if end > len(buf):
            break
        out.append((ftype, flags, sid, bytes(buf[at:end])))
        at = end
    del buf[:at]
    return out


class HeaderBlocks:
    """A HEADERS frame and its CONTINUATIONs gathered into one header block (RFC 7540 4.3)."""

    def __init__(self) -> None:
        self._open: tuple[int, int, list[bytes], list[bytes]] | None = None  # sid, flags, raw frames, fragments

    def add(self, ftype: int, flags: int, sid: int, raw: bytes) -> tuple[int, int, bytes, bytes] | None:
        """Take one HEADERS or CONTINUATION frame; once the block is whole: (stream id, the HEADERS frame's
        flags, every raw frame, the block)."""
        payload = raw[9:]
        if ftype == h2.HEADERS:
            self._open = (sid, flags, [raw], [h2.header_fragment(ftype, flags, payload)])
        elif self._open is not None:
            self._open[2].append(raw)
            self._open[3].append(payload)
        if flags & h2.FLAG_END_HEADERS and self._open is not None:
            hsid, hflags, raws, fragments = self._open
            self._open = None
            return hsid, hflags, b"".join(raws), b"".join(fragments)
        return None
