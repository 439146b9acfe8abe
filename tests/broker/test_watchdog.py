"""The watchdog's rules: which usage breaks a lease, and whose cgroup a process is in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shim.broker.watchdog import Violation, cgroup_of, find_violations
from shim.core.leases import LeaseState
from shim.state.leases import LeaseRecord

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
