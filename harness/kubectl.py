"""kubectl 1.20 as a real SPDY client of CRI streaming URLs, with the API server's part played here.

kubectl speaks SPDY/3.1 (``v4.channel.k8s.io`` for exec and attach,
``portforward.k8s.io`` for port-forward) up to 1.28, and 1.20 still follows
a redirect on the upgrade request, as it did when kubelets answered with the
CRI's URL (``--redirect-container-streaming``). So this stand-in for the API
server and kubelet answers kubectl's discovery and pod lookups from what the
origin's CRI socket says, makes the CRI call kubelet would make (Exec,
Attach, PortForward, with the options from kubectl's query), and redirects
kubectl to the URL the CRI returned: from then on the session is kubectl's
own SPDY with the origin's streaming relay, or with containerd for a local
container, as kubelet would proxy it.

``scripts/setup.sh`` unpacks Debian's ``kubernetes-client`` (1.20) into the
virtual environment, beside nothing else: newer kubectl speaks WebSocket
and no longer follows redirects. Both the server and kubectl run in the
origin node's network namespace, where kubelet reaches the streaming URLs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import grpc
from cri_api.v1 import api_pb2 as cri

from shim.crishared.netns import Netns

KUBECTL = Path(sys.prefix) / "opt" / "kubernetes-client" / "usr" / "bin" / "kubectl"
NAMESPACE = "default"

_RESOURCES = {
    "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "v1",
    "resources": [
        {"name": "pods", "singularName": "", "namespaced": True, "kind": "Pod",
         "verbs": ["get", "list"], "shortNames": ["po"]},
        {"name": "pods/exec", "singularName": "", "namespaced": True, "kind": "PodExecOptions", "verbs": ["create"]},
        {"name": "pods/attach", "singularName": "", "namespaced": True, "kind": "PodAttachOptions",
         "verbs": ["create"]},
        {"name": "pods/portforward", "singularName": "", "namespaced": True, "kind": "PodPortForwardOptions",
         "verbs": ["create"]},
    ],
}


class KubeApi:
    """The API server and kubelet for one pod, as kubectl sees them; every CRI call goes to ``runtime``."""

    def __init__(self, netns: str, runtime: Callable[[], tuple[grpc.Channel, object]], pod: str,
                 sandbox_id: str, containers: dict[str, str]) -> None:
        self.runtime, self.pod, self.sandbox_id, self.containers = runtime, pod, sandbox_id, containers
        self.netns = netns
        self.ns = Netns(netns)
        self.requests: list[str] = []
        sock = self.ns.listen("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), _handler(self), bind_and_activate=False)
        self.server.socket.close()
        self.server.socket = sock
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> KubeApi:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.ns.close()

    def kubectl(self, *args: str, home: Path, **popen: object) -> subprocess.Popen:
        """kubectl with ``args``, in the node's namespace, against this server."""
        argv = ["nsenter", f"--net={self.netns}", str(KUBECTL), f"--server=http://127.0.0.1:{self.port}",
                f"--cache-dir={home / 'cache'}", "--request-timeout=20s", "-n", NAMESPACE, *args]
        return subprocess.Popen(argv, env={**os.environ, "HOME": str(home), "KUBECONFIG": str(home / "none")},
                                **popen)  # type: ignore[call-overload]

    # -- what kubectl asks ----------------------------------------------------------
    def pod_json(self) -> dict:
        names = list(self.containers)
        return {
            "kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": self.pod, "namespace": NAMESPACE, "uid": self.sandbox_id[:32]},
            "spec": {"containers": [{"name": n, "image": "weft-test"} for n in names]},
            "status": {"phase": "Running",
                       "containerStatuses": [{"name": n, "ready": True, "restartCount": 0, "image": "weft-test",
                                              "imageID": "", "state": {"running": {}}} for n in names]},
        }

    def stream_url(self, verb: str, query: dict[str, list[str]]) -> str:
        flag = lambda k: query.get(k, ["false"])[0] == "true"  # noqa: E731
        ch, rt = self.runtime()
        with ch:
            if verb == "portforward":
                return rt.PortForward(cri.PortForwardRequest(pod_sandbox_id=self.sandbox_id)).url
            cid = self.containers[query.get("container", [next(iter(self.containers))])[0]]
            if verb == "exec":
                return rt.Exec(cri.ExecRequest(container_id=cid, cmd=query.get("command", []), tty=flag("tty"),
                                               stdin=flag("stdin"), stdout=flag("stdout"),
                                               stderr=flag("stderr"))).url
            return rt.Attach(cri.AttachRequest(container_id=cid, tty=flag("tty"), stdin=flag("stdin"),
                                               stdout=flag("stdout"), stderr=flag("stderr"))).url


def _handler(api: KubeApi) -> type[BaseHTTPRequestHandler]:
    pod_path = f"/api/v1/namespaces/{NAMESPACE}/pods/{api.pod}"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: object) -> None:
            pass

        def _json(self, doc: dict, status: int = 200) -> None:
            body = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            path = urlsplit(self.path).path
            api.requests.append(f"GET {path}")
            if path == "/api":
                self._json({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": f"127.0.0.1:{api.port}"}]})
            elif path == "/apis":
                self._json({"kind": "APIGroupList", "apiVersion": "v1", "groups": []})
            elif path == "/api/v1":
                self._json(_RESOURCES)
            elif path == pod_path:
                self._json(api.pod_json())
            else:
                self._json({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                            "code": 404, "message": f"{path} not found"}, 404)

        def do_POST(self) -> None:
            parts = urlsplit(self.path)
            api.requests.append(f"POST {parts.path}")
            verb = parts.path.removeprefix(pod_path + "/")
            if verb not in ("exec", "attach", "portforward"):
                self._json({"kind": "Status", "status": "Failure", "code": 404, "message": "not found"}, 404)
                return
            try:
                url = api.stream_url(verb, parse_qs(parts.query))
            except grpc.RpcError as exc:
                self._json({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 500,
                            "message": f"CRI {verb}: {exc.details()}"}, 500)
                return
            self.send_response(302)
            self.send_header("Location", url)
            self.send_header("Content-Length", "0")
            self.end_headers()

    return Handler


class Terminal:
    """kubectl on a pseudo-terminal of its own, as a person at a shell would run it (``-it`` needs one)."""

    def __init__(self, api: KubeApi, *args: str, home: Path, rows: int = 30, cols: int = 100) -> None:
        self.master, slave = pty.openpty()
        self.resize(rows, cols, signal_kubectl=False)
        try:
            self.proc = api.kubectl(*args, home=home, stdin=slave, stdout=slave, stderr=slave,
                                    start_new_session=True)
        finally:
            os.close(slave)
        self.out = b""

    def resize(self, rows: int, cols: int, *, signal_kubectl: bool = True) -> None:
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        if signal_kubectl:  # no controlling terminal, so the kernel does not send it
            self.proc.send_signal(signal.SIGWINCH)

    def type(self, text: bytes) -> None:
        os.write(self.master, text)

    def read_until(self, needle: bytes, timeout: float = 20.0) -> bytes:
        deadline = time.monotonic() + timeout
        while needle not in self.out:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.master], [], [], left)[0]:
                raise TimeoutError(f"{needle!r} not seen from kubectl; it wrote {self.out[-500:]!r}")
            try:
                self.out += os.read(self.master, 65536)
            except OSError:  # EIO: kubectl exited and the terminal hung up
                raise TimeoutError(f"{needle!r} not seen; kubectl exited, having written {self.out[-500:]!r}") \
                    from None
        return self.out

    def wait(self, timeout: float = 20.0) -> int:
        code = self.proc.wait(timeout)
        with contextlib.suppress(OSError):
            while select.select([self.master], [], [], 0.1)[0]:
                chunk = os.read(self.master, 65536)
                if not chunk:
                    break
                self.out += chunk
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self.master)
