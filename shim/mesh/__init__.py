"""The peer mesh between weft agents: gRPC over TCP with mutual TLS from a cluster CA (docs/architecture.md).

Every agent serves ``proto/mesh.proto`` and dials its peers. Trust comes from
one cluster CA: a node's certificate names the node (SAN URI
``weft://node/<name>`` and SAN DNS ``<name>``), so a peer is who its
certificate says, and only if it is a node this agent knows.

- ``certs``: the CA and node certificates (``weft mesh-certs``).
- ``discovery``: which peers exist (static list or EndpointSlices).
- ``identity``: which node a TLS peer is, and whether it is welcome.
- ``capacity``: this node's real free capacity, as the mesh reports it.
- ``server`` / ``client``: the two ends of the mesh's gRPC service.
- ``upload``: copied volumes in small parts, read only after the peer is known.
"""
