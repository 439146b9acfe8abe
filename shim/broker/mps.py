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

Starting a daemon and waiting for it to answer is most of what a shared
lease adds to a container's start, so the supervisor can keep a pool: a few
daemons per device started ahead, each in a directory named by the lease ID
it will serve, with no client (so no MPS server, no GPU context), each given
(and read back) the limits its device's last lease asked for. ``take`` hands
one out: where the lease asks the same limits, as replicas of one workload
do, there is nothing left to do; otherwise its limits are set and read back
as a freshly started one's. Either way they are in force before any client
can reach it, as they always were. The pool is filled again in the
background, a little after a take (not beside the container that is
starting) and at the lowest CPU priority until the new daemon is ready. The
idle daemons are quit, and their directories removed, when
the broker stops; those a killed broker left are found by their ``pooled``
mark at the next start.
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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

from shim import log
from shim.errors import WeftError
from shim.state.leases import new_lease_id

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
# In a pooled daemon's directory until a lease takes it: what a broker started again finds of one it left.
POOLED_MARK = "pooled"
_PID_FILE = "daemon.pid"
# Idle daemons per device an installed broker keeps (``weft broker --mps-pool``).
DEFAULT_POOL = 1
# After a daemon could not be started ahead, the pool waits this long before it tries again.
_POOL_RETRY_S = 5.0
# After a lease took a daemon, the pool waits this long before it starts another for the device: the lease's
# container is starting meanwhile.
_REFILL_AFTER_S = 0.5
# The pool's work runs at this niceness until its daemon is ready (then given the broker's own back). Only
# where the broker may raise a priority again: as root.
_IDLE_NICE = 19
_NICE = shutil.which("nice") if os.geteuid() == 0 else None


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
    # Started ahead, and not yet ready: it and its control clients run at the lowest CPU priority, so that
    # filling the pool never slows the start of the container that just took a daemon from it.
    background: bool = False

    @property
    def prefix(self) -> list[str]:
        return [_NICE, "-n", str(_IDLE_NICE)] if self.background and _NICE else []


def control(binary: str, pipe_dir: Path, command: str, timeout: float,
            prefix: Sequence[str] = ()) -> subprocess.CompletedProcess[str] | None:
    """Send one command to the daemon on ``pipe_dir`` through the control client; None if it could not run.

    ``prefix``: what the client is run under (``nice``, for work in the background)."""
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
    try:
        return subprocess.run([*prefix, binary], input=command.rstrip("\n") + "\n", env=env, capture_output=True,
                              text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None


def control_all(binary: str, pipe_dir: Path, commands: list[str], timeout: float,
                prefix: Sequence[str] = ()) -> list[subprocess.CompletedProcess[str] | None]:
    """Send commands that do not depend on each other, each through a control client of its own, side by side.

    A lease's start waits on these: every client is started and given its
    command before any answer is read, so they cost about one client's start
    rather than one each. None for a client that could not run or did not
    answer in time; every client is reaped, whatever happens.
    """
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
    running: list[subprocess.Popen[str] | None] = []
    answers: list[subprocess.CompletedProcess[str] | None] = []
    try:
        for command in commands:
            try:
                proc = subprocess.Popen([*prefix, binary], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, env=env, text=True)
            except OSError:
                running.append(None)
                continue
            running.append(proc)
            assert proc.stdin is not None
            try:  # one short line: the pipe takes it whole, whether or not the client reads it yet
                proc.stdin.write(command.rstrip("\n") + "\n")
                proc.stdin.close()
            except OSError:
                pass  # it exited already; its answer (an error) is read below
            proc.stdin = None  # written and closed: communicate() only reads
        deadline = time.monotonic() + timeout
        for proc in running:
            if proc is None:
                answers.append(None)
                continue
            try:
                out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                answers.append(None)
                continue
            answers.append(subprocess.CompletedProcess([binary], proc.returncode, out, err))
    finally:
        for proc in running:
            if proc is not None and proc.poll() is None:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.communicate(timeout=1.0)
    return answers


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
        pool: int = 0,
    ) -> None:
        if pool < 0:
            raise ValueError(f"MPS pool of {pool} daemons per device: must be 0 or more")
        self._base_dir = Path(base_dir)
        self._binary = binary
        self._ready_timeout = ready_timeout
        self._stop_timeout = stop_timeout
        self._private_shm = private_shm
        self._pool = pool
        # One lock for the leases' daemons: starts and stops are rare, and holding it
        # through a stop keeps ensure() from starting a second daemon on the
        # same pipe directory while the first one drains.
        self._lock = threading.Lock()
        self._children: dict[str, _Child] = {}
        # The pool: idle daemons per device, and how many are being started. Its own
        # condition, so that a daemon started ahead never waits on a lease's stop.
        self._pool_cv = threading.Condition()
        self._idle: dict[str, list[_Child]] = {}
        self._starting: dict[str, int] = {}
        self._failed_at: dict[str, float] = {}
        self._ahead: dict[str, MpsLimits] = {}  # per device: the limits its last lease asked for
        self._not_before: dict[str, float] = {}  # per device: when its pool may be filled again after a take
        self._filler: threading.Thread | None = None
        self._closed = False

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

    def take(self, device_uuid: str, limits: MpsLimits) -> MpsDaemon:
        """A daemon for a new lease on the device, its limits in force; its key is the lease's ID.

        One the pool started ahead when it has one, else one started now. A
        pooled daemon already holds the limits the device's last lease asked
        for (set and read back when it was started): where this lease asks the
        same, as a workload's replicas do, nothing is left to do; otherwise its
        limits are set and read back now, and where it will not take them a
        daemon is started for the lease instead. The pool is filled again
        behind it.
        """
        _check_device(device_uuid)
        started = time.monotonic()
        child = self._pop_idle(device_uuid, limits)
        # Under the lock, as ensure() is: stop_all() waits for a daemon being given its limits, and stops it.
        with self._lock:
            if child is not None:
                try:
                    return self._hand_out(child, limits, started)
                except MpsError as exc:
                    _log.warning("mps.pool_refused", lease=child.daemon.key, device=device_uuid, error=str(exc))
            child = self._start(new_lease_id(), device_uuid, limits)
        self._fill(device_uuid)
        return child.daemon

    def _hand_out(self, child: _Child, limits: MpsLimits, started: float) -> MpsDaemon:
        """A pooled daemon made the lease's: its limits set and read back unless it holds them; with the lock held."""
        d = child.daemon
        ahead = d.limits == limits
        try:
            if not ahead:
                self._apply(child, limits)
            (d.log_dir.parent / POOLED_MARK).unlink(missing_ok=True)
        except BaseException:
            self._kill(child)
            (d.log_dir.parent / POOLED_MARK).unlink(missing_ok=True)  # its log stays; no sweep need quit it
            raise
        child.daemon = replace(d, limits=limits)
        self._children[d.key] = child
        _log.info("mps.started", lease=d.key, device=d.device_uuid, pid=d.pid, pipe_dir=str(d.pipe_dir),
                  memory_mib=limits.memory_mib, compute_percent=limits.compute_percent, pooled=True,
                  limits_ahead=ahead, ms=round((time.monotonic() - started) * 1000, 1))
        return child.daemon

    def warm(self, device_uuids: Iterable[str]) -> None:
        """Start filling the pool for these devices (nothing without a pool); what a killed broker's pool left
        goes first."""
        self._sweep_left()  # a broker killed with a pool may be started again without one
        for uuid in device_uuids:
            self._fill(uuid)

    def daemons(self) -> list[MpsDaemon]:
        """The leases' daemons (not the pool's idle ones)."""
        with self._lock:
            return [c.daemon for c in self._children.values()]

    def idle(self) -> list[MpsDaemon]:
        """The pool's daemons no lease has taken yet."""
        with self._pool_cv:
            return [c.daemon for children in self._idle.values() for c in children]

    def check(self) -> list[str]:
        """Restart every daemon that died; returns the leases whose daemon was restarted.

        An idle daemon that died is dropped by the filler, which starts another in its place.
        """
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
        with self._pool_cv:
            self._pool_cv.notify_all()  # the filler drops idle ones that died and starts others
        return restarted

    def stop(self, key: str) -> None:
        """Quit the lease's daemon; a lease with no daemon is already stopped."""
        with self._lock:
            child = self._children.pop(key, None)
            if child is not None:
                self._stop(child)

    def stop_all(self) -> None:
        with self._pool_cv:
            self._closed = True
            self._pool_cv.notify_all()
            filler = self._filler
        if filler is not None:
            # A daemon being started ahead is ready (or given up on) within its ready timeout and its limits
            # within two more; the filler then sees the close and quits it.
            filler.join(3 * self._ready_timeout + self._stop_timeout + 1.0)
        with self._pool_cv:
            idle = [c for children in self._idle.values() for c in children]
            self._idle.clear()
        for child in idle:
            self._stop(child)
            shutil.rmtree(child.daemon.log_dir.parent, ignore_errors=True)  # it served no lease: no log to keep
        with self._lock:
            while self._children:
                self._stop(self._children.popitem()[1])

    # -- the pool ----------------------------------------------------------------
    def _pop_idle(self, uuid: str, limits: MpsLimits) -> _Child | None:
        """A live idle daemon of the device, one already holding ``limits`` first; the next ones get them ahead."""
        with self._pool_cv:
            self._ahead[uuid] = limits
            # Not while the container that asked is starting: a daemon started beside it slows its start more
            # than the next lease would wait for one of its own.
            self._not_before[uuid] = time.monotonic() + _REFILL_AFTER_S
            self._prune_dead()
            children = self._idle.get(uuid, [])
            if not children:
                return None
            child = next((c for c in children if c.daemon.limits == limits), children[0])
            children.remove(child)
            self._pool_cv.notify_all()  # a place to fill
            return child

    def _fill(self, uuid: str) -> None:
        """Have the filler keep ``pool`` idle daemons for the device."""
        if not self._pool:
            return
        with self._pool_cv:
            if self._closed:
                return
            self._idle.setdefault(uuid, [])
            if self._filler is None:
                self._filler = threading.Thread(target=self._filling, name="weft-mps-pool", daemon=True)
                self._filler.start()
            self._pool_cv.notify_all()

    def _wanted(self) -> str | None:
        """A device short of idle daemons and not waiting out a failure; with the condition held.

        Idle daemons that died meanwhile are dropped first, so their places are filled.
        """
        now = time.monotonic()
        self._prune_dead()
        for uuid, children in self._idle.items():
            if (len(children) + self._starting.get(uuid, 0) < self._pool
                    and now - self._failed_at.get(uuid, -_POOL_RETRY_S) >= _POOL_RETRY_S
                    and now >= self._not_before.get(uuid, now)):
                return uuid
        return None

    def _prune_dead(self) -> None:
        """Drop the idle daemons that exited; with the condition held."""
        for children in self._idle.values():
            for dead in [c for c in children if c.proc.poll() is not None]:
                children.remove(dead)
                self._drop(dead, "exited")

    def _wait_s(self) -> float:
        """How long the filler may sleep: until the next device it holds back is due, at most the retry pause."""
        now = time.monotonic()
        return min([_POOL_RETRY_S, *(t - now for t in self._not_before.values() if t > now)])

    def _filling(self) -> None:
        while True:
            with self._pool_cv:
                while not self._closed and (uuid := self._wanted()) is None:
                    self._pool_cv.wait(self._wait_s())
                if self._closed:
                    return
                self._starting[uuid] = self._starting.get(uuid, 0) + 1
                limits = self._ahead.get(uuid)
            key = new_lease_id()
            child: _Child | None = None
            try:
                child = self._spawn(key, uuid, pooled=True)
                # The device's last lease's limits, read back; its pipe directory is in no container until a
                # lease takes it, so nothing can change them meanwhile.
                if limits is not None and not self._closed:
                    self._apply(child, limits)
                    child.daemon = replace(child.daemon, limits=limits)
                _foreground(child)  # the MPS server it starts for its lease inherits its priority
            except Exception as exc:  # noqa: BLE001 - the filler must outlive any one daemon's failure
                if child is not None:
                    self._kill(child)
                with self._pool_cv:
                    self._starting[uuid] -= 1
                    self._failed_at[uuid] = time.monotonic()
                error = exc.message if isinstance(exc, MpsError) else f"{type(exc).__name__}: {exc}"
                tail = _log_tail(self._base_dir / key / "log")
                shutil.rmtree(self._base_dir / key, ignore_errors=True)  # its log's end is in the event below
                _log.error("mps.pool_failed", device=uuid, error=error, log=tail, retry_s=_POOL_RETRY_S)
                continue
            with self._pool_cv:
                self._starting[uuid] -= 1
                closed = self._closed
                if not closed:
                    self._idle[uuid].append(child)
            if closed:
                self._stop(child)
                shutil.rmtree(child.daemon.log_dir.parent, ignore_errors=True)
                return
            _log.info("mps.pooled", lease=key, device=uuid, pid=child.daemon.pid,
                      memory_mib=limits.memory_mib if limits else None,
                      compute_percent=limits.compute_percent if limits else None)

    def _drop(self, child: _Child, why: str) -> None:
        d = child.daemon
        _log.warning("mps.pool_dropped", lease=d.key, device=d.device_uuid, pid=d.pid, why=why,
                     exit_code=child.proc.returncode)
        shutil.rmtree(d.log_dir.parent, ignore_errors=True)

    def _sweep_left(self) -> None:
        """Quit the pooled daemons a broker killed before it could stop them, and remove their directories.

        Each is asked to quit, and killed where it does not: its PID is in its
        directory, and a process is only killed where it still has that pipe
        directory (a PID can have been reused since).
        """
        if not self._base_dir.is_dir():
            return
        binary = shutil.which(self._binary)
        for mark in self._base_dir.glob(f"*/{POOLED_MARK}"):
            root = mark.parent
            pid = _read_pid(root / _PID_FILE)
            if binary is not None:
                control(binary, root / "pipe", "quit", timeout=self._stop_timeout)
            killed = False
            if pid is not None and not _gone(pid, root / "pipe", self._stop_timeout):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)  # it leads its own session: its server goes with it
                    killed = True
            shutil.rmtree(root, ignore_errors=True)
            _log.info("mps.pool_swept", lease=root.name, pid=pid, killed=killed)

    # -- one daemon ----------------------------------------------------------------
    def _restart(self, dead: _Child) -> _Child:
        d = dead.daemon
        child = self._start(d.key, d.device_uuid, d.limits)
        _log.warning("mps.restarted", lease=d.key, device=d.device_uuid, old_pid=d.pid,
                     exit_code=dead.proc.returncode, pid=child.daemon.pid)
        return child

    def _start(self, key: str, uuid: str, limits: MpsLimits | None) -> _Child:
        """A daemon for the lease, its limits set and read back; with the lock held."""
        started = time.monotonic()
        child = self._spawn(key, uuid, limits=limits)
        try:
            if limits is not None:
                self._apply(child, limits)
        except MpsError:
            self._kill(child)
            raise
        self._children[key] = child
        _log.info("mps.started", lease=key, device=uuid, pid=child.daemon.pid, pipe_dir=str(child.daemon.pipe_dir),
                  memory_mib=limits.memory_mib if limits else None,
                  compute_percent=limits.compute_percent if limits else None, pooled=False, limits_ahead=False,
                  ms=round((time.monotonic() - started) * 1000, 1))
        return child

    def _spawn(self, key: str, uuid: str, *, limits: MpsLimits | None = None, pooled: bool = False) -> _Child:
        """Start the daemon in the key's directories and wait until it answers; no limits are set here."""
        binary = shutil.which(self._binary)
        if binary is None:
            raise MpsError(f"{self._binary}: not found (is the CUDA MPS control binary installed and on PATH?)")
        if not _SAFE_KEY.fullmatch(key):
            raise ValueError(f"lease key {key!r} cannot name a directory")
        _check_device(uuid)
        root = self._base_dir / key
        pipe_dir, log_dir, shm_dir = root / "pipe", root / "log", root / "shm"
        for path in (root, pipe_dir, log_dir):
            path.mkdir(parents=True, exist_ok=True)
            # Not left to the umask: clients in containers run as other users
            # and must reach the pipes.
            path.chmod(0o755)
        shm_dir.mkdir(exist_ok=True)
        shm_dir.chmod(0o1777)  # like /dev/shm: anyone creates, only owners remove
        if pooled:
            (root / POOLED_MARK).touch()
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuid, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir),
               "CUDA_MPS_LOG_DIRECTORY": str(log_dir)}
        nice = [_NICE, "-n", str(_IDLE_NICE)] if pooled and _NICE else []
        argv = [*nice, binary, "-f"]
        if self._private_shm:
            unshare = shutil.which("unshare")
            if unshare is None:
                raise MpsError("unshare: not found (util-linux); the MPS daemon needs it for a private /dev/shm")
            argv = [*nice, unshare, "--mount", "--propagation", "private", "--", "sh", "-c", _PRIVATE_SHM, "weft-mps",
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
        child = _Child(MpsDaemon(key, uuid, pipe_dir, log_dir, shm_dir, proc.pid, limits), proc, binary,
                       background=pooled)
        if pooled:  # what a broker started again needs to stop it, were this one killed
            (root / _PID_FILE).write_text(f"{proc.pid}\n")
        try:
            self._wait_ready(child)
        except MpsError:
            self._kill(child)
            raise
        return child

    def _wait_ready(self, child: _Child) -> None:
        d = child.daemon
        deadline = time.monotonic() + self._ready_timeout
        pause = 0.002  # a daemon answers within milliseconds; a slow one is not asked more than 20 times a second
        while True:
            if child.proc.poll() is not None:
                raise MpsError(f"{self._binary} -f for lease {d.key} on {d.device_uuid} exited with code "
                               f"{child.proc.returncode} as it started; see {d.log_dir}")
            answer = control(child.binary, d.pipe_dir, _PROBE, timeout=max(0.1, deadline - time.monotonic()),
                             prefix=child.prefix)
            if answer is not None and answer.returncode == 0:
                return
            if time.monotonic() >= deadline:
                raise MpsError(f"{self._binary} -f for lease {d.key} on {d.device_uuid} did not answer within "
                               f"{self._ready_timeout:g}s; see {d.log_dir}")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _apply(self, child: _Child, limits: MpsLimits) -> None:
        """Set the server-side limits, then read them back: a daemon that ignored one must not serve the lease."""
        d = child.daemon
        self._ask(child, f"set_default_active_thread_percentage {limits.compute_percent}",
                  f"set_default_device_pinned_mem_limit 0 {limits.memory_mib}M")
        percent, memory_shown = self._ask(child, "get_default_active_thread_percentage",
                                          "get_default_device_pinned_mem_limit 0")
        if parse_percent(percent) != float(limits.compute_percent):
            raise MpsError(f"MPS daemon for lease {d.key} on {d.device_uuid} shows an active thread percentage of "
                           f"{percent!r} after it was set to {limits.compute_percent}; see {d.log_dir}")
        memory = parse_memory(memory_shown)
        if memory is None or not memory_matches(memory, limits.memory_mib):
            raise MpsError(f"MPS daemon for lease {d.key} on {d.device_uuid} shows a pinned memory limit of "
                           f"{memory_shown!r} after it was set to {limits.memory_mib}M (does this driver support MPS "
                           f"memory limits? CUDA 11.5 or newer); see {d.log_dir}")

    def _ask(self, child: _Child, *commands: str) -> list[str]:
        """Each command's answer; MpsError naming the first one the daemon refused."""
        d = child.daemon
        answers = control_all(child.binary, d.pipe_dir, list(commands), timeout=self._ready_timeout,
                              prefix=child.prefix)
        for command, answer in zip(commands, answers, strict=True):
            if answer is None or answer.returncode != 0:
                said = "" if answer is None else (answer.stderr or answer.stdout).strip()[:200]
                raise MpsError(f"MPS daemon for lease {d.key} on {d.device_uuid} refused {command!r}"
                               f"{': ' + said if said else ''}; see {d.log_dir}")
        return [a.stdout.strip() for a in answers if a is not None]

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


def _check_device(uuid: str) -> None:
    if not uuid or "/" in uuid or "," in uuid:
        raise ValueError(f"device UUID {uuid!r} is not one device")


def _log_tail(log_dir: Path, limit: int = 400) -> str:
    """The end of a daemon's logs, for an error whose directory is removed."""
    text = ""
    for name in ("control-foreground.log", "control.log"):
        with contextlib.suppress(OSError):
            text += (log_dir / name).read_text(errors="replace")
    return text.strip()[-limit:]


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _gone(pid: int, pipe_dir: Path, timeout: float) -> bool:
    """Whether the daemon on ``pipe_dir`` with this PID has exited, waiting up to ``timeout`` for it."""
    needle = f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}\0".encode()
    deadline = time.monotonic() + timeout
    while True:
        try:
            if needle not in Path(f"/proc/{pid}/environ").read_bytes() + b"\0":
                return True  # another process has the PID now
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                return True  # exited; its parent (not this broker) reaps it
        except (OSError, IndexError):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _foreground(child: _Child) -> None:
    """Give a daemon started in the background the broker's own CPU priority back."""
    if child.background and _NICE:
        os.setpriority(os.PRIO_PROCESS, child.proc.pid, os.getpriority(os.PRIO_PROCESS, 0))
    child.background = False
