"""Long-running daemons of the test cluster: started with a log file, stopped with their whole process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shim.localfabric.agent import free_port  # noqa: F401 - the kube harness takes its ports from here too


def tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


@dataclass
class Daemon:
    """One process with its log; ``start`` waits until ``ready()`` says so, or fails with the log's tail."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self, ready: Callable[[], bool], timeout: float) -> float:
        """Start it and return the seconds it took to become ready."""
        t0 = time.monotonic()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(list(self.argv), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env={**os.environ, **self.env})
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; {self.log_path}:\n"
                                   f"{tail(self.log_path)}")
            with contextlib.suppress(OSError):
                if ready():
                    return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{self.name} was not ready within {timeout:g} s; {self.log_path}:\n"
                                   f"{tail(self.log_path)}")
            time.sleep(0.1)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        """Signal the process group, then SIGKILL whatever is left of it. Safe to call more than once."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None
