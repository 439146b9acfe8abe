"""A static peers file (``--peers FILE``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from shim.errors import ConfigError
from shim.mesh.discovery.base import Peer
from shim.mesh.discovery.static import parse_static_peers

PEER_ROLES = {"gpu": "gpu", "cpu": "cpu", "both": "gpu,cpu", "gpu,cpu": "gpu,cpu"}


def load_peers_file(path: Path, *, self_node: str | None = None) -> tuple[list[Peer], dict[str, str]]:
    """A static peers file (``--peers FILE``): TOML, one ``[[peer]]`` table per node.

    Each table has ``name``, ``address`` (``HOST:PORT`` of its mesh) and
    ``role`` (gpu, cpu or both). Returns the peers (this node left out) and
    each peer's declared role. Errors name the file, the entry and the key.
    """
    import tomllib

    try:
        doc = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"peers file {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"peers file {path}: {exc}") from exc
    unknown = set(doc) - {"peer"}
    if unknown:
        raise ConfigError(f"peers file {path}: unknown top-level keys {sorted(unknown)} (expected [[peer]] tables)")
    tables = doc.get("peer", [])
    entries, roles = [], {}
    for i, table in enumerate(tables):
        where = f"{path}: peer[{i}]"
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where}: expected a table")
        extra = set(table) - {"name", "address", "role"}
        if extra:
            raise ConfigError(f"{where}: unknown keys {sorted(extra)} (name, address, role)")
        address = str(table.get("address", ""))
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"{where}.address: {address!r} is not HOST:PORT")
        role = str(table.get("role", "both"))
        if role not in PEER_ROLES:
            raise ConfigError(f"{where}.role: {role!r} is not gpu, cpu or both")
        entries.append({"node": table.get("name", ""), "address": host.strip("[]"), "port": int(port)})
        roles[str(table.get("name", ""))] = PEER_ROLES[role]
    peers = parse_static_peers(entries, field=f"{path}: peer", self_node=self_node)
    return peers, {p.node: roles[p.node] for p in peers}
