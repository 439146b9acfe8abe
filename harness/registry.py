"""A real image registry (Debian's docker-registry, htpasswd auth) inside a node's network namespace.

Pulls in tests are real pulls: containerd resolves ``127.0.0.1:<port>/...``
through the ``hosts.toml`` this module writes into the node's registry
config directory, and fetches layers over HTTP from the registry, which runs
in the same network namespace as that containerd. Images are pushed with
skopeo from the locally built OCI archives, with the registry's credentials.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from shim.localfabric import daemon
from shim.localfabric.containerd import Containerd


@dataclass
class Registry:
    node: Containerd
    user: str = "weft"
    password: str = "weft-test-secret"
    port: int = 5000
    proc: subprocess.Popen[bytes] | None = None
    # For several nodes (the mesh tests): listen on this address of the root namespace, which every node
    # reaches over the cluster bridge, and point each of these nodes' containerd at it.
    address: str = ""
    clients: tuple[Containerd, ...] = ()
    # False: anyone may pull and push (critest pulls its image set without credentials).
    auth: bool = True
    pushed: list[str] = field(default_factory=list)

    @property
    def workdir(self) -> Path:
        assert self.node.workdir is not None
        return self.node.workdir / "registry"

    @property
    def host(self) -> str:
        return f"{self.address or '127.0.0.1'}:{self.port}"

    def _netns(self) -> list[str]:
        return [] if self.address else ["nsenter", f"--net={self.node.netns_path}"]

    def _in_node(self, *argv: str, **kw) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self._netns(), *argv], capture_output=True, text=True, **kw)

    def start(self, timeout: float = 20.0) -> Registry:
        self.workdir.mkdir(parents=True, exist_ok=True)
        htpasswd = self.workdir / "htpasswd"
        out = subprocess.run(["htpasswd", "-Bbn", self.user, self.password], check=True, capture_output=True,
                             text=True).stdout
        htpasswd.write_text(out)
        config = self.workdir / "config.yml"
        config.write_text(f"""version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {self.workdir / "data"}
  delete:
    enabled: true
http:
  addr: {self.host}
""" + (f"""auth:
  htpasswd:
    realm: weft-test
    path: {htpasswd}
""" if self.auth else ""))
        for node in (self.node, *self.clients):
            hosts = node.registry_config_dir / self.host
            hosts.mkdir(parents=True, exist_ok=True)
            (hosts / "hosts.toml").write_text(f"""server = "http://{self.host}"

[host."http://{self.host}"]
  capabilities = ["pull", "resolve"]
""")
        with open(self.workdir / "registry.log", "ab") as log:
            self.proc = subprocess.Popen([*self._netns(), "docker-registry", "serve", str(config)], stdout=log,
                                         stderr=log, start_new_session=True)
        deadline = time.monotonic() + timeout
        probe = f"import socket; socket.create_connection(('{self.address or '127.0.0.1'}', {self.port}), 1)"
        while self._in_node("python3", "-c", probe).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"docker-registry did not start: {(self.workdir / 'registry.log').read_text()}")
            time.sleep(0.1)
        return self

    def push(self, archive: Path, name: str) -> str:
        """Push an OCI archive as ``name`` (``repo:tag``); returns the reference to pull."""
        ref = f"{self.host}/{name}"
        creds = [f"--dest-creds={self.user}:{self.password}"] if self.auth else []
        res = self._in_node("skopeo", "copy", "--quiet", "--dest-tls-verify=false", *creds,
                            f"oci-archive:{archive}", f"docker://{ref}")
        if res.returncode != 0:
            raise RuntimeError(f"skopeo copy {archive} -> {ref} failed: {res.stderr.strip()}")
        self.pushed.append(ref)
        return ref

    def _forget_pulled(self) -> None:
        # A pull adds its tag to the node's copy of the image: left there, the next test on this node's containerd
        # sees ``busybox`` named after a registry that no longer runs (ContainerStatus reports the first tag).
        for node in (self.node, *self.clients):
            if node.running and self.pushed:
                subprocess.run(["ctr", "-a", str(node.socket), "-n", "k8s.io", "images", "rm", *self.pushed],
                               capture_output=True, text=True)

    def stop(self) -> None:
        try:
            self._forget_pulled()
        finally:
            if self.proc is not None:
                daemon.stop(self.proc, timeout=10)
            self.proc = None

    def __enter__(self) -> Registry:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
