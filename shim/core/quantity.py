"""Parsing of the GPU share a pod declares in its annotations.

A pod asks for part of a GPU with ``weft.io/gpu-memory.<container>`` (a
Kubernetes resource quantity such as ``20Gi``) and
``weft.io/gpu-compute.<container>`` (a percent). Both are typed by hand into
YAML, so the parser is strict where a slip would silently change the meaning
(``512m`` is half a byte to Kubernetes, not 512 MiB; ``20GB`` is no quantity
at all) and every error names the annotation and the value, because that
message is what ``kubectl describe`` and ``crictl`` show the person who wrote
it. Pure, so the agent, the broker and ``weft explain`` share one parser.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

MEMORY_EXAMPLES = "e.g. 20Gi, 512Mi"

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_MULTIPLIERS = {**_BINARY, **_DECIMAL}

# Kubernetes' grammar (apimachinery resource.Quantity): a signed decimal, then
# a binary suffix, a decimal suffix or a decimal exponent. The suffix group is
# deliberately loose so that an unknown suffix gets its own message.
_QUANTITY = re.compile(r"(?P<sign>[+-]?)(?P<number>\d+(?:\.\d*)?|\.\d+)(?:[eE](?P<exp>[+-]?\d+)|(?P<suffix>[A-Za-z]*))")
_PERCENT = re.compile(r"(?P<digits>\d+)%?")

# Anything longer is a paste accident, and bounding it keeps int() and
# Fraction() away from the interpreter's limit on long integer strings.
_MAX_LENGTH = 64
# 10**30 bytes is far past any device; a larger exponent is a typo, and
# refusing it early keeps the arithmetic cheap for "1e999999".
_MAX_EXPONENT = 30

# Largest unit first, so a size is shown in the biggest unit it reaches.
_UNITS = sorted(_BINARY.items(), key=lambda item: item[1], reverse=True)


class AnnotationError(ValueError):
    """A weft annotation holds a value weft cannot use; the message names both."""

    def __init__(self, annotation: str, value: str, problem: str) -> None:
        super().__init__(f"{annotation}: {_quoted(value)} {problem}")
        self.annotation = annotation
        self.value = value
        self.problem = problem


def _quoted(value: str) -> str:
    # Double quotes, as in the YAML the user wrote; repr() would pick single
    # quotes and escape differently on every Python version.
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def parse_memory(annotation: str, value: str, *, max_bytes: int | None = None) -> int:
    """Bytes declared by a ``weft.io/gpu-memory.*`` annotation, fractions rounded up.

    ``max_bytes`` is the largest device on the node: an ask no device could
    ever hold is refused here, where the message can still say so plainly,
    rather than waiting forever for a device to free up.
    """
    text = value.strip()  # YAML block scalars bring a trailing newline along
    if not text:
        raise AnnotationError(annotation, value, f"is empty; expected a quantity ({MEMORY_EXAMPLES})")
    match = _QUANTITY.fullmatch(text) if len(text) <= _MAX_LENGTH else None
    if match is None:
        raise AnnotationError(annotation, value, f"is not a quantity ({MEMORY_EXAMPLES})")
    suffix = match["suffix"] or ""
    if suffix == "m":
        raise AnnotationError(
            annotation, value, f'means thousandths of a byte ("m" is milli); did you mean {match["number"]}Mi?'
        )
    if match["exp"] is None and suffix not in _MULTIPLIERS:
        raise AnnotationError(
            annotation, value, f'has an unknown suffix "{suffix}" (use Ki, Mi, Gi, Ti, Pi, Ei or k, M, G, T, P, E)'
        )
    amount = Fraction(match["number"])
    if amount == 0:
        raise AnnotationError(annotation, value, "is zero; GPU memory must be more than zero")
    if match["sign"] == "-":
        raise AnnotationError(annotation, value, "is negative; GPU memory must be more than zero")
    if match["exp"] is not None and int(match["exp"]) > _MAX_EXPONENT:
        raise AnnotationError(annotation, value, _too_large(max_bytes))
    if match["exp"] is not None:
        # Below 10**-30 the value is a fraction of a byte either way; clamping
        # keeps it positive (rounded up to 1 byte) without a huge power.
        amount *= Fraction(10) ** max(int(match["exp"]), -_MAX_EXPONENT)
    else:
        amount *= _MULTIPLIERS[suffix]
    size = math.ceil(amount)
    if max_bytes is not None and size > max_bytes:
        raise AnnotationError(annotation, value, _too_large(max_bytes))
    return size


def _too_large(max_bytes: int | None) -> str:
    return "is larger than any device" + ("" if max_bytes is None else f" ({format_bytes(max_bytes)})")


_CPU = re.compile(r"(?P<number>\d+(\.\d*)?|\.\d+)(?P<milli>m?)")


def parse_cpu(field: str, value: str) -> float:
    """Cores of a Kubernetes CPU quantity (``500m``, ``2``, ``0.5``), as a pod spec's requests hold them."""
    match = _CPU.fullmatch(value.strip())
    if match is None:
        raise AnnotationError(field, value, "is not a CPU quantity (e.g. 500m, 2, 0.5)")
    cores = float(match["number"])
    return cores / 1000 if match["milli"] else cores


def parse_compute(annotation: str, value: str) -> int:
    """Percent of a device's compute declared by a ``weft.io/gpu-compute.*`` annotation, 1..100."""
    text = value.strip()
    # int() alone would also take "+50", "5_0" and " 50 " with inner spaces;
    # the regex admits only what a person means as a whole percent.
    match = _PERCENT.fullmatch(text)
    if match is None:
        if re.fullmatch(r"-\d+%?", text):
            problem = "is negative; expected a whole percent from 1 to 100"
        elif re.fullmatch(r"[+-]?(\d+\.\d*|\.\d+)%?", text):
            problem = "is a fraction; expected a whole percent from 1 to 100"
        else:
            problem = "is not a percent; expected a whole percent from 1 to 100 (e.g. 50 or 50%)"
        raise AnnotationError(annotation, value, problem)
    digits = match["digits"].lstrip("0") or "0"
    if len(digits) > 3 or int(digits) > 100:
        raise AnnotationError(annotation, value, "is over 100; a container cannot have more than a whole device")
    percent = int(digits)
    if percent == 0:
        raise AnnotationError(annotation, value, "is zero; expected a whole percent from 1 to 100")
    return percent


def format_bytes(n: int) -> str:
    """A size for people, in the largest binary unit it reaches: ``20Gi``, ``1.5Gi``, ``512Mi``, ``100``.

    Rounded to two decimals, so it is for messages, never for arithmetic.
    """
    if n < 0:
        return "-" + format_bytes(-n)
    for suffix, unit in _UNITS:
        # Hundredths, rounded half up; choosing the unit after rounding shows
        # 1Gi - 1 byte as "1Gi" rather than "1024Mi".
        hundredths = (n * 100 + unit // 2) // unit
        if hundredths >= 100:
            whole, frac = divmod(hundredths, 100)
            return f"{whole}.{frac:02d}".rstrip("0").rstrip(".") + suffix
    return str(n)
