"""The live test's broker: the node's own when one answers, else a private one on NVML for the test's length.

A private broker runs with ``--enforce kill`` and its MPS daemons' shared
memory private to each, as the node's broker would; it is stopped when the
test ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from shim._pb import broker_pb2 as pb
from shim._pb import broker_pb2_grpc as pb_grpc


class NoBroker(Exception):
    """A private broker could not be started or does not answer (the message says why)."""


class BrokerLink:
    def __init__(self) -> None:
        self.socket: Path | None = None
        self.channel: grpc.Channel | None = None
        self.stub: pb_grpc.BrokerStub | None = None
        self.private: Any = None  # shim.brokerd.Broker, when none answered

    def connect(self, socket: Path) -> str | None:
        """The backend of the broker answering at ``socket`` (and this link now talks to it); None: none answers."""
        if not socket.exists():
            return None
        channel = grpc.insecure_channel(f"unix://{socket}")
        stub = pb_grpc.BrokerStub(channel)
        try:
            backend = stub.Devices(pb.DevicesRequest(), timeout=5).backend
        except grpc.RpcError:
            channel.close()
            return None
        self.socket, self.channel, self.stub = socket, channel, stub
        return backend

    def start_private(self, work: Path, *, mps_binary: str, ready_timeout: float, nvml_library: Any = None,
                      proc_root: Path = Path("/proc")) -> Path:
        """Start a private broker in ``work`` and connect to it; its socket. ``proc_root``: where its NVML backend
        reads MIG capability files (a stand-in tree in tests)."""
        from shim.broker.mps import MpsSupervisor
        from shim.broker.nvml import NvmlBackend, NvmlError
        from shim.brokerd import Broker, BrokerConfig

        cfg = BrokerConfig(socket=work / "broker.sock", state_dir=work / "state", backend="nvml",
                           enforce="kill", watchdog_interval=0.5, mps_dir=work / "mps")
        try:
            backend = NvmlBackend(library=nvml_library, proc_root=proc_root)
        except NvmlError as exc:
            raise NoBroker(f"a private broker cannot read NVML: {exc}") from None
        mps = MpsSupervisor(cfg.mps_dir, mps_binary, ready_timeout=ready_timeout, private_shm=True)
        try:
            self.private = Broker(cfg, backend=backend, mps=mps).start()
        except BaseException:
            backend.close()
            raise
        if self.connect(cfg.socket) is None:
            raise NoBroker(f"the private broker at {cfg.socket} does not answer")
        return cfg.socket

    def close(self) -> list[str]:
        """Stop a private broker and close the channel; what did not go cleanly."""
        problems: list[str] = []
        if self.private is not None:
            try:
                self.private.stop()
            except Exception as exc:  # noqa: BLE001 - report it and go on cleaning up
                problems.append(f"the private broker did not stop cleanly: {exc}")
        if self.channel is not None:
            self.channel.close()
        return problems
