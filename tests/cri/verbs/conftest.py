"""The fixtures every verb test stands on: containerd, the fabric, the mesh and the GPU broker, all in-process.

Nothing here needs root or a real containerd: containerd is a recording gRPC
server on a unix socket in the test's directory (``fakes.RecordingContainerd``),
the state store is the real SQLite one in that directory, and the broker is
the real broker service over the simulated backend, served on a socket of
its own. Only the mesh is a fake (``fakes.FakeMesh``): the peer's side is
tested in ``tests/shadowhost``.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from shim._pb import broker_pb2_grpc
from shim.broker.client import BrokerClient
from shim.broker.server import BrokerServicer
from shim.broker.service import LeaseService
from shim.broker.simulated import SimulatedBackend
from shim.cri.fabric import Fabric
from shim.cri.passthrough import Upstream
from shim.crishared.remote import Remote
from shim.metrics import Metrics
from shim.origin.context import Origin
from shim.state.agent import AgentStore
from shim.state.leases import LeaseStore
from tests.cri.verbs.fakes import HOST, FakeHost, FakeMesh, FakeStreams, RecordingContainerd, add_remote


@pytest.fixture
def containerd(tmp_path: Path) -> Iterator[RecordingContainerd]:
    server = RecordingContainerd(tmp_path / "containerd.sock")
    yield server
    server.close()


@pytest.fixture
def fabric(tmp_path: Path, containerd: RecordingContainerd) -> Iterator[Fabric]:
    """A standalone agent's fabric (no mesh, no broker) over the recording containerd and a real state store."""
    upstream = Upstream(str(containerd.socket))
    store = AgentStore(tmp_path / "state")
    fab = Fabric(upstream, store, broker=None, metrics=Metrics())
    yield fab
    store.close()
    upstream.close()


@pytest.fixture
def mesh(fabric: Fabric) -> FakeMesh:
    """This node (gpu-1) in a mesh with one CPU host (cpu-1), and a streaming relay for remote sessions."""
    fabric.origin = Origin(FakeMesh(), streams=FakeStreams())
    return fabric.origin.mesh


@pytest.fixture
def broker(tmp_path: Path, fabric: Fabric) -> Iterator[LeaseService]:
    """The real GPU broker over two simulated 80 GiB GPUs, on its own socket; the fabric's client dials it."""
    service = LeaseService(SimulatedBackend("2x80GiB"), LeaseStore(tmp_path / "broker"), None)
    pool = ThreadPoolExecutor(2, thread_name_prefix="fake-broker")
    server = grpc.server(pool)
    broker_pb2_grpc.add_BrokerServicer_to_server(BrokerServicer(service), server)
    socket = tmp_path / "broker.sock"
    server.add_insecure_port(f"unix:{socket}")
    server.start()
    fabric.broker = BrokerClient(str(socket))
    yield service
    fabric.broker.close()
    server.stop(0).wait()
    pool.shutdown(wait=True)
    service.store.close()


@pytest.fixture
def remote(fabric: Fabric, mesh: FakeMesh) -> Remote:
    """A running container of an opted-in pod, rerouted to cpu-1 under a virtual ID."""
    return add_remote(fabric)


@pytest.fixture
def host(mesh: FakeMesh) -> FakeHost:
    return mesh.hosts[HOST]
