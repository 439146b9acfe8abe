"""Percentiles, defined once for the benchmarks, the simulators and the tests' reports."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float, *, observed: bool = False) -> float | None:
    """The q-th percentile (0..100) of ``values``; None if there are none.

    By default interpolated linearly between ranks (numpy's default, and ``statistics.quantiles`` with
    ``method="inclusive"``). ``observed``: the nearest-rank sample instead, a value some sample really had, so
    that a percentile of counts is a count.
    """
    if not values:
        return None
    ordered = sorted(values)
    if observed:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
