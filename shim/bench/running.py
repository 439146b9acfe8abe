"""What every ``weft bench`` shares: cleanup on SIGTERM, exit codes, percentile summaries.

A benchmark starts daemons and makes namespaces; SIGTERM is turned into an
exception so every ``finally`` still tears them down. Exit codes: 0 measured
(whether or not targets were met), 1 failed, 130 interrupted, 143 terminated.
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from shim.core.stats import percentile
from shim.errors import WeftError

T = TypeVar("T")


class Terminated(BaseException):
    """SIGTERM, turned into an exception so every ``finally`` still cleans up."""


def _terminate(*_: object) -> None:
    # A second TERM must not cut the teardown that the first one started.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated


def guarded(say: Callable[[str], None], measure: Callable[[], T]) -> tuple[int, T | None]:
    """Run ``measure``; (0, its result), or (exit code, None) after saying what happened."""
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return 0, measure()
    except Terminated:
        say("terminated; cleaned up")
        return 143, None
    except KeyboardInterrupt:
        say("interrupted; cleaned up")
        return 130, None
    except Exception:  # noqa: BLE001 - any failure is reported, after cleanup, as exit code 1
        say(f"failed:\n{traceback.format_exc()}")
        return 1, None
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(say: Callable[[str], None], measure: Callable[[], dict], as_json: bool, output: Path | None,
        table: Callable[[dict], str]) -> int:
    """A benchmark's main after its flags: ``measure`` under :func:`guarded`, then :func:`report`; the exit code."""
    code, figures = guarded(say, measure)
    return code if figures is None else report(figures, as_json, output, table)


def run_in_scratch(prefix: str, say: Callable[[str], None], measure: Callable[[Path], dict], as_json: bool,
                   output: Path | None, table: Callable[[dict], str]) -> int:
    """:func:`run`, ``measure`` given a scratch directory (sockets, state, logs) that is removed before the report,
    whatever happened."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        code, figures = guarded(say, lambda: measure(workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return code if figures is None else report(figures, as_json, output, table)


def ms(ns: float, digits: int = 4) -> float:
    return round(ns / 1e6, digits)


def summary(ns: list[int], digits: int = 4) -> dict[str, float | int]:
    return {"p50_ms": ms(percentile(ns, 50) or 0, digits), "p99_ms": ms(percentile(ns, 99) or 0, digits),
            "max_ms": ms(max(ns), digits), "n": len(ns)}


def report(figures: dict, as_json: bool, output: Path | None, table: Callable[[dict], str]) -> int:
    """Write the figures to ``output`` (if given) and print them, as JSON or as ``table`` says; exit code 0."""
    text = json.dumps(figures, indent=2)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text + "\n")
    print(text if as_json else table(figures), flush=True)
    return 0


def right_aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """The rows as lines, every column right-aligned to its widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]


def labelled(rows: list[tuple[str, ...]]) -> list[str]:
    """The rows as lines: the label left-aligned, the figures right-aligned, the last column (a mark) as it is."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join([row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:-1], widths[1:-1], strict=True)),
                       row[-1]]).rstrip() for row in rows]


def targets_met(targets: dict[str, bool]) -> str:
    """The closing line of a table: how many targets were met (``all`` is their conjunction, not one of them)."""
    return f"targets met: {sum(1 for k, v in targets.items() if k != 'all' and v)} of {len(targets) - 1}"


def established(local: Callable[[str], bool]) -> int:
    """Established TCP connections whose local address (``0100007F:1F90``, as /proc/net/tcp and tcp6 write it)
    ``local`` accepts."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "01" and local(fields[1]):
                count += 1
    return count


def parse_counts(flag: str, spec: str | None, default: tuple[int, ...]) -> list[int]:
    """``N`` or ``N,N,...`` (sizes to measure, sorted, each at least 1); ``default`` when not given."""
    if not spec:
        return list(default)
    try:
        ns = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise WeftError(f"{flag}: {spec!r} is not a number or a comma-separated list of numbers") from None
    if not ns or ns[0] < 1:
        raise WeftError(f"{flag}: at least one, each at least 1")
    return ns
