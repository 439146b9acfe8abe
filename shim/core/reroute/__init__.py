"""Whether a CPU container may leave this node, and for which peer.

Four decisions, each pure so that the agent, the peer's Admit handler, the
fleet simulator and ``weft explain`` run the same rules:

* :func:`check_safety` (``safety``, the mounts in ``mounts``): a container that leans on this node (privilege, host
  namespaces, host paths, devices, a volume shared with a container that stays
  here) cannot be moved without changing what it sees; nor can one without
  limits, because a peer admits by limits.
* :func:`free_capacity` and :func:`admit` (``admission``): the peer's side. It hosts only what
  fits its *real* free capacity, so its own pods never lose what the scheduler
  promised them (docs/design.md).
* :func:`choose_peers` (``ranking``): the origin's ranking of peers from their last Hello,
  using :func:`admit` itself so both sides agree on what fits.
* :func:`decide` (``decision``): the origin's overall answer for one CPU container.

Running locally is always a valid fallback (the scheduler reserved the whole
pod here), so none of these raise for policy reasons: a refusal is a decision
with a reason, and the reason's value is what crictl annotations and
``weft explain`` show.
"""

from __future__ import annotations

from shim.core.reroute.admission import AdmitDecision, AdmitReason, admit, free_capacity
from shim.core.reroute.decision import RerouteDecision, RerouteReason, decide
from shim.core.reroute.mounts import KUBELET_PODS_DIR, MountSort, classify_mounts
from shim.core.reroute.ranking import PeerRanking, PeerRejection, PeerView, choose_peers, draw
from shim.core.reroute.resources import ZERO, Resources
from shim.core.reroute.safety import ContainerFacts, SafetyDecision, SafetyReason, check_safety

__all__ = [
    "KUBELET_PODS_DIR", "ZERO", "AdmitDecision", "AdmitReason", "ContainerFacts", "MountSort",
    "PeerRanking", "PeerRejection", "PeerView", "RerouteDecision", "RerouteReason", "Resources",
    "SafetyDecision", "SafetyReason", "admit", "check_safety", "choose_peers", "classify_mounts",
    "decide", "draw", "free_capacity",
]
