"""The test DRA driver on a test node, and the objects a DRA GPU pod needs: a DeviceClass and a claim template.

``weft-test-dra-driver`` (``components/dra/gpudriver``) runs in the root namespace, where the API server
and the node's kubelet root directory both are: it registers with kubelet through
``<root>/plugins_registry`` and serves the DRA API from ``<root>/plugins/<driver>``, publishes the
GPUs it is given (the node's broker's UUIDs) as the node's ResourceSlice, and writes each prepared
claim's CDI spec into the directory the node's containerd reads.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from harness import binaries
from harness.procs import Daemon, tail

DRIVER = "gpu.weft.test"
REGISTERED = "weft-test-dra-driver: registered with kubelet"


@dataclass
class DraDriver:
    node_name: str
    kubelet_root: Path
    kubeconfig: Path
    gpus: list[str]
    cdi_dir: Path
    workdir: Path
    daemon: Daemon | None = field(default=None, repr=False)

    @property
    def log_path(self) -> Path:
        return self.workdir / "dra-driver.log"

    def start(self, timeout: float = 60.0) -> float:
        """Start it; returns once kubelet has registered it (a claim prepared before that waits out a back-off)."""
        self.daemon = Daemon(f"DRA driver on {self.node_name}", [
            binaries.dra_binary("weft-test-dra-driver"), "--driver-name", DRIVER, "--node-name", self.node_name,
            "--kubeconfig", str(self.kubeconfig), "--gpus", ",".join(self.gpus), "--cdi-dir", str(self.cdi_dir),
            "--plugin-dir", str(self.kubelet_root / "plugins" / DRIVER),
            "--registrar-dir", str(self.kubelet_root / "plugins_registry"), "--v=2"], self.log_path)
        return self.daemon.start(self._registered, timeout)

    def _registered(self) -> bool:
        with contextlib.suppress(OSError):
            return REGISTERED in self.log_path.read_text(errors="replace")
        return False

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()

    def log_tail(self, lines: int = 30) -> str:
        return tail(self.log_path, lines)


def device_class() -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": DRIVER},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]}}


def claim_template(name: str, uuid: str) -> dict:
    """One GPU, the one with ``uuid``: a claim that names its device, so the test knows which one it holds."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": DRIVER,
                "selectors": [{"cel": {"expression": f'device.attributes["{DRIVER}"].uuid == "{uuid}"'}}],
            }}]}}}}


def with_claim(pod: dict, container: str, template: str) -> dict:
    """``pod`` with a claim made from ``template`` for ``container``."""
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": template}]
    c = next(c for c in pod["spec"]["containers"] if c["name"] == container)
    c.setdefault("resources", {})["claims"] = [{"name": "gpu"}]
    return pod
