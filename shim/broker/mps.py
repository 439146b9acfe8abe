"""One CUDA MPS control daemon per shared GPU, started and kept alive by the broker.

Leases on a shared device are enforced by MPS: each client's
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
make an over-allocation fail in the violator alone. That holds only while the
device's control daemon runs; a client that finds no daemon runs without MPS
and without limits. So the broker starts each daemon in the foreground
(``nvidia-cuda-mps-control -f``) as its own child, in its own session, notices
when it dies and starts it again.

Each device gets its own pipe and log directories under ``base_dir/<uuid>/``;
containers leased on the device mount its pipe directory. Stopping asks the
daemon to ``quit`` (which also ends its MPS server), and kills it only when it
does not; pipe and log directories stay, as the log is what explains a failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from shim import log

_log = log.get("weft.broker.mps")

# A control-daemon command that changes nothing: a successful answer means the
# daemon is up and listening on its pipe directory.
_PROBE = "get_default_active_thread_percentage\n"


class MpsError(Exception):
    """An MPS control daemon could not be started; the message names the binary and device."""


@dataclass(frozen=True)
class MpsDaemon:
    device_uuid: str
    pipe_dir: Path  # CUDA_MPS_PIPE_DIRECTORY for the device's clients
    log_dir: Path  # CUDA_MPS_LOG_DIRECTORY: control.log and server.log
    pid: int


@dataclass
class _Child:
    daemon: MpsDaemon
    proc: subprocess.Popen
    binary: str  # as resolved when the daemon started; the control client is the same binary
    env: dict[str, str]


class MpsSupervisor:
    def __init__(
        self,
        base_dir: Path,
        binary: str = "nvidia-cuda-mps-control",
        *,
        ready_timeout: float = 10.0,
        stop_timeout: float = 10.0,
    ) -> None:
        self._base_dir = Path(base_dir)
        self._binary = binary
        self._ready_timeout = ready_timeout
        self._stop_timeout = stop_timeout
        # One lock for all devices: starts and stops are rare, and holding it
        # through a stop keeps ensure() from starting a second daemon on the
        # same pipe directory while the first one drains.
        self._lock = threading.Lock()
        self._children: dict[str, _Child] = {}

    def ensure(self, device_uuid: str) -> MpsDaemon:
        """The device's running daemon, started (or restarted, if it died) as needed."""
        with self._lock:
            child = self._children.get(device_uuid)
            if child is None:
                return self._start(device_uuid).daemon
            if child.proc.poll() is None:
                return child.daemon
            return self._restart(child).daemon

    def check(self) -> list[str]:
        """Restart every daemon that died; returns the devices whose daemon was restarted."""
        restarted = []
        with self._lock:
            for uuid, child in list(self._children.items()):
                if child.proc.poll() is None:
                    continue
                try:
                    self._restart(child)
                except MpsError as exc:
                    # The dead entry stays, so the next check() tries again.
                    _log.error("mps.restart_failed", device=uuid, exit_code=child.proc.returncode, error=str(exc))
                    continue
                restarted.append(uuid)
        return restarted

    def stop(self, device_uuid: str) -> None:
        """Quit the device's daemon; a device with no daemon is already stopped."""
        with self._lock:
            child = self._children.pop(device_uuid, None)
            if child is not None:
                self._stop(child)

    def stop_all(self) -> None:
        with self._lock:
            while self._children:
                self._stop(self._children.popitem()[1])

    def _restart(self, dead: _Child) -> _Child:
        child = self._start(dead.daemon.device_uuid)
        _log.warning(
            "mps.restarted",
            device=dead.daemon.device_uuid,
            old_pid=dead.daemon.pid,
            exit_code=dead.proc.returncode,
            pid=child.daemon.pid,
        )
        return child

    def _start(self, uuid: str) -> _Child:
        binary = shutil.which(self._binary)
        if binary is None:
            raise MpsError(f"{self._binary}: not found (is the CUDA MPS control binary installed and on PATH?)")
        if not uuid or "/" in uuid or uuid.startswith("."):
            # Old-style MIG names ("MIG-GPU-.../1/0") would nest directories.
            raise ValueError(f"device UUID {uuid!r} cannot name a directory")
        root = self._base_dir / uuid
        pipe_dir, log_dir = root / "pipe", root / "log"
        for path in (root, pipe_dir, log_dir):
            path.mkdir(parents=True, exist_ok=True)
            # Not left to the umask: clients in containers run as other users
            # and must reach the pipes.
            path.chmod(0o755)
        env = {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": uuid,
            "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(log_dir),
        }
        # In the foreground the daemon writes to stdout what it would log; keep
        # it beside control.log rather than in the broker's own log stream.
        with open(log_dir / "control-foreground.log", "ab") as out:
            try:
                proc = subprocess.Popen(
                    [binary, "-f"],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    # Its own session: a signal to the broker's process group
                    # (Ctrl-C, systemd stop) must not take the daemon down
                    # before the broker quits it in order.
                    start_new_session=True,
                )
            except OSError as exc:
                raise MpsError(f"{binary} -f for {uuid}: {exc}") from exc
        child = _Child(MpsDaemon(uuid, pipe_dir, log_dir, proc.pid), proc, binary, env)
        self._wait_ready(child)
        self._children[uuid] = child
        _log.info("mps.started", device=uuid, pid=proc.pid, pipe_dir=str(pipe_dir))
        return child

    def _wait_ready(self, child: _Child) -> None:
        deadline = time.monotonic() + self._ready_timeout
        while True:
            if child.proc.poll() is not None:
                raise MpsError(
                    f"{self._binary} -f for {child.daemon.device_uuid} exited with code {child.proc.returncode} "
                    f"as it started; see {child.daemon.log_dir}"
                )
            answer = self._control(child, _PROBE, timeout=max(0.1, deadline - time.monotonic()))
            if answer is not None and answer.returncode == 0:
                return
            if time.monotonic() >= deadline:
                self._kill(child)
                raise MpsError(
                    f"{self._binary} -f for {child.daemon.device_uuid} did not answer within "
                    f"{self._ready_timeout:g}s; see {child.daemon.log_dir}"
                )
            time.sleep(0.05)

    def _stop(self, child: _Child) -> None:
        killed = False
        if child.proc.poll() is None:
            deadline = time.monotonic() + self._stop_timeout
            answer = self._control(child, "quit\n", timeout=self._stop_timeout)
            if answer is None or answer.returncode != 0:
                _log.warning("mps.quit_failed", device=child.daemon.device_uuid, pid=child.daemon.pid)
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._kill(child)
                killed = True
        _log.info(
            "mps.stopped",
            device=child.daemon.device_uuid,
            pid=child.daemon.pid,
            exit_code=child.proc.returncode,
            killed=killed,
        )

    def _kill(self, child: _Child) -> None:
        # The whole session's group: the daemon's MPS server goes with it. The
        # child is not yet reaped, so its PID (the group's ID) cannot have been reused.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait()

    def _control(self, child: _Child, command: str, timeout: float) -> subprocess.CompletedProcess[str] | None:
        """Send one command to the daemon through the control client; None if the client could not run."""
        try:
            return subprocess.run(
                [child.binary],
                input=command,
                env=child.env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
