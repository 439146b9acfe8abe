"""shim.core.datapath: which data path carries a mirrored port, the kernel or the agents' tunnel."""

from __future__ import annotations

from shim.core.datapath import PathReason, choose_path, needs_probe


def test_a_reachable_ipv4_pod_ip_goes_through_the_kernel() -> None:
    d = choose_path(8080, "10.88.1.5", enabled=True, reachable=True)
    assert d.reason is PathReason.KERNEL and d.kernel and d.path == "kernel"
    assert "10.88.1.5:8080" in d.detail


def test_what_needs_no_probe_is_decided_without_one() -> None:
    assert not needs_probe("10.0.0.1", enabled=False)
    assert choose_path(1, "10.0.0.1", enabled=False).reason is PathReason.DISABLED
    for ip, reason in (("", PathReason.NO_POD_IP), ("garbage", PathReason.NO_POD_IP),
                       ("127.0.0.1", PathReason.NO_POD_IP), ("fd00::5", PathReason.NOT_IPV4)):
        assert not needs_probe(ip, enabled=True)
        d = choose_path(1, ip, enabled=True, reachable=True)
        assert d.reason is reason and d.path == "tunnel", ip
    assert needs_probe("10.0.0.1", enabled=True)


def test_unreachable_or_refused_rules_fall_back_to_the_tunnel_with_the_reason() -> None:
    d = choose_path(9000, "10.88.2.7", enabled=True, reachable=False, probe_error="Connection refused")
    assert d.reason is PathReason.NOT_REACHABLE and not d.kernel
    assert "Connection refused" in d.detail and "loopback only" in d.detail
    d = choose_path(9000, "10.88.2.7", enabled=True, reachable=True, kernel_error="no nf_tables")
    assert d.reason is PathReason.NO_KERNEL_SUPPORT and "no nf_tables" in d.detail
