"""One CUDA MPS control daemon per shared lease, its limits set on the server side.

A lease's memory and compute shares are enforced by MPS, and they must hold
against the container that holds the lease. A client's own
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
can only lower what the control daemon set, never raise it, but a client can
unset them. So each lease gets its own control daemon (and so its own MPS
server), whose defaults the broker sets before any client connects::

    set_default_active_thread_percentage <percent>
    set_default_device_pinned_mem_limit 0 <MiB>M

and reads back (``get_default_...``) before the lease is granted. The server
the daemon spawns for the lease's first client takes those limits; a client
with its environment cleared still lands on that server (the lease's pipe
directory is also mounted at MPS's default ``/tmp/nvidia-mps``), and a client
that points itself elsewhere runs outside MPS, which the watchdog kills.
Device ordinal 0 is the lease's device: the daemon sees only that one
(``CUDA_VISIBLE_DEVICES``).

Each daemon runs in the foreground (``nvidia-cuda-mps-control -f``) as the
broker's child, in its own session; the broker notices when it dies and starts
it again with the same limits. Pipe, log and shared-memory directories live
under ``base_dir/<lease>/``. MPS clients and their server talk through
``/dev/shm`` as well as the pipes, and a container has its own ``/dev/shm``:
with ``private_shm`` the daemon runs in a mount namespace whose ``/dev/shm``
is the lease's ``shm`` directory, which the container mounts as its
``/dev/shm`` too. Stopping asks the daemon to ``quit`` and kills it only when
it does not; the directories stay, as the log is what explains a failure.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from shim import log
from shim.errors import WeftError

_log = log.get("weft.broker.mps")

# A control-daemon command that changes nothing: a successful answer means the
# daemon is up and listening on its pipe directory.
_PROBE = "get_default_active_thread_percentage"
_SAFE_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# The daemon answers a pinned-memory limit as "<n>M" or "<n>G" (some drivers
# show a limit of a GiB or more in whole GiB, rounded down).
_MEMORY_ANSWER = re.compile(r"(\d+)\s*([MG])")
_UNITS = {"M": 1 << 20, "G": 1 << 30}
# Runs the daemon with the lease's shm directory as /dev/shm, in a mount
# namespace of its own; ``exec`` keeps the daemon's PID the one we started.
_PRIVATE_SHM = 'mount --bind "$1" /dev/shm && exec "$2" -f'


class MpsError(WeftError):
    """An MPS control daemon could not be started or did not take its limits; the message names what."""

    code = grpc.StatusCode.UNAVAILABLE


@dataclass(frozen=True)
class MpsLimits:
    """What every client of a lease's MPS server is held to."""

    memory_bytes: int  # pinned device memory per client
    compute_percent: int  # active thread percentage, 1..100

    @property
    def memory_mib(self) -> int:
        return max(1, math.ceil(self.memory_bytes / (1 << 20)))


@dataclass(frozen=True)
class MpsDaemon:
    key: str  # the lease it serves
    device_uuid: str
    pipe_dir: Path  # CUDA_MPS_PIPE_DIRECTORY for the lease's clients
    log_dir: Path  # CUDA_MPS_LOG_DIRECTORY: control.log and server.log
    shm_dir: Path  # the clients' and the server's /dev/shm (with private_shm)
    pid: int
    limits: MpsLimits | None


@dataclass
class _Child:
    daemon: MpsDaemon
    proc: subprocess.Popen
    binary: str  # as resolved when the daemon started; the control client is the same binary


def control(binary: str, pipe_dir: Path, command: str, timeout: float) -> subprocess.CompletedProcess[str] | None:
    """Send one command to the daemon on ``pipe_dir`` through the control client; None if it could not run."""
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
    try:
        return subprocess.run([binary], input=command.rstrip("\n") + "\n", env=env, capture_output=True, text=True,
                              timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None


def parse_percent(answer: str) -> float | None:
    """``"25"`` or ``"25.0"`` -> 25.0; anything else None."""
    try:
        value = float(answer.strip())
    except ValueError:
        return None
    return value if 0 < value <= 100 else None


def parse_memory(answer: str) -> int | None:
    """``"20480M"`` or ``"20G"`` -> bytes; anything else None."""
    match = _MEMORY_ANSWER.fullmatch(answer.strip())
    return None if match is None else int(match[1]) * _UNITS[match[2]]


def memory_matches(shown: int, wanted_mib: int) -> bool:
    """The daemon shows what was set, or (limits of a GiB or more) that figure rounded down to whole GiB."""
    wanted = wanted_mib << 20
    return shown == wanted or (wanted >= 1 << 30 and shown == (wanted >> 30) << 30)


class MpsSupervisor:
    def __init__(
        self,
        base_dir: Path,
        binary: str = "nvidia-cuda-mps-control",
        *,
        ready_timeout: float = 10.0,
        stop_timeout: float = 10.0,
        private_shm: bool = False,
    ) -> None:
        self._base_dir = Path(base_dir)
        self._binary = binary
        self._ready_timeout = ready_timeout
        self._stop_timeout = stop_timeout
        self._private_shm = private_shm
        # One lock for all daemons: starts and stops are rare, and holding it
        # through a stop keeps ensure() from starting a second daemon on the
        # same pipe directory while the first one drains.
        self._lock = threading.Lock()
        self._children: dict[str, _Child] = {}

    @property
    def private_shm(self) -> bool:
        return self._private_shm

    def ensure(self, key: str, device_uuid: str, limits: MpsLimits | None = None) -> MpsDaemon:
        """The lease's running daemon, started (or restarted, if it died) as needed, its limits in force."""
        with self._lock:
            child = self._children.get(key)
            if child is None:
                return self._start(key, device_uuid, limits).daemon
            if child.proc.poll() is None:
                return child.daemon
            return self._restart(child).daemon

    def daemons(self) -> list[MpsDaemon]:
        with self._lock:
            return [c.daemon for c in self._children.values()]

    def check(self) -> list[str]:
        """Restart every daemon that died; returns the leases whose daemon was restarted."""
        restarted = []
        with self._lock:
            for key, child in list(self._children.items()):
                if child.proc.poll() is None:
                    continue
                try:
                    self._restart(child)
                except MpsError as exc:
                    # The dead entry stays, so the next check() tries again.
                    _log.error("mps.restart_failed", lease=key, device=child.daemon.device_uuid,
                               exit_code=child.proc.returncode, error=str(exc))
                    continue
                restarted.append(key)
        return restarted

    def stop(self, key: str) -> None:
        """Quit the lease's daemon; a lease with no daemon is already stopped."""
        with self._lock:
            child = self._children.pop(key, None)
            if child is not None:
                self._stop(child)

    def stop_all(self) -> None:
        with self._lock:
            while self._children:
                self._stop(self._children.popitem()[1])

    def _restart(self, dead: _Child) -> _Child:
        d = dead.daemon
        child = self._start(d.key, d.device_uuid, d.limits)
        _log.warning("mps.restarted", lease=d.key, device=d.device_uuid, old_pid=d.pid,
                     exit_code=dead.proc.returncode, pid=child.daemon.pid)
        return child

    def _start(self, key: str, uuid: str, limits: MpsLimits | None) -> _Child:
        binary = shutil.which(self._binary)
        if binary is None:
            raise MpsError(f"{self._binary}: not found (is the CUDA MPS control binary installed and on PATH?)")
        if not _SAFE_KEY.fullmatch(key):
            raise ValueError(f"lease key {key!r} cannot name a directory")
        if not uuid or "/" in uuid or "," in uuid:
            raise ValueError(f"device UUID {uuid!r} is not one device")
        root = self._base_dir / key
        pipe_dir, log_dir, shm_dir = root / "pipe", root / "log", root / "shm"
        for path in (root, pipe_dir, log_dir):
            path.mkdir(parents=True, exist_ok=True)
            # Not left to the umask: clients in containers run as other users
            # and must reach the pipes.
            path.chmod(0o755)
        shm_dir.mkdir(exist_ok=True)
        shm_dir.chmod(0o1777)  # like /dev/shm: anyone creates, only owners remove
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuid, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir),
               "CUDA_MPS_LOG_DIRECTORY": str(log_dir)}
        argv = [binary, "-f"]
        if self._private_shm:
            unshare = shutil.which("unshare")
            if unshare is None:
                raise MpsError("unshare: not found (util-linux); the MPS daemon needs it for a private /dev/shm")
            argv = [unshare, "--mount", "--propagation", "private", "--", "sh", "-c", _PRIVATE_SHM, "weft-mps",
                    str(shm_dir), binary]
        # In the foreground the daemon writes to stdout what it would log; keep
        # it beside control.log rather than in the broker's own log stream.
        with open(log_dir / "control-foreground.log", "ab") as out:
            try:
                proc = subprocess.Popen(
                    argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    # Its own session: a signal to the broker's process group
                    # (Ctrl-C, systemd stop) must not take the daemon down
                    # before the broker quits it in order.
                    start_new_session=True,
                )
            except OSError as exc:
                raise MpsError(f"{binary} -f for lease {key} on {uuid}: {exc}") from exc
        child = _Child(MpsDaemon(key, uuid, pipe_dir, log_dir, shm_dir, proc.pid, limits), proc, binary)
        try:
            self._wait_ready(child)
            if limits is not None:
                self._apply(child, limits)
        except MpsError:
            self._kill(child)
            raise
        self._children[key] = child
        _log.info("mps.started", lease=key, device=uuid, pid=proc.pid, pipe_dir=str(pipe_dir),
                  memory_mib=limits.memory_mib if limits else None,
                  compute_percent=limits.compute_percent if limits else None)
        return child

    def _wait_ready(self, child: _Child) -> None:
        d = child.daemon
        deadline = time.monotonic() + self._ready_timeout
        while True:
            if child.proc.poll() is not None:
                raise MpsError(f"{self._binary} -f for lease {d.key} on {d.device_uuid} exited with code "
                               f"{child.proc.returncode} as it started; see {d.log_dir}")
            answer = control(child.binary, d.pipe_dir, _PROBE, timeout=max(0.1, deadline - time.monotonic()))
            if answer is not None and answer.returncode == 0:
                return
            if time.monotonic() >= deadline:
                raise MpsError(f"{self._binary} -f for lease {d.key} on {d.device_uuid} did not answer within "
                               f"{self._ready_timeout:g}s; see {d.log_dir}")
            time.sleep(0.05)

    def _apply(self, child: _Child, limits: MpsLimits) -> None:
        """Set the server-side limits, then read them back: a daemon that ignored one must not serve the lease."""
        d = child.daemon
        for command in (f"set_default_active_thread_percentage {limits.compute_percent}",
                        f"set_default_device_pinned_mem_limit 0 {limits.memory_mib}M"):
            self._ask(child, command)
        shown = self._ask(child, "get_default_active_thread_percentage")
        if parse_percent(shown) != float(limits.compute_percent):
            raise MpsError(f"MPS daemon for lease {d.key} on {d.device_uuid} shows an active thread percentage of "
                           f"{shown!r} after it was set to {limits.compute_percent}; see {d.log_dir}")
        shown = self._ask(child, "get_default_device_pinned_mem_limit 0")
        memory = parse_memory(shown)
        if memory is None or not memory_matches(memory, limits.memory_mib):
            raise MpsError(f"MPS daemon for lease {d.key} on {d.device_uuid} shows a pinned memory limit of "
                           f"{shown!r} after it was set to {limits.memory_mib}M (does this driver support MPS "
                           f"memory limits? CUDA 11.5 or newer); see {d.log_dir}")

    def _ask(self, child: _Child, command: str) -> str:
        d = child.daemon
        answer = control(child.binary, d.pipe_dir, command, timeout=self._ready_timeout)
        if answer is None or answer.returncode != 0:
            said = "" if answer is None else (answer.stderr or answer.stdout).strip()[:200]
            raise MpsError(f"MPS daemon for lease {d.key} on {d.device_uuid} refused {command!r}"
                           f"{': ' + said if said else ''}; see {d.log_dir}")
        return answer.stdout.strip()

    def _stop(self, child: _Child) -> None:
        d = child.daemon
        killed = False
        if child.proc.poll() is None:
            deadline = time.monotonic() + self._stop_timeout
            answer = control(child.binary, d.pipe_dir, "quit", timeout=self._stop_timeout)
            if answer is None or answer.returncode != 0:
                _log.warning("mps.quit_failed", lease=d.key, device=d.device_uuid, pid=d.pid)
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._kill(child)
                killed = True
        _log.info("mps.stopped", lease=d.key, device=d.device_uuid, pid=d.pid, exit_code=child.proc.returncode,
                  killed=killed)

    def _kill(self, child: _Child) -> None:
        # The whole session's group: the daemon's MPS server goes with it. The
        # child is not yet reaped, so its PID (the group's ID) cannot have been reused.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait()
