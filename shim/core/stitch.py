"""The pure half of the stitched pod network: which ports each side mirrors (the streaming relay's is
``shim.core.streams``).

* ``declared_ports``: ``weft.io/ports.<container>``, a comma-separated list of
  TCP ports, overrides what the agents discover for that container.
* ``loopback_only``: the ports whose servers listen on loopback alone, which
  a mirror then listens on as narrowly (never on the pod IP).
* ``plan``: given what listens where, which ports each side mirrors, and
  which it cannot (a port the pod's local containers hold already, or two
  rerouted containers on one port): ``Collision`` values with the port and
  the containers named.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Set
from dataclasses import dataclass
from enum import Enum

PORTS_ANNOTATION = "weft.io/ports."


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4-mapped loopback address."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def loopback_only(listening: Mapping[int, Mapping[int, str]], own: Set[int] = frozenset()) -> frozenset[int]:
    """The ports every listener of which (``own`` inodes left out) is bound to a loopback address.

    ``listening``: port -> {socket inode: bound address}. A server bound to
    127.0.0.1 chose not to be reachable from outside its pod; its mirror in the
    other sandbox must not make it so, and listens on loopback too.
    """
    out = set()
    for port, socks in listening.items():
        theirs = [addr for inode, addr in socks.items() if inode not in own]
        if theirs and all(is_loopback(a) for a in theirs):
            out.add(port)
    return frozenset(out)


def declared_ports(annotations: Mapping[str, str], container: str) -> frozenset[int] | None:
    """The ports declared for ``container`` (None: not declared, discover them); ValueError names the key."""
    key = PORTS_ANNOTATION + container
    raw = annotations.get(key)
    if raw is None:
        return None
    ports = set()
    for part in raw.replace(" ", "").split(","):
        if not part:
            continue
        if not part.isdigit() or not 1 <= int(part) <= 65535:
            raise ValueError(f"{key}: {part!r} is not a TCP port (1-65535)")
        ports.add(int(part))
    return frozenset(ports)


class HeldBy(Enum):
    LOCAL = "a local container of the pod"
    REMOTE = "another rerouted container of the pod"


@dataclass(frozen=True)
class Collision:
    port: int
    container: str  # the rerouted container whose port is not mirrored into the origin
    held_by: HeldBy
    holder: str = ""  # the other rerouted container, for REMOTE


@dataclass(frozen=True)
class Plan:
    # Port -> the rerouted container it is mirrored from, into the origin sandbox.
    into_origin: dict[int, str]
    # Rerouted container -> the ports its host listens on in the shadow sandbox, for the rest of the pod.
    into_shadow: dict[str, frozenset[int]]
    collisions: tuple[Collision, ...]


def attribute(listening: Mapping[str, frozenset[int]], namespaces: Mapping[str, str],
              current: Mapping[int, str] | None = None) -> dict[str, frozenset[int]]:
    """What each rerouted container listens on, from what each one's host reports.

    A pod's shadows on one host share a network namespace (``namespaces``: the
    same value for each of them), and each one's report holds everything that
    listens there. A port is put down to one of them only, so that it is not
    taken for a collision between them: to the container it is mirrored for
    now (``current``), else to the first by name. Shadows in different
    namespaces are left as they are.
    """
    current = current or {}
    out: dict[str, set[int]] = {name: set() for name in listening}
    claimed: dict[str, set[int]] = {}
    for name, ports in listening.items():
        for port in ports:
            if current.get(port) == name:
                out[name].add(port)
                claimed.setdefault(namespaces[name], set()).add(port)
    for name in sorted(listening):
        shared = claimed.setdefault(namespaces[name], set())
        out[name] |= listening[name] - shared
        shared |= out[name]
    return {name: frozenset(ports) for name, ports in out.items()}


def plan(shadow_ports: Mapping[str, frozenset[int]], local_ports: frozenset[int],
         current: Mapping[int, str] | None = None) -> Plan:
    """Which ports go where.

    ``shadow_ports``: per rerouted container, what it listens on (discovered or
    declared). ``local_ports``: what listens in the origin sandbox, weft's own
    mirrors left out. ``current``: the mirrors into the origin now (a port
    keeps its owner while it still listens, so two containers racing for one
    port do not swap).
    """
    current = current or {}
    into_origin: dict[int, str] = {}
    collisions: list[Collision] = []
    for port, name in sorted(current.items()):
        if port in shadow_ports.get(name, ()) and port not in local_ports:
            into_origin[port] = name
    for name in sorted(shadow_ports):
        for port in sorted(shadow_ports[name]):
            if port in local_ports:
                collisions.append(Collision(port, name, HeldBy.LOCAL))
            elif into_origin.setdefault(port, name) != name:
                collisions.append(Collision(port, name, HeldBy.REMOTE, into_origin[port]))
    everything = local_ports | frozenset(into_origin)
    into_shadow = {name: frozenset(p for p in everything if p not in ports)
                   for name, ports in shadow_ports.items()}
    return Plan(into_origin, into_shadow, tuple(collisions))
