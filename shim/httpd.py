"""The agent's HTTP endpoint: Prometheus metrics and health checks.

``/metrics``  Prometheus text exposition of the agent's registry.
``/healthz``  200 while the agent serves CRI (liveness), with containerd's
              reachability in the JSON body; 503 when one of its accept
              loops (the tunnel port, the stream relay) has died, named in
              ``dead``.
``/readyz``   200 only when containerd answers through the agent's upstream
              channel (readiness), 503 with the reason otherwise.
``/reservations/<name>/stop``  on a CPU host with reservation pods: kubelet's
              preStop hook of reservation ``<name>`` (its token in a
              header); answered once the shadow has stopped.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from shim.core.annotations import parse_host_port
from shim.core.reservation import STOP_TOKEN_HEADER
from shim.metrics import Metrics

# () -> (containerd reachable, detail)
Probe = Callable[[], tuple[bool, str]]
# () -> the names of the agent's loops that died (empty while all run)
Loops = Callable[[], list[str]]
# (reservation name, token) -> (HTTP status, text): shim.shadowhost.reservations.Reservations.stop_for_kubelet
StopReservation = Callable[[str, str], tuple[int, str]]


class HttpEndpoint:
    def __init__(self, address: str, metrics: Metrics, probe: Probe, loops: Loops | None = None,
                 stop_reservation: StopReservation | None = None) -> None:
        host, port = parse_host_port(address, field="agent.metrics_address")
        registry, check, dead_loops = metrics.registry, probe, loops or (lambda: [])

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path in ("/healthz", "/readyz"):
                    ok, detail = check()
                    body = {"serving": True, "containerd": "reachable" if ok else "unreachable", "detail": detail}
                    status = 200 if ok or path == "/healthz" else 503
                    dead = dead_loops()
                    if dead:  # an agent that no longer accepts what it must is not alive
                        body["dead"] = dead
                        status = 503
                    self._send(status, json.dumps(body).encode() + b"\n", "application/json")
                elif stop_reservation is not None and (name := _reservation(path)):
                    status, text = stop_reservation(name, self.headers.get(STOP_TOKEN_HEADER, ""))
                    self._send(status, text.encode(), "text/plain")
                else:
                    self._send(404, b"not found: try /metrics, /healthz or /readyz\n", "text/plain")

            def _send(self, status: int, body: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - scrapes are not news
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="weft-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _reservation(path: str) -> str:
    """The reservation named by ``/reservations/<name>/stop``; "" for any other path."""
    parts = path.split("/")
    return parts[2] if len(parts) == 4 and parts[1] == "reservations" and parts[3] == "stop" else ""
