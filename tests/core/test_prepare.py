"""shim.core.prepare: whether and where an opted-in pod's shadow sandbox is made ahead of its containers."""

from __future__ import annotations

from shim.core.prepare import PREPARE_ANNOTATION, PrepareReason, decide_prepare, prefer
from shim.core.reroute import PeerView, Resources


def peer(node: str, cpu: float = 2.0, memory: int = 4 << 30, *, healthy: bool = True, age: float = 1.0,
         cpu_host: bool = True, draining: bool = False) -> PeerView:
    return PeerView(node, cpu_host, healthy, Resources(cpu, memory), age, draining)


def decide(annotations=None, peers=(), **kw):
    args = {"enabled": True, "host_namespaces": False, "privileged": False} | kw
    return decide_prepare(annotations or {}, peers, **args)


def test_the_cpu_host_with_most_room_is_chosen() -> None:
    d = decide(peers=[peer("cpu-1", 1.0), peer("cpu-2", 3.0)])
    assert (d.reason, d.node) == (PrepareReason.PREPARED, "cpu-2")


def test_stale_unhealthy_draining_and_gpu_only_peers_are_not_chosen() -> None:
    peers = [peer("a", age=100.0), peer("b", healthy=False), peer("c", draining=True), peer("d", cpu_host=False)]
    d = decide(peers=peers)
    assert d.reason is PrepareReason.NO_PEERS and d.node == ""
    assert decide().detail == "no peers"


def test_switched_off_opted_out_or_unsafe_prepares_nothing() -> None:
    peers = [peer("cpu-1")]
    assert decide(peers=peers, enabled=False).reason is PrepareReason.DISABLED
    assert decide({PREPARE_ANNOTATION: "false"}, peers).reason is PrepareReason.OPTED_OUT
    assert decide({PREPARE_ANNOTATION: "true"}, peers).reason is PrepareReason.PREPARED
    assert decide(peers=peers, host_namespaces=True).reason is PrepareReason.UNSAFE
    assert decide(peers=peers, privileged=True).reason is PrepareReason.UNSAFE


def test_the_prepared_host_goes_first_only_when_it_is_a_candidate() -> None:
    assert prefer(("a", "b", "c"), "c") == ("c", "a", "b")
    assert prefer(("a", "b"), "z") == ("a", "b")
    assert prefer(("a", "b"), None) == ("a", "b")
