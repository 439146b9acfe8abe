"""A real ``weft agent`` process in front of a harness containerd.

Started as a subprocess of the test (never in-process), so tests see exactly
what kubelet would: a socket, logs on stderr, metrics over HTTP, signals.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from shim.localfabric import cpuset, daemon
from shim.localfabric.containerd import Containerd
from shim.shadowhost.volumes import unmount_under

# Ports handed out by free_port, each held (a lock on a file named for it) for as long as this process lives:
# an agent restarted by a test binds its port again, and another process must not have drawn it meanwhile.
PORT_LOCKS = Path("/run/lock/weft-ports")
_held: dict[int, int] = {}


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, drawn from below the kernel's ephemeral range, and kept from every other
    process that draws one here for as long as this one lives.

    A port the kernel hands out for ``bind(0)`` is handed out again to the next
    ``bind(0)``, in this namespace or in a node's own (the agent's tunnel port
    is one): a chosen port from that range once collided with it. And free
    now is not free later: a CI run's test restarted an agent on its port a
    second after stopping it, and a test on another worker had drawn that
    port in between.
    """
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    floor = min(10000, low // 2)
    PORT_LOCKS.mkdir(parents=True, exist_ok=True)
    for _ in range(200):
        port = random.randrange(floor, low)
        if port in _held:
            continue
        fd = os.open(PORT_LOCKS / str(port), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another process holds it
            os.close(fd)
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                os.close(fd)
                continue
        _held[port] = fd
        return port
    raise RuntimeError(f"no free port on {host} in {floor}-{low - 1}")


@dataclass
class AgentProcess(daemon.Started):
    containerd: Containerd
    workdir: Path
    name: str = "weft"
    extra_args: list[str] = field(default_factory=list)
    metrics_port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    # Run inside this network namespace, as on a node; its metrics then listen on ``metrics_host``, an address of
    # that namespace the test can reach. ``nsenter --net``: the host's mounts stay (/sys/fs/cgroup among them), as
    # for an agent run by systemd; ``ip netns exec`` would mount a sysfs of its own.
    netns: str = ""
    metrics_host: str = "127.0.0.1"
    cpus: str = ""  # the CPUs it runs on, as its node's (``shim.localfabric.cpuset``); "": all

    @property
    def socket(self) -> Path:
        return self.workdir / f"{self.name}.sock"

    @property
    def address(self) -> str:
        return f"unix://{self.socket}"

    @property
    def state_dir(self) -> Path:
        return self.workdir / f"{self.name}-state"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.metrics_host}:{self.metrics_port}"

    def argv(self) -> list[str]:
        return cpuset.pinned([
            *(["nsenter", f"--net=/run/netns/{self.netns}"] if self.netns else []),
            sys.executable, "-m", "shim", "agent",
            "--socket", str(self.socket),
            "--containerd-socket", str(self.containerd.socket),
            "--state-dir", str(self.state_dir),
            # The CDI specs this containerd reads (a stand-in for containerd in a test has none).
            *(["--cdi-spec-dirs", str(cdi)] if (cdi := getattr(self.containerd, "cdi_spec_dir", None)) else []),
            "--metrics-address", f"{self.metrics_host}:{self.metrics_port}",
            *self.extra_args,
        ], self.cpus)

    def start(self, timeout: float = 20.0) -> AgentProcess:
        if not self.metrics_port:
            self.metrics_port = free_port()
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=log, start_new_session=True,
                                         env={**os.environ, **self.env})
        finally:
            log.close()
        daemon.wait_up(self.proc, lambda: self.socket.exists() and self._healthy(), timeout,
                       lambda code: f"weft agent exited with {code}:\n{self.log_text()[-3000:]}",
                       lambda: f"weft agent did not come up within {timeout}s:\n{self.log_text()[-3000:]}")
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.metrics_url + "/healthz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        code, self.proc = daemon.stop(self.proc, sig, timeout), None
        return code

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.release_mounts()

    def release_mounts(self) -> None:
        """The tmpfs of its shadows' copied volumes: they outlive an agent (a restart keeps them), not its fabric."""
        unmount_under(self.state_dir)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def log_text(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")
        return ""

    def events(self) -> list[dict]:
        return daemon.json_lines(self.log_text())

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.metrics_url + "/metrics", timeout=5) as r:
            return r.read().decode()

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.metrics_url + path, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()


def stop_all(agents: Iterable[AgentProcess]) -> None:
    """Stop each agent and release the mounts it left (its copied volumes), going on past any that fails:
    what a fabric's close does for its agents."""
    for agent in agents:
        with contextlib.suppress(Exception):
            agent.stop()
            agent.release_mounts()
