import pytest

from shim.core.baseline import BaselineReason, SecurityFacts, beyond_baseline, check_baseline


@pytest.mark.parametrize(
    ("facts", "reason", "detail"),
    [
        pytest.param(SecurityFacts(), BaselineReason.BASELINE, "within", id="nothing-asked"),
        pytest.param(SecurityFacts(added_capabilities=("CAP_CHOWN", "net_bind_service", "SYS_CHROOT")),
                     BaselineReason.BASELINE, "within", id="baseline-capabilities-in-any-spelling"),
        pytest.param(SecurityFacts(added_capabilities=("ALL",)), BaselineReason.CAPABILITIES, "ALL", id="all"),
        pytest.param(SecurityFacts(added_capabilities=("CAP_SYS_ADMIN", "CHOWN")), BaselineReason.CAPABILITIES,
                     "SYS_ADMIN", id="sys-admin"),
        pytest.param(SecurityFacts(selinux=(("", "", "spc_t"),)), BaselineReason.SELINUX, "type=spc_t",
                     id="selinux-type"),
        pytest.param(SecurityFacts(selinux=(("system_u", "", "container_t"),)), BaselineReason.SELINUX,
                     "user=system_u", id="selinux-user"),
        pytest.param(SecurityFacts(selinux=(("", "", "container_t"),)), BaselineReason.BASELINE, "within",
                     id="selinux-container-t"),
        pytest.param(SecurityFacts(sysctls=("net.ipv4.ip_local_port_range", "kernel.msgmax")),
                     BaselineReason.SYSCTLS, "kernel.msgmax", id="unsafe-sysctl"),
        pytest.param(SecurityFacts(sysctls=("net.ipv4.tcp_syncookies",)), BaselineReason.BASELINE, "within",
                     id="safe-sysctl"),
        pytest.param(SecurityFacts(target_namespace=True), BaselineReason.TARGET_NAMESPACE, "another container",
                     id="target-namespace"),
        pytest.param(SecurityFacts(added_capabilities=("NET_ADMIN",), sysctls=("kernel.msgmax",)),
                     BaselineReason.CAPABILITIES, "NET_ADMIN", id="capabilities-first"),
    ],
)
def test_check_baseline_names_the_first_rule_broken(facts: SecurityFacts, reason: BaselineReason,
                                                    detail: str) -> None:
    got = check_baseline(facts)
    assert got.reason is reason and detail in got.detail
    assert got.allowed is (reason is BaselineReason.BASELINE)


def test_beyond_baseline_is_sorted_and_unique() -> None:
    assert beyond_baseline(["cap_net_admin", "NET_ADMIN", "SYS_PTRACE", "KILL"]) == ("NET_ADMIN", "SYS_PTRACE")
