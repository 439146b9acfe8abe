"""A CUDA client process of the live test (``shim.gpucheck.cuda_client``), driven a line at a time."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import time


class ClientError(Exception):
    pass


class Client:
    """One cuda_client process: a command per line in, a JSON answer per line out, every read bounded."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
        self.name, self.proc, self.timeout = name, proc, timeout
        self._buf = b""
        os.set_blocking(proc.stdout.fileno(), False)

    def read(self, timeout: float | None = None, what: str = "its first line") -> dict:
        deadline = time.monotonic() + (timeout or self.timeout)
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ClientError(f"client {self.name} did not answer {what} within {timeout or self.timeout:g}s")
                if not sel.select(left):
                    continue
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    code = self.proc.poll()
                    raise ClientError(f"client {self.name} exited (code {code}) before answering {what}"
                                      + self._stderr())
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            raise ClientError(f"client {self.name} answered {what} with {line[:200]!r}") from None

    def send(self, command: str) -> None:
        try:
            self.proc.stdin.write(command.encode() + b"\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise ClientError(f"client {self.name} is gone ({exc}) before {command!r}") from None

    def ask(self, command: str, timeout: float | None = None) -> dict:
        self.send(command)
        return self.read(timeout, repr(command))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        """Ask it to exit; kill its process group if it does not."""
        if self.alive():
            with contextlib.suppress(OSError):
                self.proc.stdin.write(b"exit\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.kill()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(OSError):
                f.close()

    def _stderr(self) -> str:
        with contextlib.suppress(OSError, ValueError):
            os.set_blocking(self.proc.stderr.fileno(), False)
            text = (self.proc.stderr.read() or b"").decode(errors="replace").strip()
            return f": {text[-300:]}" if text else ""
        return ""
