"""``weft bench`` run as a platform engineer runs it, for the tests that check its figures: the CLI in a subprocess
of this checkout, stopped with SIGTERM (which tears its fabric down) when it overruns; and the one check every
figure gets, sane rather than fast (timing thresholds would only measure how busy the test machine is)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``weft bench ARGS``; the test fails with its log's tail if it exits non-zero or takes over ``timeout``."""
    argv = [sys.executable, "-m", "shim", "bench", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the benchmark tears its fabric down on it
        out, err = proc.communicate(timeout=120)
        pytest.fail(f"weft bench {args[0]} did not finish within {timeout:g} s:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def positive(value: float, what: str) -> None:
    assert isinstance(value, int | float) and math.isfinite(value) and value > 0, (what, value)
