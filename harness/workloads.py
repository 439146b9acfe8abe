"""Pods for the real-cluster tests and the ways a user talks to them: kubectl, a terminal, port-forward, crictl.

Every image is the local fabric's busybox image, already in each node's containerd; busybox's httpd
serves the probes and the pages, its wget fetches them (without ``-T``: busybox-static 1.35's wget
crashes with it).
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from harness import binaries
from harness.cluster import KubeCluster
from shim.localfabric.images import BUSYBOX_IMAGE
from shim.localfabric.waiting import wait_for


def container(name: str, script: str, *, port: int | None = None, **extra: Any) -> dict:
    c: dict[str, Any] = {"name": name, "image": BUSYBOX_IMAGE, "imagePullPolicy": "IfNotPresent",
                         "command": ["sh", "-c", script]}
    if port:
        c["ports"] = [{"containerPort": port}]
    c.update(extra)
    return c


def pod(name: str, containers: Sequence[dict], *, runtime_class: str | None = None,
        annotations: dict[str, str] | None = None, node_selector: dict[str, str] | None = None,
        volumes: Sequence[dict] = (), grace: int = 2) -> dict:
    spec: dict[str, Any] = {"containers": list(containers), "terminationGracePeriodSeconds": grace}
    if runtime_class:
        spec["runtimeClassName"] = runtime_class
    if node_selector:
        spec["nodeSelector"] = node_selector
    if volumes:
        spec["volumes"] = list(volumes)
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "annotations": annotations or {}}, "spec": spec}


def web(name: str, port: int, page: str) -> dict:
    """A container serving ``page`` on ``port`` with an HTTP readiness probe, and logging a line first."""
    script = (f"echo {name} starting; mkdir -p /www; echo {page} > /www/index.html; "
              f"exec httpd -f -p {port} -h /www")
    return container(name, script, port=port,
                     readinessProbe={"httpGet": {"path": "/index.html", "port": port}, "periodSeconds": 1})


def apply(c: KubeCluster, *objects: dict) -> None:
    c.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}))


def get_pod(c: KubeCluster, name: str) -> dict:
    return c.api(f"/api/v1/namespaces/default/pods/{name}")


def ready(p: dict) -> bool:
    conditions = p.get("status", {}).get("conditions", [])
    return any(cond["type"] == "Ready" and cond["status"] == "True" for cond in conditions)


def wait_ready(c: KubeCluster, name: str, timeout: float = 180.0) -> dict:
    def check() -> dict | None:
        with contextlib.suppress(AssertionError):
            p = get_pod(c, name)
            if ready(p):
                return p
        return None

    try:
        return wait_for(check, timeout=timeout, what=f"pod {name} Ready", every=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{c.kubectl('describe', 'pod', name, check=False).stdout[-4000:]}") from None


def container_status(p: dict, container_name: str) -> dict:
    return next(s for s in p["status"]["containerStatuses"] if s["name"] == container_name)


def delete(c: KubeCluster, *names: str) -> None:
    if names:
        c.kubectl("delete", "pod", "--ignore-not-found", "--wait=true", "--timeout=120s", *names, timeout=180)


def sandbox_of(c: KubeCluster, node: str, pod_name: str) -> list:
    return [s for s in c.sandboxes(node) if s.metadata.name == pod_name and s.metadata.namespace == "default"]


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


@contextlib.contextmanager
def port_forward(c: KubeCluster, target: str, port: int) -> Iterator[int]:
    """``kubectl port-forward TARGET :PORT``; yields the local port it forwards from."""
    assert c.control is not None
    proc = subprocess.Popen(c.control.kubectl_argv("port-forward", target, f":{port}"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        line = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 1)[0]:
                line = proc.stdout.readline()
                m = re.search(r"Forwarding from 127\.0\.0\.1:(\d+)", line)
                if m:
                    yield int(m.group(1))
                    return
            if proc.poll() is not None:
                break
        raise AssertionError(f"kubectl port-forward {target} did not start: {line!r} {proc.stderr.read()}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


class Terminal:
    """A command on a pseudo-terminal, as a person at a shell runs ``kubectl exec -it`` or ``crictl exec -it``."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child
            os.execvp(argv[0], list(argv))
        self.output = b""

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def expect(self, pattern: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern.encode())
        while not rx.search(self.output):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {pattern!r} on the terminal within {timeout:g} s: {self.output[-2000:]!r}")
            if select.select([self.fd], [], [], min(left, 0.5))[0]:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"terminal closed before {pattern!r}: {self.output[-2000:]!r}")
                self.output += chunk
        return self.output.decode(errors="replace")

    def wait(self, timeout: float = 30.0) -> int:
        """The exit status once the command ends (draining its output meanwhile)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.pid = 0
                return os.waitstatus_to_exitcode(status)
            if select.select([self.fd], [], [], 0.2)[0]:
                with contextlib.suppress(OSError):
                    self.output += os.read(self.fd, 65536)
        raise AssertionError(f"terminal command still running after {timeout:g} s: {self.output[-2000:]!r}")

    def close(self) -> None:
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.pid = 0
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def crictl(endpoint: Path, *args: str, netns: Path | None = None, timeout: float = 60.0,
           check: bool = True) -> subprocess.CompletedProcess[str]:
    """The real crictl against a CRI socket, inside a node's network namespace (where streaming URLs answer)."""
    argv = crictl_argv(endpoint, *args, netns=netns)
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"crictl {' '.join(args)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}")
    return res


def crictl_argv(endpoint: Path, *args: str, netns: Path | None = None) -> list[str]:
    prefix = ["nsenter", f"--net={netns}"] if netns else []
    return [*prefix, binaries.binary("crictl"), "--runtime-endpoint", f"unix://{endpoint}",
            "--image-endpoint", f"unix://{endpoint}", "--timeout", "30s", *args]
