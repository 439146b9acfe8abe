"""The origin's ranking of peers from their last Hello, by the host's own admission rule."""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from shim.core.reroute.admission import AdmitReason, admit
from shim.core.reroute.resources import Resources


@dataclass(frozen=True)
class PeerView:
    """A peer as its last Hello described it."""

    node: str
    cpu_host: bool
    healthy: bool
    free: Resources
    sampled_age_s: float
    draining: bool = False


class PeerRejection(enum.Enum):
    """Why the origin will not try a peer: its view is stale, or the peer would refuse at Admit."""

    STALE = "stale"
    UNHEALTHY = AdmitReason.UNHEALTHY.value
    NOT_A_CPU_HOST = AdmitReason.NOT_A_CPU_HOST.value
    INSUFFICIENT_CPU = AdmitReason.INSUFFICIENT_CPU.value
    INSUFFICIENT_MEMORY = AdmitReason.INSUFFICIENT_MEMORY.value
    NO_LIMITS = AdmitReason.NO_LIMITS.value
    DRAINING = AdmitReason.DRAINING.value


@dataclass(frozen=True)
class PeerRanking:
    candidates: tuple[str, ...]  # in the order to try
    rejected: tuple[tuple[str, str], ...]  # (node, PeerRejection value), by node name


def draw(salt: str, node: str) -> int:
    """A number from ``salt`` and ``node`` alone: the same placement draws the same, another draws afresh."""
    return int.from_bytes(hashlib.blake2b(f"{salt}\0{node}".encode(), digest_size=8).digest(), "big")


def choose_peers(limits: Resources, peers: Iterable[PeerView], *, max_age_s: float = 30.0,
                 spread: str = "") -> PeerRanking:
    """The peers that would admit ``limits``, most room left first.

    Most free CPU after placement first, because CPU is what the rerouted
    container competes for on a host; then most free memory after; then the
    node name, so the same views in any order give the same ranking. A view
    older than ``max_age_s`` is not trusted for anything, health included.
    Admit still has the last word: the peer may have filled up since.

    With ``spread`` (the placement's own key, and the origin's name): the
    better of two fitting peers drawn by it goes first, then the rest by room
    with ties by the draw. Origins with the same views (a fleet placing at
    once) then do not all ask the same roomiest host first, fill it, and move
    on together to the next (two random choices, as load balancers do).
    """
    fits: list[tuple[float, int, str]] = []
    rejected: list[tuple[str, str]] = []
    for peer in peers:
        if peer.sampled_age_s > max_age_s:
            rejected.append((peer.node, PeerRejection.STALE.value))
            continue
        decision = admit(limits, peer.free, healthy=peer.healthy, cpu_host=peer.cpu_host, draining=peer.draining)
        if decision.admitted:
            after = decision.free_after
            fits.append((-after.cpu_cores, -after.memory_bytes, peer.node))
        else:
            rejected.append((peer.node, PeerRejection(decision.reason.value).value))
    rejected.sort()
    if not spread:
        fits.sort()
        return PeerRanking(tuple(node for _, _, node in fits), tuple(rejected))
    ranked = sorted(fits, key=lambda f: (f[0], f[1], draw(spread, f[2])))
    if len(ranked) > 2:
        two = sorted(range(len(ranked)), key=lambda i: draw(spread + "\0two", ranked[i][2]))[:2]
        first = min(two)  # the roomier of the two
        ranked.insert(0, ranked.pop(first))
    return PeerRanking(tuple(node for _, _, node in ranked), tuple(rejected))
