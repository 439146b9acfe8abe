"""The origin's overall answer for one CPU container: rerouted to which peer, or local, and why."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from shim.core.reroute.ranking import PeerRejection, PeerView, choose_peers
from shim.core.reroute.resources import Resources
from shim.core.reroute.safety import ContainerFacts, check_safety


class RerouteReason(enum.Enum):
    REROUTED = "rerouted"
    NO_PEERS = "no-peers"  # no fresh, healthy CPU host is known
    NO_PEER_FITS = "no-peer-fits"  # live CPU hosts exist, none has room
    UNSAFE = "unsafe"  # the detail starts with the SafetyReason value
    PINNED_LOCAL = "pinned-local"


@dataclass(frozen=True)
class RerouteDecision:
    reason: RerouteReason
    candidates: tuple[str, ...]  # peers to try in order when REROUTED, then run locally; empty otherwise
    detail: str


# Peers rejected for these are not live CPU hosts; any other rejection came
# from a live host's Admit rules, i.e. the container did not fit.
# A draining host counts as not live: it takes nothing new, however much room it has.
_NOT_LIVE = frozenset({PeerRejection.STALE.value, PeerRejection.UNHEALTHY.value, PeerRejection.NOT_A_CPU_HOST.value,
                       PeerRejection.DRAINING.value})


def decide(
    facts: ContainerFacts,
    limits: Resources,
    peers: Iterable[PeerView],
    *,
    pinned_local: bool = False,
    max_age_s: float = 30.0,
    spread: str = "",
) -> RerouteDecision:
    """Where a CPU container runs: the peers to try in order, or here with the reason.

    ``limits`` are what the peers are asked to admit, normally
    ``facts.limits``. Every outcome other than REROUTED means "run locally",
    and so does REROUTED once every candidate has refused at Admit.
    """
    if pinned_local:
        return RerouteDecision(RerouteReason.PINNED_LOCAL, (), "pinned to this node; not considered for rerouting")
    safety = check_safety(facts)
    if not safety.safe:
        return RerouteDecision(RerouteReason.UNSAFE, (), f"{safety.reason.value}: {safety.detail}")
    ranking = choose_peers(limits, peers, max_age_s=max_age_s, spread=spread)
    if ranking.candidates:
        return RerouteDecision(
            RerouteReason.REROUTED, ranking.candidates, f"{limits} fits on: {', '.join(ranking.candidates)}"
        )
    seen = ", ".join(f"{node} {why}" for node, why in ranking.rejected)
    if any(why not in _NOT_LIVE for _, why in ranking.rejected):
        return RerouteDecision(RerouteReason.NO_PEER_FITS, (), f"{limits} fits on no peer: {seen}")
    return RerouteDecision(RerouteReason.NO_PEERS, (), f"no live CPU host: {seen}" if seen else "no peers known")
