"""Whether the origin prepares an opted-in pod's shadow sandbox on a host before any container asks, and where.

A rerouted container's first start pays for a new shadow sandbox on its host
(RunPodSandbox there: the pause container, the network). The origin can make
that sandbox while its own sandbox is being made, as soon as RunPodSandbox of
an opted-in pod arrives, on the host its CPU container would most likely go
to: the CPU host with the most room now. Kubelet's container configs are not
known yet, so this is a guess; a wrong guess costs one idle pause container
on a host for ``mesh.prepared_sandbox_ttl``, after which the host removes it.

``PrepareDecision`` is a value with its reason, as every decision of weft is.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from shim.core.reroute import PeerView, Resources, choose_peers

# The pod may say no: "false" on this annotation (a pod that reroutes nothing, or only rarely).
PREPARE_ANNOTATION = "weft.io/prepare-shadow-sandbox"
# What a candidate host must have free to be worth preparing on: the container's limits are not known yet.
PROBE = Resources(0.01, 1 << 20)


class PrepareReason(enum.Enum):
    PREPARED = "prepared"  # a host is asked to make the shadow sandbox now
    DISABLED = "disabled"  # mesh.prepare_shadow_sandbox is off
    OPTED_OUT = "opted-out"  # the pod's annotation says false
    UNSAFE = "unsafe"  # the sandbox itself could never be rerouted (host namespaces, privileged)
    NO_PEERS = "no-peers"  # no fresh, healthy CPU host with room


@dataclass(frozen=True)
class PrepareDecision:
    reason: PrepareReason
    node: str  # the host to prepare on when PREPARED, else ""
    detail: str


def decide_prepare(annotations: Mapping[str, str], peers: Iterable[PeerView], *, enabled: bool,
                   host_namespaces: bool, privileged: bool, max_age_s: float = 30.0,
                   spread: str = "") -> PrepareDecision:
    """Prepare on the CPU host with the most room now (with ``spread``, the one placement will try first:
    drawn with its salt, among hosts with any room), unless switched off, opted out, unsafe or none fits."""
    if not enabled:
        return PrepareDecision(PrepareReason.DISABLED, "", "mesh.prepare_shadow_sandbox is off")
    if annotations.get(PREPARE_ANNOTATION, "").strip().lower() in ("false", "no", "0"):
        return PrepareDecision(PrepareReason.OPTED_OUT, "", f"{PREPARE_ANNOTATION}: {annotations[PREPARE_ANNOTATION]}")
    if host_namespaces or privileged:
        what = "host namespaces" if host_namespaces else "a privileged sandbox"
        return PrepareDecision(PrepareReason.UNSAFE, "", f"no container of a pod with {what} is rerouted")
    ranking = choose_peers(PROBE, peers, max_age_s=max_age_s, spread=spread)
    if not ranking.candidates:
        seen = ", ".join(f"{node} {why}" for node, why in ranking.rejected)
        return PrepareDecision(PrepareReason.NO_PEERS, "", f"no CPU host with room: {seen}" if seen else "no peers")
    node = ranking.candidates[0]
    return PrepareDecision(PrepareReason.PREPARED, node,
                           f"the roomier of two drawn: {node}" if spread else f"most room now: {node}")


def prefer(candidates: tuple[str, ...], prepared: str | None) -> tuple[str, ...]:
    """The candidates in order, the host holding the pod's prepared sandbox first when it is one of them."""
    if not prepared or prepared not in candidates:
        return candidates
    return (prepared, *(c for c in candidates if c != prepared))
