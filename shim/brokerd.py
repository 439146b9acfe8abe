"""``weft broker``: the per-node GPU broker process.

Assembles a backend (NVML, or simulated devices where there is no GPU), the
lease store, MPS daemons (NVML only: one per shared lease, and a pool started
ahead for the next ones), the gRPC and hook endpoints, the enforcement
watchdog and the metrics endpoint. At start it
releases leases whose containers died while it was down and starts the MPS
daemon of every shared lease it keeps; unbound leases wait for the agent's
reconcile. SIGTERM stops it cleanly: leases stay on disk; the MPS daemons it
supervised are stopped with it (their clients lose their server) and started
again when it starts.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from shim import log, sdnotify, stopping
from shim.broker.metrics import BrokerMetrics
from shim.broker.mps import DEFAULT_POOL
from shim.broker.server import BrokerServer
from shim.broker.service import LeaseService
from shim.broker.simulated import SimulatedBackend
from shim.broker.watchdog import Watchdog
from shim.errors import ConfigError
from shim.httpd import HttpEndpoint
from shim.state.leases import LeaseStore

_log = log.get("weft.broker")


@dataclass(frozen=True)
class BrokerConfig:
    socket: Path
    state_dir: Path
    backend: str
    simulated_devices: str = "2x80GiB"
    metrics_address: str = ""
    # kill: a container over its lease (or outside its MPS server) loses its processes; log: it is only reported.
    enforce: str = "kill"
    watchdog_interval: float = 1.0
    # Pipe, log and shared-memory directories of the leases' MPS daemons; default: "mps" beside the socket
    # (/run/weft/mps on an installed node: a tmpfs, as MPS's shared memory should be).
    mps_dir: Path | None = None
    # Idle MPS daemons kept started per device, so a shared lease need not wait for one (0: none).
    mps_pool: int = DEFAULT_POOL


def _backend(cfg: BrokerConfig):
    if cfg.backend == "simulated":
        try:
            return SimulatedBackend(cfg.simulated_devices), None
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if cfg.backend == "nvml":
        from shim.broker.mps import MpsSupervisor
        from shim.broker.nvml import NvmlBackend, NvmlUnavailable

        try:
            backend = NvmlBackend()
        except NvmlUnavailable as exc:
            raise ConfigError(f"--backend nvml: {exc}") from None
        return backend, MpsSupervisor(cfg.mps_dir or cfg.socket.parent / "mps", private_shm=True, pool=cfg.mps_pool)
    raise ConfigError(f"--backend: {cfg.backend!r} is not nvml or simulated")


class Broker:
    """The assembled broker, started and stopped as one: ``run`` serves it until a signal, ``weft gpu-check``
    runs a private one in its own process (with the backend and MPS supervisor it is given)."""

    def __init__(self, cfg: BrokerConfig, backend=None, mps=None) -> None:
        if cfg.enforce not in ("log", "kill"):
            raise ConfigError(f"--enforce: {cfg.enforce!r} is not log or kill")
        if cfg.mps_pool < 0:
            raise ConfigError(f"--mps-pool: {cfg.mps_pool} is not 0 or more")
        self.cfg = cfg
        cfg.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if backend is None:
            backend, mps = _backend(cfg)
        self.backend, self.mps = backend, mps
        self.store = LeaseStore(cfg.state_dir)
        self.service = LeaseService(backend, self.store, mps)
        self.metrics = BrokerMetrics(self.service)
        self.server = BrokerServer(cfg.socket, self.service)
        self.watchdog = Watchdog(self.service, self.metrics, interval=cfg.watchdog_interval, action=cfg.enforce,
                                 mps=mps)
        self.http: HttpEndpoint | None = None

    def start(self) -> Broker:
        released = self.service.release_dead()
        no_daemon = self.service.restore_mps()
        self.service.warm_mps()
        self.server.start()
        self.watchdog.start()
        if self.cfg.metrics_address:
            self.http = HttpEndpoint(self.cfg.metrics_address, self.metrics, lambda: (True, self.backend.name))
            self.http.start()
        _log.info("broker.started", socket=str(self.cfg.socket), backend=self.backend.name,
                  devices=len(self.service.devices), leases=len(self.service.leases()), released_dead=released,
                  without_mps=no_daemon, enforce=self.cfg.enforce,
                  http=self.http.address if self.http else None, pid=os.getpid())
        return self

    def stop(self) -> None:
        _log.info("broker.stopping")
        self.watchdog.stop()
        if self.http is not None:
            self.http.stop()
        self.server.stop()
        if self.mps is not None:
            self.mps.stop_all()
        self.backend.close()
        self.store.close()
        _log.info("broker.stopped")


def run(cfg: BrokerConfig) -> int:
    broker = Broker(cfg)
    signals = stopping.Signals()  # they only note the signal; this thread looks (shim.stopping)
    broker.start()
    sdnotify.notify()  # the agent's unit is ordered after this one: it starts once the broker serves
    try:
        signals.wait(threading.Event())
    finally:
        broker.stop()
    return 0
