"""Byte tunnels between agents: the data path of exec/attach streams and of the stitched pod network.

The mesh's gRPC service decides *whether* a tunnel may open (``OpenTunnel``,
``Stitch``: the peer's certificate, the shadow's ownership) and hands out a
one-time token (``grants``); the bytes then flow over a TCP connection of
their own to the host's tunnel listener (``server.TunnelServer``), not over
gRPC. Through two relays in Python, plain sockets carry far more than the
same through TLS (AES-GCM in user space on both relays), and a gRPC stream
less still (``weft bench network``; figures in docs/benchmarks.md). So:

- **stream tunnels** (Exec, Attach: people's terminals, small and
  interactive) are TLS with the mesh certificates, and the host checks that
  the certificate names the origin the token was granted to;
- **pod-network tunnels** are plain TCP after the token, as the pod network
  between nodes is (the threat model leaves it to the cluster): the token,
  granted over mutual TLS, is what lets a connection through.

``ends`` are the two kinds of socket end, ``pipe`` joins two ends as a direct
connection would, ``server`` listens, ``dial`` connects. The names below are
the package's interface.
"""

from shim.mesh.tunnel.dial import dial
from shim.mesh.tunnel.ends import (
    CONNECT_TIMEOUT_S,
    HANDSHAKE_TIMEOUT_S,
    End,
    SocketEnd,
    TlsEnd,
    TunnelError,
    contexts,
    tune,
)
from shim.mesh.tunnel.grants import Grant, Grants
from shim.mesh.tunnel.pipe import BusyPoll, Pipe
from shim.mesh.tunnel.server import Deadline, PipeServer, TunnelServer, read_line

__all__ = ["CONNECT_TIMEOUT_S", "HANDSHAKE_TIMEOUT_S", "BusyPoll", "Deadline", "End", "Grant", "Grants", "Pipe",
           "PipeServer", "SocketEnd", "TlsEnd", "TunnelError", "TunnelServer", "contexts", "dial", "read_line", "tune"]
