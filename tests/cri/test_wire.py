"""Reading one field of a message protobuf refuses: the sandbox of a malformed CreateContainer."""

from __future__ import annotations

from cri_api.v1 import api_pb2 as cri
from hypothesis import given, settings
from hypothesis import strategies as st

from shim.cri.wire import string_field


def test_the_sandbox_id_of_a_request_with_invalid_utf8_elsewhere() -> None:
    valid = cri.CreateContainerRequest(pod_sandbox_id="sb-1", config=cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name="c"))).SerializeToString()
    # config (field 2) gains a label whose value is not UTF-8: protobuf refuses the whole message.
    bad_label = b"\x0a\x03bad\x12\x01\xff"
    label_entry = b"\x4a" + bytes([len(bad_label)]) + bad_label  # ContainerConfig.labels is field 9
    raw = valid + b"\x12" + bytes([len(label_entry)]) + label_entry
    assert string_field(raw, 1) == "sb-1"
    assert string_field(b"", 1) == ""
    assert string_field(b"\x0a\x05ab", 1) == ""  # truncated: nothing is made up


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.binary(max_size=200), st.integers(1, 20))
def test_any_bytes_give_a_string_never_an_exception(raw: bytes, number: int) -> None:
    assert isinstance(string_field(raw, number), str)
