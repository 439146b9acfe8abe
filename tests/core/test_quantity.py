"""The GPU-share annotations: what they accept, what they refuse, and how the refusal reads."""

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shim.core.quantity import AnnotationError, format_bytes, parse_compute, parse_memory

KI, MI, GI, TI = 2**10, 2**20, 2**30, 2**40
MEMORY = "weft.io/gpu-memory.train"
COMPUTE = "weft.io/gpu-compute.train"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param("20Gi", 20 * GI, id="binary-gibibytes"),
        pytest.param("512Mi", 512 * MI, id="binary-mebibytes"),
        pytest.param("4Ki", 4 * KI, id="binary-kibibytes"),
        pytest.param("2Ti", 2 * TI, id="binary-tebibytes"),
        pytest.param("1Pi", 2**50, id="binary-pebibytes"),
        pytest.param("1Ei", 2**60, id="binary-exbibytes"),
        pytest.param("1G", 10**9, id="decimal-gigabytes"),
        pytest.param("1500M", 1_500_000_000, id="decimal-megabytes"),
        pytest.param("3k", 3000, id="decimal-kilo-is-lowercase"),
        pytest.param("2T", 2 * 10**12, id="decimal-terabytes"),
        pytest.param("1P", 10**15, id="decimal-petabytes"),
        pytest.param("1E", 10**18, id="capital-e-alone-is-exa"),
        pytest.param("1e9", 10**9, id="exponent"),
        pytest.param("1E9", 10**9, id="capital-e-with-digits-is-exponent"),
        pytest.param("15e+8", 1_500_000_000, id="exponent-with-plus"),
        pytest.param("123456", 123456, id="plain-integer-is-bytes"),
        pytest.param("1.5Gi", 3 * GI // 2, id="fraction-of-a-unit"),
        pytest.param(".5Gi", GI // 2, id="leading-point"),
        pytest.param("5.Mi", 5 * MI, id="trailing-point"),
        pytest.param("+1Gi", GI, id="explicit-plus"),
        pytest.param("0.5", 1, id="half-a-byte-rounds-up"),
        pytest.param("1.0000001Ki", 1025, id="fractional-byte-rounds-up"),
        pytest.param("1e-3", 1, id="negative-exponent-rounds-up-to-one-byte"),
        pytest.param("1e-999", 1, id="tiny-exponent-still-one-byte"),
        pytest.param("20Gi\n", 20 * GI, id="yaml-block-trailing-newline-ignored"),
        pytest.param(" 20Gi ", 20 * GI, id="surrounding-spaces-ignored"),
        pytest.param("080Gi", 80 * GI, id="leading-zero"),
    ],
)
def test_memory_accepts(value: str, expected: int) -> None:
    assert parse_memory(MEMORY, value) == expected


@pytest.mark.parametrize(
    ("value", "words"),
    [
        pytest.param("", "is empty", id="empty"),
        pytest.param("   ", "is empty", id="blank"),
        pytest.param("lots", "is not a quantity (e.g. 20Gi, 512Mi)", id="word"),
        pytest.param("Gi", "is not a quantity", id="suffix-without-number"),
        pytest.param("1 Gi", "is not a quantity", id="space-before-suffix"),
        pytest.param("1,5Gi", "is not a quantity", id="decimal-comma"),
        pytest.param("0x10", "is not a quantity", id="hex-is-not-a-quantity"),
        pytest.param("20GB", 'unknown suffix "GB"', id="gigabyte-spelling"),
        pytest.param("20gi", 'unknown suffix "gi"', id="suffix-is-case-sensitive"),
        pytest.param("20K", 'unknown suffix "K"', id="capital-k-is-not-kilo"),
        pytest.param("512m", "did you mean 512Mi?", id="milli-is-a-slip-for-mebi"),
        pytest.param("-1Gi", "is negative", id="negative"),
        pytest.param("-1e40", "is negative", id="negative-huge-exponent-is-still-negative"),
        pytest.param("0", "is zero", id="zero"),
        pytest.param("0Gi", "is zero", id="zero-with-unit"),
        pytest.param("-0", "is zero", id="negative-zero-is-zero"),
        pytest.param("1e40", "is larger than any device", id="absurd-exponent"),
        pytest.param("9" * 70, "is not a quantity", id="paste-accident-length"),
    ],
)
def test_memory_refuses_naming_annotation_and_value(value: str, words: str) -> None:
    assert_refused(parse_memory, MEMORY, value, words)


def assert_refused(parse: Callable[[str, str], int], annotation: str, value: str, words: str) -> None:
    """``parse`` refuses ``value`` of ``annotation`` with a message that starts by naming both and says ``words``."""
    with pytest.raises(AnnotationError) as err:
        parse(annotation, value)
    message = str(err.value)
    assert message.startswith(f'{annotation}: "{value}" ')
    assert words in message
    assert (err.value.annotation, err.value.value) == (annotation, value)


@pytest.mark.parametrize(
    ("value", "max_bytes", "accepted"),
    [
        pytest.param("80Gi", 80 * GI, True, id="exactly-the-largest-device-fits"),
        pytest.param("81Gi", 80 * GI, False, id="over-the-largest-device"),
        pytest.param("85899345921", 80 * GI, False, id="one-byte-over"),
        pytest.param("1e40", 80 * GI, False, id="absurd-exponent-names-the-device-size"),
        pytest.param("1Ei", None, True, id="no-limit-without-inventory"),
    ],
)
def test_memory_against_largest_device(value: str, max_bytes: int | None, accepted: bool) -> None:
    if accepted:
        assert parse_memory(MEMORY, value, max_bytes=max_bytes) > 0
        return
    with pytest.raises(AnnotationError) as err:
        parse_memory(MEMORY, value, max_bytes=max_bytes)
    assert str(err.value) == f'{MEMORY}: "{value}" is larger than any device (80Gi)'


def test_error_is_a_value_error_with_the_exact_message() -> None:
    with pytest.raises(ValueError) as err:
        parse_memory(MEMORY, "lots")
    assert str(err.value) == 'weft.io/gpu-memory.train: "lots" is not a quantity (e.g. 20Gi, 512Mi)'


@given(st.integers(min_value=1, max_value=2**70), st.sampled_from(["", "Ki", "Mi", "Gi", "k", "M", "G"]))
def test_memory_integer_with_suffix_is_exact(number: int, suffix: str) -> None:
    multiplier = {"": 1, "Ki": KI, "Mi": MI, "Gi": GI, "k": 10**3, "M": 10**6, "G": 10**9}[suffix]
    assert parse_memory(MEMORY, f"{number}{suffix}") == number * multiplier


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param("50", 50, id="plain-percent"),
        pytest.param("50%", 50, id="trailing-percent-sign"),
        pytest.param("1", 1, id="smallest"),
        pytest.param("100", 100, id="whole-device"),
        pytest.param("100%", 100, id="whole-device-with-sign"),
        pytest.param("007", 7, id="leading-zeros"),
        pytest.param(" 30 ", 30, id="surrounding-spaces-ignored"),
    ],
)
def test_compute_accepts(value: str, expected: int) -> None:
    assert parse_compute(COMPUTE, value) == expected


@pytest.mark.parametrize(
    ("value", "words"),
    [
        pytest.param("0", "is zero", id="zero"),
        pytest.param("0%", "is zero", id="zero-percent"),
        pytest.param("101", "is over 100", id="just-over"),
        pytest.param("1" + "0" * 5000, "is over 100", id="enormous"),
        pytest.param("-5", "is negative", id="negative"),
        pytest.param("12.5", "is a fraction", id="fraction"),
        pytest.param("0.5%", "is a fraction", id="fraction-percent"),
        pytest.param("half", "is not a percent", id="word"),
        pytest.param("", "is not a percent", id="empty"),
        pytest.param("+50", "is not a percent", id="explicit-plus"),
        pytest.param("5_0", "is not a percent", id="python-digit-separator"),
        pytest.param("50 %", "is not a percent", id="space-before-sign"),
        pytest.param("%50", "is not a percent", id="leading-sign"),
    ],
)
def test_compute_refuses_naming_annotation_and_value(value: str, words: str) -> None:
    assert_refused(parse_compute, COMPUTE, value, words)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        pytest.param(0, "0", id="zero"),
        pytest.param(100, "100", id="bytes-plain"),
        pytest.param(1023, "1Ki", id="just-under-a-unit-rounds-into-it"),
        pytest.param(1536, "1.5Ki", id="one-and-a-half-kibi"),
        pytest.param(512 * MI, "512Mi", id="mebibytes"),
        pytest.param(20 * GI, "20Gi", id="gibibytes"),
        pytest.param(3 * GI // 2, "1.5Gi", id="trailing-zero-dropped"),
        pytest.param(GI + GI // 3, "1.33Gi", id="two-decimals"),
        pytest.param(GI - 1, "1Gi", id="rounding-promotes-the-unit"),
        pytest.param(80 * GI + 1, "80Gi", id="a-byte-over-reads-as-the-unit"),
        pytest.param(2 * TI, "2Ti", id="tebibytes"),
        pytest.param(3 * 2**60, "3Ei", id="exbibytes"),
        pytest.param(-20 * GI, "-20Gi", id="negative-keeps-sign"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


@given(st.integers(min_value=0, max_value=2**64))
def test_format_bytes_round_trips_within_rounding(n: int) -> None:
    # Two decimals in the largest unit: at most half a hundredth of that unit off.
    text = format_bytes(n)
    parsed = parse_memory(MEMORY, text) if n else 0
    unit = {"Ki": KI, "Mi": MI, "Gi": GI, "Ti": TI, "Pi": 2**50, "Ei": 2**60}.get(text[-2:], 1)
    assert abs(parsed - n) <= unit // 200 + 1
