"""A real ``weft broker`` process (simulated GPUs) and a containerd whose ``weft`` handler runs the OCI hook."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from hooks import native, weft_oci_hook
from shim._pb import broker_pb2 as pb
from shim._pb import broker_pb2_grpc as pb_grpc
from shim.hookspec import with_hooks
from shim.localfabric import cpuset, daemon
from shim.localfabric.agent import free_port
from shim.localfabric.containerd import Containerd, RuntimeHandler

HOOK_SCRIPT = Path(weft_oci_hook.__file__).resolve()
# -S -I: the Python hook needs only the standard library, so skip site-packages.
PYTHON_HOOK = (sys.executable, "-S", "-I", str(HOOK_SCRIPT))


def hook_argv() -> list[str]:
    """The OCI hook as a node runs it: the native one, built here once (``hooks.native``), as the node image
    ships it; the Python hook where this machine has no C compiler, or with ``WEFT_LOCAL_HOOK=python``."""
    if os.environ.get("WEFT_LOCAL_HOOK") == "python":
        return list(PYTHON_HOOK)
    try:
        return [str(native.build())]
    except native.NativeHookUnavailable as exc:
        print(f"weft: the Python OCI hook instead of the native one: {exc}", file=sys.stderr)
        return list(PYTHON_HOOK)


def weft_handler(workdir: Path, broker_socket: Path) -> RuntimeHandler:
    """The ``weft`` runtime handler: runc plus the hook, weft.io/* annotations passed to the OCI spec."""
    default = json.loads(subprocess.run(["ctr", "oci", "spec"], check=True, capture_output=True, text=True).stdout)
    spec = with_hooks(default, hook_argv(), str(broker_socket))
    path = workdir / "weft-base-spec.json"
    workdir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec))
    return RuntimeHandler("weft", base_runtime_spec=path, pod_annotations=("weft.io/*",),
                          container_annotations=("weft.io/*",))


@dataclass
class BrokerProcess(daemon.Started):
    workdir: Path
    devices: str = "2x80GiB"
    enforce: str = "log"
    extra_env: dict[str, str] = field(default_factory=dict)
    metrics_port: int = 0
    cpus: str = ""  # the CPUs it runs on, as its node's (``shim.localfabric.cpuset``); "": all
    proc: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.workdir / "broker.sock"

    @property
    def state_dir(self) -> Path:
        return self.workdir / "broker-state"

    @property
    def log_path(self) -> Path:
        return self.workdir / "broker.log"

    def start(self, timeout: float = 20.0) -> BrokerProcess:
        if not self.metrics_port:
            self.metrics_port = free_port()
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cpuset.pinned(
                [sys.executable, "-m", "shim", "broker", "--socket", str(self.socket), "--state-dir",
                 str(self.state_dir), "--backend", "simulated", "--simulated-devices", self.devices,
                 "--enforce", self.enforce, "--watchdog-interval", "0.2",
                 "--metrics-address", f"127.0.0.1:{self.metrics_port}"], self.cpus),
                stdout=log, stderr=log, start_new_session=True, env={**os.environ, **self.extra_env})
        daemon.wait_up(self.proc, lambda: self.socket.exists() and self._answers(), timeout,
                       lambda code: f"weft broker exited {code}:\n{self.log_path.read_text()[-3000:]}",
                       lambda: f"weft broker did not come up:\n{self.log_path.read_text()[-3000:]}")
        return self

    def _answers(self) -> bool:
        # A socket file alone may be a stale one from a broker killed with SIGKILL.
        ch, stub = self.stub()
        with ch:
            try:
                stub.Devices(pb.DevicesRequest(), timeout=1)
            except grpc.RpcError:
                return False
        return True

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc is None:
            return None
        code, self.proc = daemon.stop(self.proc, sig, 15), None
        return code

    def stub(self) -> tuple[grpc.Channel, pb_grpc.BrokerStub]:
        ch = grpc.insecure_channel(f"unix://{self.socket}")
        return ch, pb_grpc.BrokerStub(ch)

    def leases(self) -> list[pb.Lease]:
        ch, stub = self.stub()
        with ch:
            return list(stub.List(pb.ListRequest(), timeout=5).leases)

    def metrics_text(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def simulate(self, processes: list[tuple[int, str, int]], sm_percent: dict[int, int] | None = None) -> None:
        ch, stub = self.stub()
        with ch:
            stub.SimulateUsage(pb.SimulateUsageRequest(processes=[
                pb.SimulatedProcess(pid=pid, device_uuid=dev, used_memory=used,
                                    sm_percent=(sm_percent or {}).get(pid, 0)) for pid, dev, used in processes]),
                timeout=5)

    def events(self) -> list[dict]:
        return daemon.json_lines(self.log_path.read_text(errors="replace"))


def gpu_fabric(workdir: Path) -> tuple[BrokerProcess, Containerd]:
    """A broker and a containerd with the weft handler pointing at it (not yet started)."""
    broker = BrokerProcess(workdir / "broker")
    return broker, Containerd(handlers=[weft_handler(workdir, broker.socket)])
