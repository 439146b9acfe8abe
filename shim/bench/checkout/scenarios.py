"""Figures gathered from integration scenarios: the tests run as they run in CI, their figures collected.

A scenario writes its figures as values (``harness.fixture.report``) to the file a benchmark names
in ``BENCH_FIGURES_ENV``; so every figure comes with the checks that the operation it times did what it must.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from harness.fixture import BENCH_FIGURES_ENV
from shim.bench.running import report

REPO = Path(__file__).resolve().parents[3]


def gather(scenarios: str, select: str | None, wanted: set[str],
           say: Callable[[str], None]) -> tuple[int, dict | None, float]:
    """Run ``scenarios`` (``-k select``) in one pytest; (exit code, their figures merged, seconds taken).

    The figures are None when a scenario failed (its output said) or one of ``wanted`` was not reported.
    """
    with tempfile.TemporaryDirectory(prefix="weft-bench-scenarios-") as tmp:
        out = Path(tmp) / "figures.jsonl"
        env = {**os.environ, BENCH_FIGURES_ENV: str(out)}
        started = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
                              "-rA", scenarios, *(["-k", select] if select else [])], cwd=REPO, env=env,
                             capture_output=True, text=True)
        took = time.monotonic() - started
        if run.returncode != 0:
            say(f"a scenario failed (pytest exit {run.returncode}):\n{run.stdout[-8000:]}\n{run.stderr[-2000:]}")
            return 1, None, took
        records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    figures: dict = {}
    for r in records:
        say(r["line"])
        figures.update(r["figures"])
    missing = wanted - set(figures)
    if missing:
        say(f"the scenarios ran but reported no {', '.join(sorted(missing))}")
        return 1, None, took
    return 0, rounded(figures), took


def rounded(value):
    if isinstance(value, float):
        return round(value, 2)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return value


def run(tag: str, measure: Callable[[Callable[[str], None]], tuple[int, dict | None]], as_json: bool,
        output: Path | None, table: Callable[[dict], str]) -> int:
    """A scenario benchmark's run: its progress on stderr as ``[tag] ...``, its figures reported as ``weft
    bench`` reports them; exit codes as ``weft bench`` (0 measured, 1 failed, 130 stopped)."""

    def say(line: str) -> None:
        print(f"[{tag}] {line}", file=sys.stderr, flush=True)

    try:
        code, figures = measure(say)
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    if figures is None:
        return code
    return report(figures, as_json, output, table)
