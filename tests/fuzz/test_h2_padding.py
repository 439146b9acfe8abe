"""Padded HEADERS and DATA frames whose payload is empty or shorter than their padding (RFC 7540 6.1, 6.2):
a PROTOCOL_ERROR, refused as ``h2.ProtocolError`` (the relay then ends the connection with GOAWAY), never an
IndexError or a wrong slice."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shim.cri.relay import h2

FUZZ = settings(max_examples=500, deadline=None, derandomize=True, database=None)


@FUZZ
@given(ftype=st.sampled_from([h2.HEADERS, h2.CONTINUATION]), flags=st.integers(0, 255),
       payload=st.binary(max_size=64))
def test_header_fragments_of_any_frame_are_bytes_or_a_clear_error(ftype: int, flags: int, payload: bytes) -> None:
    try:
        fragment = h2.header_fragment(ftype, flags, payload)
    except h2.ProtocolError:
        return  # a clear refusal
    except (IndexError, struct.error) as exc:
        pytest.fail(f"header_fragment raised {exc!r} on {payload!r}")
    assert isinstance(fragment, bytes) and len(fragment) <= len(payload)




@FUZZ
@given(flags=st.integers(0, 255), payload=st.binary(max_size=64))
def test_data_payloads_are_bytes_or_a_clear_error(flags: int, payload: bytes) -> None:
    try:
        data = h2.data_payload(flags, payload)
    except h2.ProtocolError:
        assert flags & h2.FLAG_PADDED
        return
    assert isinstance(data, bytes) and len(data) <= len(payload)


def test_padding_longer_than_the_frame_is_refused() -> None:
    with pytest.raises(h2.ProtocolError):
        h2.header_fragment(h2.HEADERS, h2.FLAG_PADDED, b"")
    with pytest.raises(h2.ProtocolError):
        h2.header_fragment(h2.HEADERS, h2.FLAG_PADDED, bytes([9]) + b"abc")
    assert h2.header_fragment(h2.HEADERS, h2.FLAG_PADDED, bytes([1]) + b"ab") == b"a"
