"""Peers from ``[[mesh.peers]]`` tables in the config file: the tests' and the local demo's."""

from __future__ import annotations

import ipaddress
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from shim.errors import ConfigError
from shim.mesh.discovery.base import DEFAULT_PORT, Peer

# Node names end up in certificate SANs (shim.mesh.certs), so they must be what
# Kubernetes allows for a node: a lowercase DNS name.
_NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_HOST_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*")
_STATIC_KEYS = ("node", "address", "port")

# --- static ---------------------------------------------------------------


def parse_static_peers(
    entries: Sequence[Mapping[str, Any]], *, field: str = "mesh.peers", self_node: str | None = None
) -> list[Peer]:
    """Peers from config tables such as ``{node = "cpu-1", address = "10.0.0.5", port = 7443}``.

    ``port`` defaults to 7443. Errors are ``ConfigError`` (the config loader
    already reports those) and name the entry and key: ``mesh.peers[2].address: missing``.
    ``self_node`` is validated like the others and then left out, so one list
    can be shared by every node.
    """
    if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence):
        raise ConfigError(f"{field}: expected a list of tables, got {entries!r}")
    peers: list[Peer] = []
    seen_nodes: dict[str, int] = {}
    seen_targets: dict[tuple[str, int], int] = {}
    for i, entry in enumerate(entries):
        where = f"{field}[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where}: expected a table like {{node = ..., address = ...}}, got {entry!r}")
        for key in entry:
            if key not in _STATIC_KEYS:
                raise ConfigError(f"{where}.{key}: unknown setting (known: {', '.join(_STATIC_KEYS)})")
        node = _static_node(entry, where)
        address = _static_address(entry, where)
        port = _static_port(entry, where)
        if node in seen_nodes:
            raise ConfigError(f"{where}.node: {node!r} is already listed at {field}[{seen_nodes[node]}]")
        if (address, port) in seen_targets:
            raise ConfigError(
                f"{where}: {address} port {port} is already listed at {field}[{seen_targets[address, port]}]"
            )
        seen_nodes[node] = i
        seen_targets[address, port] = i
        if node != self_node:
            peers.append(Peer(node=node, address=address, port=port))
    return peers


def _static_string(entry: Mapping[str, Any], where: str, key: str) -> str:
    """``entry[key]``, which must be there, a string and not empty: node and address are checked alike."""
    if key not in entry:
        raise ConfigError(f"{where}.{key}: missing")
    value = entry[key]
    if not isinstance(value, str):
        raise ConfigError(f"{where}.{key}: expected a string, got {value!r}")
    if not value:
        raise ConfigError(f"{where}.{key}: empty")
    return value


def _static_node(entry: Mapping[str, Any], where: str) -> str:
    node = _static_string(entry, where, "node")
    if len(node) > 253 or not _NODE_NAME.fullmatch(node):
        raise ConfigError(f"{where}.node: {node!r} is not a lowercase DNS name (a Kubernetes node name)")
    return node


def _static_address(entry: Mapping[str, Any], where: str) -> str:
    address = _static_string(entry, where, "address")
    try:
        return str(ipaddress.ip_address(address.strip("[]")))
    except ValueError:
        pass
    if ":" in address:
        raise ConfigError(f"{where}.address: {address!r} is not an IP address or host name (give the port as port)")
    if len(address) > 253 or not _HOST_NAME.fullmatch(address):
        raise ConfigError(f"{where}.address: {address!r} is not an IP address or host name")
    return address


def _static_port(entry: Mapping[str, Any], where: str) -> int:
    port = entry.get("port", DEFAULT_PORT)
    if not isinstance(port, int) or isinstance(port, bool):
        raise ConfigError(f"{where}.port: expected an integer, got {port!r}")
    if not 1 <= port <= 65535:
        raise ConfigError(f"{where}.port: {port} is out of range (1-65535)")
    return port


class StaticDiscovery:
    """The configured list, behind the same interface as the Kubernetes source."""

    def __init__(self, peers: Iterable[Peer]) -> None:
        self._peers = list(peers)

    def list(self) -> list[Peer]:
        return list(self._peers)

    def watch(self, on_change: Callable[[list[Peer]], None], stop: threading.Event) -> None:
        """Report the list once; it only changes when the agent restarts with a new file."""
        on_change(self.list())
        stop.wait()


