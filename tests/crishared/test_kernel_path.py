"""KernelForwards: which ports the kernel carries, and what it asks of the pod's namespace (a fake one here)."""

from __future__ import annotations

from shim.core.datapath import PathReason
from shim.crishared import kernel_path
from shim.crishared.kernel_path import KernelForwards


class FakeNs:
    """Records what would run inside the namespace; ``reachable`` says which (ip, port) accept a connection."""

    def __init__(self, reachable: set[tuple[str, int]], fail_install: bool = False) -> None:
        self.reachable, self.fail_install = reachable, fail_install
        self.calls: list[tuple] = []
        self.probes: list[tuple[str, int]] = []

    def connect(self, host: str, port: int, timeout: float):
        self.probes.append((host, port))
        if (host, port) not in self.reachable:
            raise ConnectionRefusedError(111, "Connection refused")
        return _Closed()

    def run(self, fn, *args):
        self.calls.append((fn.__name__, *args))
        if fn is kernel_path.install and self.fail_install and args[0]:
            raise OSError(95, "Operation not supported")
        return True


class _Closed:
    def close(self) -> None:
        pass


def _paths(k: KernelForwards) -> dict[int, str]:
    return {port: d.reason.value for port, (_, d) in k.paths().items()}


def test_a_reachable_port_is_forwarded_and_a_loopback_only_one_is_not() -> None:
    ns = FakeNs({("10.0.1.5", 8080)})
    k = KernelForwards(ns, "sb", enabled=True)
    k.update({8080: ("10.0.1.5", "web"), 8081: ("10.0.1.5", "web")})
    assert _paths(k) == {8080: "kernel", 8081: "not-reachable"}
    assert ns.calls == [("install", {8080: "10.0.1.5"}, frozenset())]
    # Nothing changed: no rules are written again, and a reachable port is not probed again.
    ns.calls.clear()
    probes = len(ns.probes)
    k.update({8080: ("10.0.1.5", "web"), 8081: ("10.0.1.5", "web")})
    assert ns.calls == [] and ns.probes[probes:] == []  # 8081 waits REPROBE_S before it is tried again


def test_the_rules_follow_the_shadow_when_it_moves_and_go_with_it() -> None:
    ns = FakeNs({("10.0.1.5", 8080), ("10.0.2.9", 8080)})
    k = KernelForwards(ns, "sb", enabled=True)
    k.update({8080: ("10.0.1.5", "web")})
    ns.calls.clear()
    k.update({8080: ("10.0.2.9", "web")})  # the container moved to another host
    assert ns.calls == [("install", {8080: "10.0.2.9"}, frozenset()), ("forget_connections", {"10.0.1.5"})]
    ns.calls.clear()
    k.close()
    assert ns.calls == [("install", {})] and k.paths() == {}


def test_a_cut_host_gets_its_connections_reset_until_it_answers_again() -> None:
    ns = FakeNs({("10.0.1.5", 8080)})
    k = KernelForwards(ns, "sb", enabled=True)
    k.update({8080: ("10.0.1.5", "web")})
    ns.calls.clear()
    k.update({8080: ("10.0.1.5", "web")}, frozenset({"10.0.1.5"}))
    assert ns.calls == [("install", {8080: "10.0.1.5"}, frozenset({"10.0.1.5"}))]
    ns.calls.clear()
    k.update({8080: ("10.0.1.5", "web")})
    assert ns.calls == [("install", {8080: "10.0.1.5"}, frozenset())]


def test_rules_the_kernel_refuses_fall_back_to_the_tunnel_with_the_reason() -> None:
    ns = FakeNs({("10.0.1.5", 8080)}, fail_install=True)
    k = KernelForwards(ns, "sb", enabled=True)
    k.update({8080: ("10.0.1.5", "web")})
    (_, d), = k.paths().values()
    assert d.reason is PathReason.NO_KERNEL_SUPPORT and "Operation not supported" in d.detail
    ns.calls.clear()
    k.update({8080: ("10.0.1.5", "web")})  # not tried again
    assert all(call[1] == {} for call in ns.calls if call[0] == "install")


def test_switched_off_nothing_is_probed_and_no_rules_are_made() -> None:
    ns = FakeNs({("10.0.1.5", 8080)})
    k = KernelForwards(ns, "sb", enabled=False)
    k.update({8080: ("10.0.1.5", "web"), 9000: ("", "other")})
    assert _paths(k) == {8080: "disabled", 9000: "disabled"}
    assert ns.probes == [] and all(call[1] == {} for call in ns.calls)
