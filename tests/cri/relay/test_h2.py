"""The relay's HTTP/2 and HPACK helpers: framing, stateless encoding, the caching decoder."""

import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shim.cri.relay import h2

_NAMES = [b":path", b"grpc-timeout", b"content-type", b"x-request-id", b"grpc-status", b"grpc-message"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from(_NAMES), st.sampled_from([b"a", b"b", b"1999u", b"0", b""])),
                         min_size=1, max_size=6), min_size=1, max_size=30),
       st.sampled_from([0, 64, 256, 4096]))
def test_caching_decoder_agrees_with_a_plain_decoder(blocks, table_size) -> None:
    # Same blocks, same answers: repeats hit the cache only while the table is unchanged.
    enc = hpack.Encoder()
    enc.header_table_size = table_size
    plain, cached = hpack.Decoder(), h2.CachingDecoder()
    for headers in blocks + blocks:  # the second pass repeats every block
        block = enc.encode(headers)
        want = [(bytes(k), bytes(v)) for k, v in plain.decode(block, raw=True)]
        assert cached.decode(block) == want


def test_stateless_blocks_leave_the_peer_table_alone() -> None:
    dec = hpack.Decoder()
    block = h2.encode_headers([(b":status", b"200"), (b"grpc-status", b"5"), (b"grpc-message", b"not found")])
    assert dec.decode(block, raw=True) == [(b":status", b"200"), (b"grpc-status", b"5"),
                                           (b"grpc-message", b"not found")]
    assert len(dec.header_table.dynamic_entries) == 0


@pytest.mark.parametrize(
    ("block_size", "max_frame", "frames"),
    [pytest.param(10, 16384, 1, id="fits-one-frame"), pytest.param(40000, 16384, 3, id="continuations")],
)
def test_large_header_blocks_are_split_into_continuations(block_size, max_frame, frames) -> None:
    raw = h2.headers_frames(3, b"x" * block_size, end_stream=True, max_frame=max_frame)
    at, seen, types = 0, 0, []
    while at < len(raw):
        length, ftype, flags, sid = h2.parse_header(raw, at)
        assert sid == 3 and length <= max_frame
        types.append((ftype, flags))
        at += 9 + length
        seen += 1
    assert seen == frames
    assert types[0][0] == h2.HEADERS and types[0][1] & h2.FLAG_END_STREAM
    assert types[-1][1] & h2.FLAG_END_HEADERS
    assert all(t == h2.CONTINUATION for t, _ in types[1:])


@pytest.mark.parametrize(
    ("message", "encoded"),
    [pytest.param("plain text", b"plain text", id="ascii-as-is"),
     pytest.param("100% sure", b"100%25 sure", id="percent-escaped"),
     pytest.param("naïve\n", b"na%C3%AFve%0A", id="utf8-and-controls")],
)
def test_grpc_message_percent_encoding_round_trips(message, encoded) -> None:
    assert h2.percent_encode(message) == encoded
    assert h2.percent_decode(encoded) == message


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(b"2S", 2.0), (b"100m", 0.1), (b"5M", 300.0), (b"7", None), (b"xS", None)],
    ids=["seconds", "millis", "minutes", "no-unit", "not-a-number"],
)
def test_grpc_timeout(value, seconds) -> None:
    assert h2.parse_timeout(value) == (pytest.approx(seconds) if seconds is not None else None)


def test_grpc_messages_split_and_refuse_truncated_or_compressed() -> None:
    body = h2.grpc_message(b"one") + h2.grpc_message(b"two")
    assert h2.split_grpc_messages(body) == [b"one", b"two"]
    assert h2.split_grpc_messages(body[:-1]) is None
    assert h2.split_grpc_messages(b"\x01" + body[1:]) is None


def test_cache_is_dropped_when_an_insertion_repeats_the_newest_entry() -> None:
    # Table room for two entries (32 + 2 bytes each). Re-inserting the newest entry's
    # exact value evicts the oldest: same length, same first entry, other indices.
    def insert(name: bytes, value: bytes) -> bytes:  # literal with incremental indexing, new name
        return b"\x40" + bytes([len(name)]) + name + bytes([len(value)]) + value

    cached, plain = h2.CachingDecoder(), hpack.Decoder()
    for dec in (cached, plain):
        dec.max_allowed_table_size = 68
    resize = b"\x3f\x25"  # dynamic table size update to 68
    second = b"\xbf"  # indexed: dynamic entry 2 (static table has 61)
    for block in (resize + insert(b"a", b"1"), insert(b"b", b"2"), second, insert(b"b", b"2"), second):
        assert cached.decode(block) == [(bytes(k), bytes(v)) for k, v in plain.decode(block, raw=True)]
