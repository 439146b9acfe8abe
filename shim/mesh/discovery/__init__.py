"""Peer discovery: which other weft agents this node's mesh can dial.

Peers come from one of two places, and both give the same value, a list of
``Peer``, so the mesh never knows which one was used:

- **static**: ``[[mesh.peers]]`` tables in the config file, for tests and the
  local demo (``static``: ``parse_static_peers``, ``StaticDiscovery``; ``peersfile``: ``--peers FILE``);
- **kubernetes**: the EndpointSlices of the weft DaemonSet's headless Service.
  The EndpointSlice controller already tracks which weft pod runs on which node
  and whether it is ready, so weft reads that instead of keeping a registry.

The Kubernetes side (``kubernetes``) is split in two. ``peers_from_endpointslices`` is a pure
function over EndpointSlice objects as the API returns them (JSON dicts, or
lightkube's model objects), tested on recorded responses. ``EndpointSliceDiscovery``
is the I/O: it lists and watches through a lightkube client that is injected,
so tests hand it a fake, and is built lazily, so an agent configured for static
peers never needs a kubeconfig.

A peer that is not ready is still reported (``ready=False``): whether to dial
it is the mesh's decision, and running locally is always the fallback.
"""

from shim.mesh.discovery.base import (
    DEFAULT_PORT,
    DEFAULT_PORT_NAME,
    SERVICE_NAME_LABEL,
    Discovery,
    DiscoveryError,
    DiscoveryUnavailable,
    Peer,
)
from shim.mesh.discovery.kubernetes import EndpointSliceDiscovery, KubeClient, peers_from_endpointslices
from shim.mesh.discovery.peersfile import PEER_ROLES, load_peers_file
from shim.mesh.discovery.static import StaticDiscovery, parse_static_peers

__all__ = ["DEFAULT_PORT", "DEFAULT_PORT_NAME", "PEER_ROLES", "SERVICE_NAME_LABEL", "Discovery", "DiscoveryError",
           "DiscoveryUnavailable", "EndpointSliceDiscovery", "KubeClient", "Peer", "StaticDiscovery",
           "load_peers_file", "parse_static_peers", "peers_from_endpointslices"]
