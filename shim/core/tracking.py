"""Which peers an agent says Hello to: a bounded set, however large the fleet.

Pure, so that the mesh node and its tests run the same rules. An agent keeps
fresh capacity only for the peers it has business with:

* a fleet no larger than the bound: every peer, every round (a small mesh
  behaves as it always did);
* **business**: peers this node has calls or streams open with, or used
  lately (the hosts of its own shadows above all);
* **candidates**, on a node that places containers: at most ``limit`` CPU
  hosts, those with the most room this node knows of, every few rounds;
* **probes**: a few cold CPU hosts each round, taken in turn from a cursor
  that goes round the fleet by node name, so that every host's room is
  learnt in time and a roomier host replaces a fuller candidate; an empty
  candidate slot is filled by probing at once. Each origin's cursor starts
  at a host drawn by its own name, so a fleet of origins does not learn the
  same hosts first.

When placement needs more than the candidates offer, :func:`refresh_order`
names the cold hosts to ask now, in the same rotation. A host-only node
places nothing, so it has no candidates and probes nothing: its Hellos go
only to peers it has business with.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Collection, Iterable, Sequence, Sized
from dataclasses import dataclass

from shim.core.reroute import PeerView, Resources, choose_peers, draw

# Candidates an origin keeps fresh; and a small fleet's size, up to which every peer is said Hello to.
TRACKED_PEERS = 16
# Cold CPU hosts said Hello to each round besides the candidates (rotation through the fleet).
PROBES_PER_ROUND = 1
# In a large fleet the candidates are said Hello to about this often (their views stay well within
# placement's age limit of 30 s or more; Admit has the last word anyway); business and probes every round.
CANDIDATE_REFRESH_S = 10.0


def candidate_every(hello_interval: float) -> int:
    """Rounds between the candidates' Hellos: every ``CANDIDATE_REFRESH_S``, or every round when longer."""
    return max(1, int(CANDIDATE_REFRESH_S // hello_interval)) if hello_interval > 0 else 1


# A peer this node used (a client handed out, a call made) this recently still counts as business.
BUSINESS_S = 30.0
# An on-demand refresh asks this many cold hosts at once, for at most this long in all; after one that found
# no room, placement does not ask again for the same need or more for a while.
REFRESH_BATCH = 16
REFRESH_BUDGET_S = 2.0
NO_ROOM_HOLD_S = 5.0


# What "has room" means before placement said what it needs: a container of a millicore and a byte.
ANY_ROOM = Resources(0.001, 1)


class TrackReason(enum.Enum):
    FLEET = "fleet"  # the fleet is no larger than the bound: every peer
    BUSINESS = "business"  # a call or stream open with it, or one lately: e.g. it runs this node's shadows
    CANDIDATE = "candidate"  # one of the CPU hosts with the most room this node knows of
    PROBE = "probe"  # the next cold CPU host in the rotation, to learn its room
    REFRESH = "refresh"  # placement needed more room than the candidates had: asked now


@dataclass(frozen=True)
class Known:
    """A peer as this node knows it: whether it may host, and its last Hello (None: never heard)."""

    node: str
    cpu_host: bool  # its role as it said or as declared; True while unknown
    view: PeerView | None = None


@dataclass(frozen=True)
class RoundPlan:
    hello: tuple[tuple[str, TrackReason], ...]  # each peer once, by node name
    cursor: str  # where the rotation goes on next round

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(node for node, _ in self.hello)


def small_fleet(known: Sized, limit: int) -> bool:
    """A fleet no larger than the bound: every peer is said Hello to, as in a small mesh."""
    return len(known) <= limit


def plan_round(known: Sequence[Known], candidates: Collection[str], business: Collection[str], *,
               placing: bool, limit: int = TRACKED_PEERS, probes: int = PROBES_PER_ROUND,
               cursor: str = "", candidates_due: bool = True) -> RoundPlan:
    """The peers to say Hello to this round, and why (the candidates only when ``candidates_due``)."""
    names = {k.node for k in known}
    if small_fleet(known, limit):
        return RoundPlan(tuple((k.node, TrackReason.FLEET) for k in sorted(known, key=lambda k: k.node)), cursor)
    why: dict[str, TrackReason] = {n: TrackReason.BUSINESS for n in business if n in names}
    if placing:
        kept = [n for n in candidates if n in names]
        for n in kept if candidates_due else ():
            why.setdefault(n, TrackReason.CANDIDATE)
        count = probes + max(0, limit - len(kept))
        cold, cursor = rotation(known, exclude=set(why) | set(kept), start=cursor, count=count)
        for n in cold:
            why[n] = TrackReason.PROBE
    return RoundPlan(tuple(sorted(why.items())), cursor)


def rotation(known: Sequence[Known], *, exclude: Collection[str], start: str, count: int) -> tuple[
        tuple[str, ...], str]:
    """Up to ``count`` CPU hosts after ``start`` by node name (wrapping round), none of ``exclude``; and the
    cursor to go on from. Stable when peers come and go: the cursor is a name, not an index."""
    order = sorted(k.node for k in known if k.cpu_host and k.node not in exclude)
    if not order or count <= 0:
        return (), start
    i = bisect.bisect_right(order, start)
    picked = tuple(order[(i + j) % len(order)] for j in range(min(count, len(order))))
    return picked, picked[-1]


def start_cursor(known: Sequence[Known], seed: str) -> str:
    """Where an origin's rotation starts: a CPU host drawn by ``seed`` (the origin's name). Origins started at
    once then probe different hosts first and come to know different ones, rather than all walking the fleet
    from its first name in step."""
    order = sorted(k.node for k in known if k.cpu_host)
    return order[draw(seed, "cursor") % len(order)] if order else ""


def live(view: PeerView, max_age_s: float) -> bool:
    """Fresh, healthy, a CPU host and not draining: a host placement may try."""
    return view.sampled_age_s <= max_age_s and view.healthy and view.cpu_host and not view.draining


def choose_candidates(views: Iterable[PeerView], *, limit: int = TRACKED_PEERS,
                      max_age_s: float = 30.0) -> tuple[str, ...]:
    """The live CPU hosts with the most room (free CPU, then memory, then name), at most ``limit``.

    A host that stopped answering, is draining or says it is unhealthy is no candidate: a probe takes its
    place. A full host stays a candidate only while no roomier one is known.
    """
    ranked = sorted((v for v in views if live(v, max_age_s)),
                    key=lambda v: (-v.free.cpu_cores, -v.free.memory_bytes, v.node))
    return tuple(v.node for v in ranked[:limit])


def fits(need: Resources, views: Iterable[PeerView], *, max_age_s: float = 30.0) -> bool:
    """Whether any of ``views`` would admit ``need`` by its last Hello (placement's own rule)."""
    return bool(choose_peers(need, views, max_age_s=max_age_s).candidates)


def refresh_order(known: Sequence[Known], tracked: Collection[str], *, start: str) -> tuple[str, ...]:
    """Every cold CPU host, in rotation order from ``start``: what an on-demand refresh asks, batch by batch."""
    order, _ = rotation(known, exclude=set(tracked), start=start, count=len(known))
    return order


# A host pushes its room on an origin's Watch (in place of the origin's Hellos) when it has moved this much since
# it last pushed: the larger of an absolute step and a share of what the host has. Measured load moves a little
# all the time; pushing every wobble to every watching origin would cost what the Hellos did. Admit has the last
# word, and each heartbeat carries the room anyway.
ROOM_STEP_CPU = 0.1
ROOM_STEP_MEMORY = 64 << 20
ROOM_STEP_SHARE = 0.05


def room_moved(told: Resources, now: Resources, allocatable: Resources) -> bool:
    """Whether free room ``now`` differs enough from what was last ``told`` to push it at once; pure."""
    cpu_step = max(ROOM_STEP_CPU, ROOM_STEP_SHARE * allocatable.cpu_cores)
    memory_step = max(ROOM_STEP_MEMORY, ROOM_STEP_SHARE * allocatable.memory_bytes)
    return (abs(now.cpu_cores - told.cpu_cores) >= cpu_step
            or abs(now.memory_bytes - told.memory_bytes) >= memory_step
            or (now.cpu_cores <= 0) != (told.cpu_cores <= 0) or (now.memory_bytes <= 0) != (told.memory_bytes <= 0))
