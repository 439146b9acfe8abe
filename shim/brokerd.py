"""``weft broker``: the per-node GPU broker process.

Assembles a backend (NVML, or simulated devices where there is no GPU), the
lease store, MPS daemons (NVML only), the gRPC and hook endpoints, the
enforcement watchdog and the metrics endpoint. At start it releases leases
whose containers died while it was down; unbound leases wait for the agent's
reconcile. SIGTERM stops it cleanly: leases stay on disk; the MPS daemons it
supervised are stopped with it and started again on demand.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from shim import log
from shim.broker.metrics import BrokerMetrics
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
    enforce: str = "log"
    watchdog_interval: float = 1.0


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
        return backend, MpsSupervisor(cfg.state_dir / "mps")
    raise ConfigError(f"--backend: {cfg.backend!r} is not nvml or simulated")


def run(cfg: BrokerConfig) -> int:
    if cfg.enforce not in ("log", "kill"):
        raise ConfigError(f"--enforce: {cfg.enforce!r} is not log or kill")
    cfg.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    backend, mps = _backend(cfg)
    store = LeaseStore(cfg.state_dir)
    service = LeaseService(backend, store, mps)
    released = service.release_dead()
    metrics = BrokerMetrics(service)
    server = BrokerServer(cfg.socket, service)
    server.start()
    watchdog = Watchdog(service, metrics, interval=cfg.watchdog_interval, action=cfg.enforce, mps=mps)
    watchdog.start()
    http = None
    if cfg.metrics_address:
        http = HttpEndpoint(cfg.metrics_address, metrics, lambda: (True, backend.name))
        http.start()
    _log.info("broker.started", socket=str(cfg.socket), backend=backend.name, devices=len(service.devices),
              leases=len(service.leases()), released_dead=released, enforce=cfg.enforce,
              http=http.address if http else None, pid=os.getpid())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        _log.info("broker.stopping")
        watchdog.stop()
        if http is not None:
            http.stop()
        server.stop()
        if mps is not None:
            mps.stop_all()
        backend.close()
        store.close()
        _log.info("broker.stopped")
    return 0
