"""Opening a granted tunnel from the origin's side."""

from __future__ import annotations

import socket
import ssl

from shim.mesh.tunnel.ends import CONNECT_TIMEOUT_S, SocketEnd, TlsEnd, TunnelError, tune
from shim.mesh.tunnel.server import MAGIC, read_line


def at_known_host(known: str, supplied: str) -> str:
    """The port a host supplied, at the address this node knows that host by (``known``, its mesh address).

    A host says which port its tunnel listener has; where it is is not the
    host's to say: a host that named another address would have the origin
    carry pod bytes, and tokens, to wherever it pointed.
    """
    host = known.rpartition(":")[0]
    port = supplied.rpartition(":")[2]
    return f"{host}:{port}" if host and port else supplied


def dial(address: str, token: bytes, *, tls: ssl.SSLContext | None = None, node: str = "",
         timeout: float = CONNECT_TIMEOUT_S, known: str = "") -> SocketEnd:
    """Open a granted tunnel: connect (to ``address``'s port at ``known``'s host when given), TLS when asked
    (the server must be ``node``), token, wait for OK."""
    if known:
        address = at_known_host(known, address)
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    tune(sock, tunnel=True)
    end: SocketEnd = SocketEnd(sock)
    try:
        if tls is not None:
            end = TlsEnd(sock, tls, server_side=False, server_hostname=node)
            end.handshake(timeout)
            end.sock.settimeout(timeout)
        end.sendall(MAGIC + token.hex().encode() + b"\n")
        answer = read_line(end)
    except (OSError, ssl.SSLError, TunnelError) as exc:
        end.close()
        raise TunnelError(f"tunnel to {node or address} at {address}: {exc}") from exc
    if answer != b"OK\n":
        end.close()
        raise TunnelError(f"tunnel to {node or address} at {address}: "
                          f"{answer.decode(errors='replace').strip().removeprefix('ERR ')}")
    end.sock.settimeout(None)
    return end
