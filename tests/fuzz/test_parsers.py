"""Pure parsers fed anything: they answer or refuse with their own error, and round-trip what they print.

``shim.core.quantity`` (the GPU share annotations a person types),
``shim.core.annotations`` (HOST:PORT in the config) and the relay's pure
HTTP/2 and gRPC helpers (``shim.cri.relay.h2``), which read bytes a client sends.
"""

from __future__ import annotations

import contextlib

from hypothesis import given, settings
from hypothesis import strategies as st

from shim.core.annotations import parse_host_port
from shim.core.quantity import AnnotationError, format_bytes, parse_compute, parse_memory
from shim.cri.relay import h2

FUZZ = settings(max_examples=500, deadline=None, derandomize=True, database=None)
ANN = "weft.io/gpu-memory.model"
QUANTITY_CHARS = st.text(alphabet="0123456789.+-eEkKMGTPimn% \n\t", max_size=30)


@FUZZ
@given(value=st.one_of(st.text(max_size=80), QUANTITY_CHARS))
def test_memory_is_positive_bytes_or_an_error_naming_annotation_and_value(value: str) -> None:
    try:
        size = parse_memory(ANN, value, max_bytes=80 << 30)
    except AnnotationError as exc:
        assert str(exc).startswith(f"{ANN}: ") and exc.value == value
        return
    assert 1 <= size <= 80 << 30


@FUZZ
@given(value=st.one_of(st.text(max_size=40), st.text(alphabet="0123456789%+-. ", max_size=8)))
def test_compute_is_a_whole_percent_or_an_error_naming_the_annotation(value: str) -> None:
    try:
        percent = parse_compute("weft.io/gpu-compute.model", value)
    except AnnotationError as exc:
        assert "weft.io/gpu-compute.model" in str(exc)
        return
    assert 1 <= percent <= 100


@FUZZ
@given(n=st.integers(1, 2**62), unit=st.sampled_from(["Ki", "Mi", "Gi", "Ti"]))
def test_a_whole_binary_quantity_parses_to_exactly_its_bytes(n: int, unit: str) -> None:
    multiplier = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[unit]
    text = f"{n}{unit}"
    if len(text) > 64:
        return
    assert parse_memory(ANN, text) == n * multiplier


@FUZZ
@given(n=st.integers(-(2**70), 2**70))
def test_format_bytes_never_fails(n: int) -> None:
    assert format_bytes(n)


@FUZZ
@given(value=st.text(max_size=40))
def test_host_port_is_parsed_or_refused_naming_the_field(value: str) -> None:
    try:
        host, port = parse_host_port(value, field="mesh.address")
    except ValueError as exc:
        assert str(exc).startswith("mesh.address: ")
        return
    assert host and 0 <= port <= 65535


@FUZZ
@given(body=st.binary(max_size=64))
def test_grpc_body_splitting_never_reads_past_the_end(body: bytes) -> None:
    messages = h2.split_grpc_messages(body)
    if messages is not None:
        assert b"".join(h2.grpc_message(m) for m in messages) == body


@FUZZ
@given(messages=st.lists(st.binary(max_size=40), max_size=5))
def test_grpc_messages_round_trip(messages: list[bytes]) -> None:
    assert h2.split_grpc_messages(b"".join(h2.grpc_message(m) for m in messages)) == messages


@FUZZ
@given(message=st.text(max_size=60))
def test_grpc_message_percent_encoding_round_trips(message: str) -> None:
    encoded = h2.percent_encode(message)
    assert all(0x20 <= b <= 0x7E for b in encoded)
    assert h2.percent_decode(encoded) == message.encode(errors="replace").decode(errors="replace")


@FUZZ
@given(raw=st.binary(max_size=40))
def test_percent_decoding_takes_any_bytes(raw: bytes) -> None:
    assert isinstance(h2.percent_decode(raw), str)


@FUZZ
@given(value=st.binary(max_size=12))
def test_grpc_timeout_is_seconds_or_none(value: bytes) -> None:
    seconds = h2.parse_timeout(value)
    assert seconds is None or seconds >= 0


@FUZZ
@given(block=st.binary(max_size=64))
def test_hpack_decoding_of_garbage_raises_only_hpack_errors(block: bytes) -> None:
    import hpack

    with contextlib.suppress(hpack.HPACKError):
        h2.CachingDecoder().decode(block)
