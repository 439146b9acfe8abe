"""shim.stopping: how a command's process ends on SIGTERM (each case in a process of its own, signalled from here).

integration/faults/test_pid1_sigterm.py runs weft's own commands as PID 1 of a PID namespace (root); these
check the module's parts on their own: the value and the exception of the work, the process ended at once
before a command takes the signal over, a work that returns when stopped, one stuck in a call, and a write
under way when the process ends.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from shim import stopping

PRELUDE = """
import sys, threading, time
from pathlib import Path
from shim import log, stopping
stopping.end_at_once()
log.configure("info")
"""


def _run(body: str, *, signals: int = 1) -> tuple[int, list[dict]]:
    """Run ``body`` in a Python of its own; once it prints ``ready``, SIGTERM it (``signals`` times): its exit
    status and the log events it wrote.

    Its output goes to files, not pipes: a pipe's end can be inherited by a process another thread of this test
    run forks meanwhile, and reading to its end would then wait for that process, not for this one."""
    with tempfile.TemporaryDirectory(prefix="weft-stopping-") as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        with open(out, "wb") as o, open(err, "wb") as e:
            p = subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], stdout=o, stderr=e)
        deadline = time.monotonic() + 30
        while not out.read_text().startswith("ready"):
            if p.poll() is not None or time.monotonic() > deadline:
                p.kill()
                pytest.fail(f"never ready (exit {p.wait()}): {err.read_text()}")
            time.sleep(0.01)
        for _ in range(signals):
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=30)  # a guard against a hang, not a measure: it ends well before
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            pytest.fail(f"still running 30 s after SIGTERM: {err.read_text()}")
        events = [json.loads(ln) for ln in err.read_text().splitlines() if ln.startswith("{")]
    return p.returncode, events


def test_the_work_s_value_is_returned_and_its_exception_raised_where_serve_was_called() -> None:
    before = [signal.getsignal(s) for s in stopping.SIGNALS]
    assert stopping.serve(lambda stop: 7, name="t") == 7
    with pytest.raises(KeyError, match="boom"):
        stopping.serve(lambda stop: {}["boom"], name="t")
    assert [signal.getsignal(s) for s in stopping.SIGNALS] == before  # its handlers put back as they were


def test_before_a_command_takes_it_sigterm_ends_the_process_at_once() -> None:
    code, events = _run("""
        print("ready", flush=True)
        time.sleep(30)
    """)
    assert (code, events) == (128 + signal.SIGTERM, [])


def test_a_work_that_returns_when_stopped_ends_the_process_in_order_with_the_command_s_status() -> None:
    code, events = _run("""
        def work(stop):
            print("ready", flush=True)
            stop.wait()
        sys.exit(stopping.serve(work, name="weft-test", stopped=None))
    """, signals=2)  # a second SIGTERM changes nothing (a handler that set the Event could deadlock on its lock)
    assert code == 128 + signal.SIGTERM
    assert [e["event"] for e in events] == ["stop.requested"]
    assert events[0]["command"] == "weft-test" and events[0]["signal"] == "SIGTERM"


def test_a_work_stuck_in_a_call_is_left_and_the_process_ends_with_the_command_s_status() -> None:
    code, events = _run("""
        def work(stop):
            print("ready", flush=True)
            threading.Event().wait()  # a call that never returns, stop or not
        sys.exit(stopping.serve(work, name="weft-test") or 0)
    """)
    assert code == 0
    assert [e["event"] for e in events] == ["stop.requested", "stop.forced"]
    assert events[1]["write_finished"] is True


def test_a_write_under_way_is_finished_before_the_process_ends(tmp_path: Path) -> None:
    out = tmp_path / "whole"
    code, events = _run(f"""
        def work(stop):
            with stopping.writing():
                print("ready", flush=True)
                time.sleep(stopping.GRACE_S + 0.3)  # past the grace: the ending process waits for the write
                Path({str(out)!r}).write_text("whole")
            threading.Event().wait()
        sys.exit(stopping.serve(work, name="weft-test") or 0)
    """)
    assert code == 0 and out.read_text() == "whole"
    assert [e["event"] for e in events] == ["stop.requested", "stop.forced"]
