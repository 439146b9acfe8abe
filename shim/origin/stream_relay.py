"""The origin's streaming server: Exec and Attach sessions of remote containers, relayed to their hosts.

kubelet asks the CRI for Exec or Attach and gets a URL to connect to (it
proxies the client's SPDY or WebSocket session there). For a remote
container, the host's containerd gives the URL, on its own node; the origin
answers kubelet with a URL of this server instead (``url``), on an address
kubelet reaches as it reaches containerd's (``agent.stream_address``, by
default on 127.0.0.1 as containerd's is), holding a one-time token
(``shim.core.streams.StreamTokens``) that names the host and the host's URL.

A connection here sends its HTTP request head; the token is taken, the host
grants a TLS tunnel to its containerd's streaming server (``OpenTunnel``),
the head goes there with the host's path in place of ours, and from then on
bytes flow unchanged both ways: the upgrade to SPDY or WebSocket, stdin,
stdout, stderr, resize and the exit status are containerd's own. Both relays
of a session (this one and the host's) busy-poll after small transfers
(``agent.stream_busy_poll_us``), which keeps a keystroke's echo near a local
container's. An unknown or used token is 404, a host that cannot be reached
502, both with a log line that names the container and host
(``stream.failed``).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from shim import log
from shim.core.annotations import parse_host_port
from shim.core.streams import BadRequest, StreamTokens, head_end, parse_head
from shim.crishared.remote import Remote, host_client
from shim.errors import WeftError
from shim.mesh.tunnel import Deadline, PipeServer, SocketEnd, dial, tune

if TYPE_CHECKING:
    from shim.mesh.node import MeshNode

_log = log.get("weft.stream")

HEAD_TIMEOUT_S = 10.0


class StreamRelay(PipeServer):
    thread_name = "weft-stream"

    def __init__(self, mesh: MeshNode, tunnel_tls: ssl.SSLContext | None, address: str, *,
                 busy_poll_us: int = 0) -> None:
        self.mesh, self.tunnel_tls = mesh, tunnel_tls
        host, port = parse_host_port(address, field="agent.stream_address")
        super().__init__(socket.create_server((host, port), backlog=128), busy_poll_us=busy_poll_us)
        bound = self._sock.getsockname()[1]
        self.base = f"http://{host if ':' not in host else f'[{host}]'}:{bound}"
        self.tokens: StreamTokens[tuple[Remote, str]] = StreamTokens()

    def url(self, kind: str, r: Remote, host_url: str) -> str:
        """Our URL for a session the host's containerd will serve at ``host_url``."""
        return f"{self.base}/{kind}/{self.tokens.add(kind, (r, host_url))}"

    def start(self) -> None:
        super().start()
        _log.info("stream.serving", address=self.base)

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        tune(conn, tunnel=False)
        deadline = Deadline(HEAD_TIMEOUT_S)  # for the whole head, however slowly it comes
        data = b""
        try:
            while (end := head_end(data)) < 0:
                deadline.apply(conn)
                chunk = conn.recv(65536)
                if not chunk:
                    conn.close()
                    return
                data += chunk
            head = parse_head(data[:end])
        except (OSError, BadRequest) as exc:
            _log.warning("stream.bad_request", error=str(exc))
            _answer(conn, 400, str(exc))
            return
        kind, token = head.route
        found = self.tokens.take(kind, token) if kind in ("exec", "attach") else None
        if found is None:
            _answer(conn, 404, f"no {kind or 'stream'} session {token[:8]}...: unknown, used or expired")
            return
        r, host_url = found.target
        try:
            client = host_client(self.mesh, r)
            grant = client.open_tunnel(self.mesh.node, r.key, stream_url=host_url)
            tunnel = dial(grant.address, grant.token, tls=self.tunnel_tls if grant.tls else None, node=r.node,
                          known=client.address)
            parts = urlsplit(host_url)
            tunnel.sendall(head.rewritten(parts.path + (f"?{parts.query}" if parts.query else ""), parts.netloc)
                           + data[end:])
        except (OSError, WeftError) as exc:
            message = exc.message if isinstance(exc, WeftError) else str(exc)
            _log.warning("stream.failed", kind=kind, container_id=r.id, container=r.config.metadata.name,
                         node=r.node, error=message)
            _answer(conn, 502, f"weft: {kind} session with {r.config.metadata.name} on {r.node}: {message}")
            return
        conn.settimeout(None)
        _log.info("stream.relayed", kind=kind, container_id=r.id, container=r.config.metadata.name, node=r.node)
        self.join(SocketEnd(conn), tunnel, f"{kind}-{r.id[:12]}", interactive=True)


def _answer(conn: socket.socket, status: int, text: str) -> None:
    reason = {400: "Bad Request", 404: "Not Found", 502: "Bad Gateway"}[status]
    body = (text + "\n").encode()
    with contextlib.suppress(OSError):
        conn.sendall(f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + body)
    conn.close()
