"""The watchdog's rules: which usage breaks a lease, and whose cgroup a process is in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from shim.broker.metrics import BrokerMetrics
from shim.broker.nvml import NvmlBackend
from shim.broker.service import LeaseService
from shim.broker.simulated import SimulatedBackend
from shim.broker.watchdog import Violation, ViolationReason, Watchdog, cgroup_of, find_violations
from shim.core.leases import LeaseState
from shim.state.leases import LeaseRecord, LeaseStore
from tests.broker.fakes import MIG_A, MIG_B, FakeNvml, proc, two_instances, write_mig_caps

GI = 2**30
U0 = "GPU-00000000-0000-4000-8000-000000000000"
U1 = "GPU-00000000-0000-4000-8000-000000000001"
DEVICE_MEMORY = {U0: 80 * GI, U1: 80 * GI}


def lease(lease_id: str, shared: bool, memory: int, devices: tuple[str, ...] = (U0,)) -> LeaseRecord:
    return LeaseRecord(lease_id=lease_id, key=f"sb/{lease_id}/0", namespace="ns", pod="pod", pod_uid="uid",
                       container=lease_id, sandbox_id="sb", device_uuids=devices,
                       device_indices=tuple(range(len(devices))), memory_bytes=memory,
                       compute_percent=50 if shared else 100, shared=shared, state=LeaseState.BOUND,
                       container_id=lease_id * 8, pid=100, cgroup=f"/kubepods/{lease_id}")


SHARED = lease("shared", True, 20 * GI)
# An exclusive lease whose stored memory is below the device's: the device is the limit.
EXCLUSIVE = lease("whole", False, 10 * GI)


@pytest.mark.parametrize(
    ("usage", "foreign", "expected"),
    [
        pytest.param({("shared", U0): (21 * GI, [11, 12])}, {},
                     [Violation("shared", U0, 21 * GI, 20 * GI, (11, 12), "over its memory lease")],
                     id="shared-lease-over-its-memory"),
        pytest.param({("shared", U0): (20 * GI, [11])}, {}, [], id="shared-lease-exactly-at-its-limit"),
        pytest.param({("shared", U0): (GI, [11])}, {}, [], id="shared-lease-well-under"),
        pytest.param({("whole", U0): (50 * GI, [21])}, {}, [], id="exclusive-lease-may-use-the-whole-device"),
        pytest.param({("whole", U0): (80 * GI + 1, [21])}, {},
                     [Violation("whole", U0, 80 * GI + 1, 80 * GI, (21,), "over its memory lease")],
                     id="exclusive-lease-limited-by-device-memory"),
        pytest.param({}, {"shared": [(U1, 13)]},
                     [Violation("shared", U1, 0, 0, (13,), "on a device outside its lease")],
                     id="process-on-a-device-outside-its-lease"),
        pytest.param({}, {}, [], id="no-usage-no-violation"),
    ],
)
def test_find_violations(usage: dict, foreign: dict, expected: list[Violation]) -> None:
    assert find_violations([SHARED, EXCLUSIVE], usage, foreign, DEVICE_MEMORY) == expected


def test_a_shared_leases_process_outside_mps_is_a_violation_whatever_it_holds() -> None:
    outside = {"shared": [(U0, 14, GI)]}
    assert find_violations([SHARED, EXCLUSIVE], {("shared", U0): (GI, [14])}, {}, DEVICE_MEMORY, outside) == [
        Violation("shared", U0, GI, 20 * GI, (14,), ViolationReason.OUTSIDE_MPS)]


@pytest.mark.parametrize(
    ("shared", "mps_client", "reasons"),
    [
        pytest.param(True, False, ["outside-mps"], id="shared-lease-context-of-its-own"),
        pytest.param(True, True, [], id="shared-lease-mps-client"),
        pytest.param(True, None, [], id="backend-cannot-tell-judges-nothing"),
        pytest.param(False, False, [], id="whole-device-lease-needs-no-mps"),
    ],
)
def test_watchdog_names_a_process_outside_its_leases_mps_server(
    tmp_path: Path, shared: bool, mps_client: bool | None, reasons: list[str]
) -> None:
    backend = SimulatedBackend("1x80Gi")
    service = LeaseService(backend, LeaseStore(tmp_path))
    child = subprocess.Popen(["sleep", "60"])
    try:
        rec = service.acquire(key="sb/app/0", namespace="ns", pod="pod", pod_uid="uid", container="app",
                              sandbox_id="sb", memory_bytes=10 * GI if shared else 0, compute_percent=0, count=1,
                              allowed=())
        service.bind(rec.lease_id, "c" * 64, child.pid, cgroup_of(child.pid))
        backend.set_process(child.pid, rec.device_uuids[0], GI, mps_client=mps_client)
        watchdog = Watchdog(service, BrokerMetrics(service), action="log")
        with capture_logs() as logs:
            watchdog.tick()
        seen = [e for e in logs if e["event"] == "lease.violation"]
        assert [e["reason"] for e in seen] == reasons
        assert all(e["pids"] == [child.pid] and e["action"] == "log" for e in seen)
        assert child.poll() is None, "logging never kills"
    finally:
        child.kill()
        child.wait()
        service.store.close()


def test_kill_is_the_default_action(tmp_path: Path) -> None:
    service = LeaseService(SimulatedBackend("1x80Gi"), LeaseStore(tmp_path))
    try:
        assert Watchdog(service, BrokerMetrics(service)).action == "kill"
    finally:
        service.store.close()


def test_each_lease_is_judged_by_its_own_limit() -> None:
    usage = {("shared", U0): (30 * GI, [1]), ("whole", U0): (30 * GI, [2])}
    assert [v.lease_id for v in find_violations([SHARED, EXCLUSIVE], usage, {}, DEVICE_MEMORY)] == ["shared"]


def test_cgroup_of_this_process_is_its_cgroup_path() -> None:
    path = cgroup_of(os.getpid())
    assert path.startswith("/")
    assert path in Path("/proc/self/cgroup").read_text()


def test_cgroup_of_a_finished_process_is_empty() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert cgroup_of(proc.pid) == ""


@pytest.mark.parametrize(
    ("instance_ids", "used", "reasons"),
    [
        pytest.param((7, 0), GI, [], id="on-its-instance-within-its-share"),
        pytest.param((7, 0), 3 * GI, ["over-memory"], id="on-its-instance-over-its-share"),
        pytest.param((2, 0), GI, ["foreign-device"], id="on-the-other-instance-of-the-same-gpu"),
    ],
)
def test_watchdog_judges_a_process_on_a_mig_gpu_by_its_instance(
    tmp_path: Path, instance_ids: tuple[int, int], used: int, reasons: list[str]
) -> None:
    fake = FakeNvml(mps_list=True)
    fake.enable_mig(two_instances())
    write_mig_caps(tmp_path / "proc", 0, 7, 0, 66, 67)
    backend = NvmlBackend(library=fake, proc_root=tmp_path / "proc")
    service = LeaseService(backend, LeaseStore(tmp_path / "state"))
    child = subprocess.Popen(["sleep", "60"])
    try:
        rec = service.acquire(key="sb/app/0", namespace="ns", pod="pod", pod_uid="uid", container="app",
                              sandbox_id="sb", memory_bytes=2 * GI, compute_percent=50, count=1, allowed=(MIG_A,))
        service.bind(rec.lease_id, "c" * 64, child.pid, cgroup_of(child.pid))
        fake.mps["h0"] = [proc(child.pid, used, *instance_ids)]  # listed on the GPU, with its instance's ids
        with capture_logs() as logs:
            Watchdog(service, BrokerMetrics(service), action="log").tick()
        seen = [e for e in logs if e["event"] == "lease.violation"]
        assert [e["reason"] for e in seen] == reasons
        assert all(e["device"] == (MIG_A if instance_ids == (7, 0) else MIG_B) for e in seen)
    finally:
        child.kill()
        child.wait()
        service.store.close()
        backend.close()
