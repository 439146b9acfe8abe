"""Protobuf on the wire, by hand, and the hypothesis strategies that break it.

The protobuf runtime refuses to encode what the suites need to send (invalid
UTF-8 in a string, a field number no schema has), so messages are built from
the wire format here: a tag, then a varint or a length-delimited payload. A
map entry is a message with the key as field 1 and the value as field 2.

All suites share one profile: derandomized, no example database, no time
limit per example, so CI runs the same examples every time.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import Message
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

VARINT, I64, LEN, I32 = 0, 1, 2, 5


def fuzz_settings(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.large_base_example])


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint((number << 3) | wire_type)


def field_len(number: int, payload: bytes) -> bytes:
    return tag(number, LEN) + varint(len(payload)) + payload


def field_varint(number: int, value: int) -> bytes:
    return tag(number, VARINT) + varint(value)


def map_entry(number: int, key: bytes, value: bytes) -> bytes:
    return field_len(number, field_len(1, key) + field_len(2, value))


def number_of(message_type: type[Message], path: str) -> list[int]:
    """Field numbers along a dotted path of message fields (``config.annotations``)."""
    numbers, desc = [], message_type.DESCRIPTOR
    for name in path.split("."):
        f = desc.fields_by_name[name]
        numbers.append(f.number)
        desc = f.message_type
    return numbers


def nest(numbers: list[int], payload: bytes) -> bytes:
    """``payload`` (already one or more encoded fields) wrapped in the messages named by ``numbers``."""
    for n in reversed(numbers):
        payload = field_len(n, payload)
    return payload


# -- strategies -----------------------------------------------------------------------------
# Bytes that are not UTF-8: lone continuation bytes, overlongs, surrogates, truncated sequences.
INVALID_UTF8 = st.sampled_from([b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xe2\x82", b"\x80abc", b"ok\xfe"]).flatmap(
    lambda bad: st.tuples(st.binary(max_size=8), st.binary(max_size=8)).map(lambda t: t[0] + bad + t[1]))

# A field number no CRI or weft schema uses (protobuf allows up to 2**29 - 1), with any wire type.
UNKNOWN_FIELD = st.one_of(
    st.tuples(st.integers(1000, 2**29 - 1), st.integers(0, 2**64 - 1)).map(lambda t: field_varint(*t)),
    st.tuples(st.integers(1000, 2**29 - 1), st.binary(max_size=64)).map(lambda t: field_len(*t)),
    st.tuples(st.integers(1000, 2**29 - 1), st.binary(min_size=8, max_size=8)).map(lambda t: tag(t[0], I64) + t[1]),
    st.tuples(st.integers(1000, 2**29 - 1), st.binary(min_size=4, max_size=4)).map(lambda t: tag(t[0], I32) + t[1]),
)

# Sizes that stay under gRPC's 4 MiB default message limit, and one that goes over it.
HUGE = st.sampled_from([64 << 10, 1 << 20, 3 << 20, 5 << 20])


def mutate(valid: bytes) -> st.SearchStrategy[bytes]:
    """Small corruptions of a valid encoding: truncation, flipped bytes, inserted and dropped runs."""
    n = len(valid)
    truncate = st.integers(0, max(n - 1, 0)).map(lambda k: valid[:k])
    flip = st.lists(st.tuples(st.integers(0, max(n - 1, 0)), st.integers(1, 255)), min_size=1, max_size=4).map(
        lambda flips: _flipped(valid, flips))
    insert = st.tuples(st.integers(0, n), st.binary(min_size=1, max_size=16)).map(
        lambda t: valid[:t[0]] + t[1] + valid[t[0]:])
    drop = st.tuples(st.integers(0, n), st.integers(1, 16)).map(lambda t: valid[:t[0]] + valid[t[0] + t[1]:])
    return st.one_of(truncate, flip, insert, drop)


def _flipped(valid: bytes, flips: list[tuple[int, int]]) -> bytes:
    out = bytearray(valid)
    for at, x in flips:
        if out:
            out[at % len(out)] ^= x
    return bytes(out)


KINDS = ("random", "mutated", "unknown-fields", "invalid-utf8-map", "invalid-utf8-string", "huge-string",
         "huge-map-value")


class Raw:
    """Request bytes with a short repr: hypothesis prints failing examples, and some are megabytes."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __repr__(self) -> str:
        return f"Raw(len={len(self.data)}, head={self.data[:64]!r})"


def bad_inputs(valid: bytes, map_paths: list[list[int]], string_paths: list[list[int]],
               huge_paths: list[list[int]] | None = None) -> dict[str, st.SearchStrategy[Raw]]:
    """Request bytes by kind of badness, made from ``valid`` (a good request); ``map_paths`` lead to its
    string maps (labels, annotations) and ``string_paths`` to string fields, as field-number paths
    (``huge_paths``: the strings to make huge, ``string_paths`` unless given). A kind that needs a path
    the message lacks is left out."""
    huge_paths = string_paths if huge_paths is None else huge_paths
    kinds: dict[str, st.SearchStrategy[bytes]] = {
        "random": st.binary(max_size=512),
        "mutated": mutate(valid),
        "unknown-fields": st.lists(UNKNOWN_FIELD, min_size=1, max_size=4).map(lambda fs: valid + b"".join(fs)),
    }
    if map_paths:
        kinds["invalid-utf8-map"] = st.tuples(st.sampled_from(map_paths), INVALID_UTF8, INVALID_UTF8,
                                              st.booleans()).map(
            lambda t: valid + nest(t[0][:-1], map_entry(t[0][-1], t[1] if t[3] else b"weft.io/ok", t[2])))
        kinds["huge-map-value"] = st.tuples(st.sampled_from(map_paths), HUGE).map(
            lambda t: valid + nest(t[0][:-1], map_entry(t[0][-1], b"weft.io/big", b"v" * t[1])))
    if string_paths:
        kinds["invalid-utf8-string"] = st.tuples(st.sampled_from(string_paths), INVALID_UTF8).map(
            lambda t: valid + nest(t[0][:-1], field_len(t[0][-1], t[1])))
    if huge_paths:
        kinds["huge-string"] = st.tuples(st.sampled_from(huge_paths), HUGE).map(
            lambda t: valid + nest(t[0][:-1], field_len(t[0][-1], b"x" * t[1])))
    return {kind: strategy.map(Raw) for kind, strategy in kinds.items()}


def describe(kind: str, raw: bytes) -> dict[str, Any]:
    """What to print about an example that failed: the kind and a bounded view of the bytes."""
    return {"kind": kind, "size": len(raw), "head": raw[:96].hex()}
