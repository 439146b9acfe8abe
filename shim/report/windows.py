"""Choosing the two windows: from weft's record of the opt-in moment, or from flags.

Times are RFC 3339 (``2025-05-01T10:00:00Z``), Unix seconds, ``now``, or
relative to now (``-6h``, ``now-2d``). The default split is the first moment
any pod of the workload opted in: *after* runs from it to now (at most
``--window`` long), *before* is as long and ends at it, so both windows
cover the same stretch of a daily cycle when the after window is whole days.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

from shim.report.errors import UsageError
from shim.report.model import Window

_DURATION = re.compile(r"(?P<n>\d+(?:\.\d+)?)(?P<unit>ms|[smhdw])")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(text: str, flag: str) -> float:
    """``90s``, ``30m``, ``6h``, ``7d``, ``1h30m``; a bare number is seconds."""
    t = text.strip()
    if re.fullmatch(r"\d+(\.\d+)?", t):
        return float(t)
    parts = _DURATION.findall(t)
    if not t or "".join(n + u for n, u in parts) != t:
        raise UsageError(f"{flag}: {text!r} is not a duration (like 90s, 30m, 6h, 7d)")
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


def parse_time(text: str, now: float, flag: str) -> float:
    t = text.strip()
    if t == "now":
        return now
    rel = re.fullmatch(r"(now)?-(?P<d>.+)", t)
    if rel:
        return now - parse_duration(rel["d"], flag)
    if re.fullmatch(r"\d+(\.\d+)?", t):
        return float(t)
    try:
        dt = datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise UsageError(f"{flag}: {text!r} is not a time (RFC 3339 like 2025-05-01T10:00:00Z, Unix seconds, "
                         "now, or -6h)") from None
    if dt.tzinfo is None:
        raise UsageError(f"{flag}: {text!r} has no time zone; add Z or an offset like +02:00")
    return dt.timestamp()


def parse_range(text: str, now: float, flag: str) -> tuple[float, float]:
    start, sep, end = text.partition("..")
    if not sep:
        raise UsageError(f"{flag}: {text!r} is not START..END (like 2025-05-01T00:00:00Z..2025-05-08T00:00:00Z "
                         "or -14d..-7d)")
    return parse_time(start, now, flag), parse_time(end, now, flag)


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def human(seconds: float) -> str:
    s = abs(seconds)
    if s >= 86400:
        return f"{seconds / 86400:.3g}d"
    if s >= 3600:
        return f"{seconds / 3600:.3g}h"
    if s >= 60:
        return f"{seconds / 60:.3g}min"
    return f"{seconds:.3g}s"


@dataclass(frozen=True)
class Windows:
    before: Window
    after: Window
    opt_in: float  # the split: the opt-in moment, or with --before/--after the after window's start
    source: str  # where the split came from: "flags", "--opt-in", "weft metrics", "state dir"


def from_flags(before: str | None, after: str | None, opt_in: str | None, now: float) -> Windows | None:
    """The windows the flags fix, or None when they leave the split to weft's record."""
    if (before is None) != (after is None):
        given = "--before" if before is not None else "--after"
        raise UsageError(f"{given} needs its partner: give both --before and --after, or neither (the windows then "
                         "come from when the workload opted in)")
    if before is not None and opt_in is not None:
        raise UsageError("--opt-in conflicts with --before/--after: drop --opt-in (the windows already say when) "
                         "or drop --before/--after (they are then chosen around --opt-in)")
    if before is None or after is None:
        return None
    b = _window("before", *parse_range(before, now, "--before"), now, "--before")
    a = _window("after", *parse_range(after, now, "--after"), now, "--after")
    if b.end > a.start:
        raise UsageError(f"--before ends ({iso(b.end)}) after --after starts ({iso(a.start)}): the windows must not "
                         "overlap; end --before at or before the start of --after")
    return Windows(b, a, opt_in=a.start, source="flags")


def around(opt_in: float, now: float, longest: float, source: str, flag: str = "") -> Windows:
    """Windows either side of ``opt_in``: after is [opt_in, now] cut to ``longest``, before as long."""
    if opt_in >= now:
        where = flag or "the opt-in record"
        raise UsageError(f"{where}: the workload opted in at {iso(opt_in)}, which is not in the past; there is no "
                         "after window yet")
    length = min(now - opt_in, longest)
    return Windows(Window("before", opt_in - length, opt_in), Window("after", opt_in, opt_in + length),
                   opt_in=opt_in, source=source)


def _window(name: str, start: float, end: float, now: float, flag: str) -> Window:
    if end <= start:
        raise UsageError(f"{flag}: the window {iso(start)}..{iso(end)} is empty (its end is not after its start); "
                         "give START..END with END later")
    if start >= now:
        raise UsageError(f"{flag}: the window starts at {iso(start)}, in the future; move it into the past")
    # Prometheus has nothing after now: a window reaching past it is cut
    # there, so its length (and so the cost figures) are what was measured.
    return Window(name, start, min(end, now))


def check_against_scrape(w: Windows, interval: float, flags: dict[str, str]) -> None:
    """A window shorter than one scrape holds at most one sample of anything: refuse it, naming the flag."""
    for win in (w.before, w.after):
        if win.seconds < interval:
            flag = flags.get(win.name, "--window")
            raise UsageError(f"{flag}: the {win.name} window is {human(win.seconds)}, shorter than the scrape "
                             f"interval ({human(interval)}); make it at least {human(interval)} (a verdict needs "
                             "many scrapes in each window)")
