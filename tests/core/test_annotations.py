"""HOST:PORT parsing shared by the config loader and the HTTP endpoint."""

import pytest

from shim.core.annotations import parse_host_port


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param("127.0.0.1:9464", ("127.0.0.1", 9464), id="ipv4"),
        pytest.param("[::1]:80", ("::1", 80), id="ipv6-bracketed"),
        pytest.param("localhost:0", ("localhost", 0), id="port-zero-picks-free"),
    ],
)
def test_valid(value: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(value, field="f") == expected


@pytest.mark.parametrize(
    ("value", "words"),
    [
        pytest.param("9464", "expected HOST:PORT", id="no-colon"),
        pytest.param(":9464", "expected HOST:PORT", id="no-host"),
        pytest.param("h:http", "not a number", id="named-port"),
        pytest.param("h:70000", "out of range", id="port-too-big"),
    ],
)
def test_invalid_names_field_and_value(value: str, words: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_host_port(value, field="agent.metrics_address")
    assert "agent.metrics_address" in str(err.value) and words in str(err.value) and value in str(err.value)
