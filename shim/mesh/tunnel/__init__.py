"""Byte tunnels between agents: the data path of exec/attach streams and of the stitched pod network.

The mesh's gRPC service decides *whether* a tunnel may open (``OpenTunnel``,
``Stitch``: the peer's certificate, the shadow's ownership) and hands out a
one-time token (``grants``); the bytes then flow over a TCP connection of
their own to the host's tunnel listener (``server.TunnelServer``), not over
gRPC: a gRPC stream in Python carries a fraction of what a socket does.

- **stream tunnels** (Exec, Attach: people's terminals, small and
  interactive) are TLS with the mesh certificates, and the host checks that
  the certificate names the origin the token was granted to;
- **pod-network tunnels** are the same TLS by default (``mesh.tunnel_tls``,
  which either side may ask for): they cross the node network, outside any
  encryption the cluster's CNI gives pod traffic. Where that network is
  encrypted already, turning it off on both sides leaves them plain TCP
  after the token, whose bytes a pipe moves with splice(2); what TLS costs
  against that is ``weft bench tunnel`` (figures in docs/benchmarks.md).

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
from shim.mesh.tunnel.pipe import BusyPoll, Pipe, Pipes
from shim.mesh.tunnel.server import Deadline, PipeServer, TunnelServer, read_line

__all__ = ["CONNECT_TIMEOUT_S", "HANDSHAKE_TIMEOUT_S", "BusyPoll", "Deadline", "End", "Grant", "Grants", "Pipe",
           "PipeServer", "Pipes", "SocketEnd", "TlsEnd", "TunnelError", "TunnelServer", "contexts", "dial", "read_line",
           "tune"]
