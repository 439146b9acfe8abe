"""The MPS supervisor against a fake ``nvidia-cuda-mps-control`` (``tests/broker/fakes.py``).

One daemon per lease: it sees only the lease's device, takes the lease's
limits as its defaults before any client connects, and proves it by reading
them back; a daemon that does not is never handed out.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from shim.broker.mps import MpsError, MpsLimits, MpsSupervisor, memory_matches, parse_memory, parse_percent
from tests.broker.fakes import install_fake_mps

GPU0 = "GPU-5e1a0000-0000-4000-8000-000000000000"
GPU1 = "GPU-5e1a0000-0000-4000-8000-000000000001"
LEASE_A, LEASE_B = "lease-00000000000000aa", "lease-00000000000000bb"
LIMITS = MpsLimits(memory_bytes=20 << 30, compute_percent=50)


@pytest.fixture
def fake_binary(tmp_path: Path) -> str:
    return install_fake_mps(tmp_path / "bin")


@pytest.fixture
def supervisor(tmp_path: Path, fake_binary: str) -> Iterator[MpsSupervisor]:
    sup = MpsSupervisor(tmp_path / "mps", binary=fake_binary, ready_timeout=10.0, stop_timeout=5.0)
    yield sup
    sup.stop_all()


def started_with(log_dir: Path) -> dict:
    return json.loads((log_dir / "fake-env.json").read_text())


def commands(log_dir: Path) -> list[str]:
    path = log_dir / "fake-commands.log"
    return path.read_text().split() if path.exists() else []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def until(condition, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)
    return result


def test_daemon_runs_in_foreground_with_its_device_and_directories(tmp_path: Path, supervisor: MpsSupervisor) -> None:
    # A strict umask must not leave the pipes unreachable to clients running as other users.
    umask = os.umask(0o077)
    try:
        with capture_logs() as logs:
            daemon = supervisor.ensure(LEASE_A, GPU0, LIMITS)
    finally:
        os.umask(umask)
    assert daemon.pipe_dir == tmp_path / "mps" / LEASE_A / "pipe"
    assert daemon.log_dir == tmp_path / "mps" / LEASE_A / "log"
    seen = started_with(daemon.log_dir)
    assert seen["pid"] == daemon.pid and alive(daemon.pid)
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == GPU0
    assert seen["env"]["CUDA_MPS_PIPE_DIRECTORY"] == str(daemon.pipe_dir)
    assert seen["env"]["CUDA_MPS_LOG_DIRECTORY"] == str(daemon.log_dir)
    assert seen["sid"] == daemon.pid, "the daemon leads its own session"
    for path in (daemon.pipe_dir, daemon.log_dir):
        assert stat.S_IMODE(path.stat().st_mode) == 0o755
    assert [e["event"] for e in logs] == ["mps.started"]
    assert (logs[0]["lease"], logs[0]["device"], logs[0]["pid"]) == (LEASE_A, GPU0, daemon.pid)


def test_each_lease_gets_its_own_daemon(supervisor: MpsSupervisor) -> None:
    first, second = supervisor.ensure(LEASE_A, GPU0, LIMITS), supervisor.ensure(LEASE_B, GPU1, LIMITS)
    assert first.pid != second.pid and first.pipe_dir != second.pipe_dir
    assert started_with(second.log_dir)["env"]["CUDA_VISIBLE_DEVICES"] == GPU1


def test_ensure_returns_the_running_daemon(supervisor: MpsSupervisor) -> None:
    first = supervisor.ensure(LEASE_A, GPU0, LIMITS)
    with capture_logs() as logs:
        again = supervisor.ensure(LEASE_A, GPU0, LIMITS)
    assert again == first
    assert logs == []


@pytest.mark.parametrize("notice", ["check", "ensure"], ids=["check-restarts", "ensure-restarts"])
def test_a_killed_daemon_is_restarted(supervisor: MpsSupervisor, notice: str) -> None:
    old = supervisor.ensure(LEASE_A, GPU0, LIMITS)
    os.kill(old.pid, signal.SIGKILL)
    until(lambda: not alive(old.pid) or _is_zombie(old.pid))
    with capture_logs() as logs:
        if notice == "check":
            assert until(supervisor.check) == [LEASE_A]
            new = supervisor.ensure(LEASE_A, GPU0, LIMITS)
        else:
            new = supervisor.ensure(LEASE_A, GPU0, LIMITS)
    assert new.pid != old.pid and alive(new.pid)
    assert started_with(new.log_dir)["pid"] == new.pid
    restarted = [e for e in logs if e["event"] == "mps.restarted"]
    assert len(restarted) == 1
    assert (restarted[0]["lease"], restarted[0]["exit_code"]) == (LEASE_A, -signal.SIGKILL)
    assert (restarted[0]["old_pid"], restarted[0]["pid"]) == (old.pid, new.pid)


def test_a_failed_restart_is_tried_again_at_the_next_check(
    supervisor: MpsSupervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = supervisor.ensure(LEASE_A, GPU0, LIMITS)
    monkeypatch.setenv("FAKE_MPS_EXIT_AT_START", "1")
    os.kill(old.pid, signal.SIGKILL)
    until(lambda: _is_zombie(old.pid))
    with capture_logs() as logs:
        assert supervisor.check() == []
    assert [(e["event"], e["exit_code"]) for e in logs] == [("mps.restart_failed", -signal.SIGKILL)]
    monkeypatch.delenv("FAKE_MPS_EXIT_AT_START")
    assert supervisor.check() == [LEASE_A]
    assert alive(supervisor.ensure(LEASE_A, GPU0, LIMITS).pid)


def test_check_leaves_live_daemons_alone(supervisor: MpsSupervisor) -> None:
    daemon = supervisor.ensure(LEASE_A, GPU0, LIMITS)
    assert supervisor.check() == []
    assert supervisor.ensure(LEASE_A, GPU0, LIMITS).pid == daemon.pid


def test_stop_quits_the_daemon_and_keeps_its_logs(supervisor: MpsSupervisor) -> None:
    daemon = supervisor.ensure(LEASE_A, GPU0, LIMITS)
    with capture_logs() as logs:
        supervisor.stop(LEASE_A)
    assert not alive(daemon.pid)
    assert commands(daemon.log_dir)[-1] == "quit"
    assert (daemon.log_dir / "fake-env.json").exists(), "stop removes nothing the user needs"
    assert [(e["event"], e["killed"], e["exit_code"]) for e in logs] == [("mps.stopped", False, 0)]
    assert supervisor.check() == [], "a stopped daemon is not restarted"


def test_stop_kills_a_daemon_that_ignores_quit(
    tmp_path: Path, fake_binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MPS_IGNORE_QUIT", "1")
    sup = MpsSupervisor(tmp_path / "mps", binary=fake_binary, stop_timeout=0.5)
    daemon = sup.ensure(LEASE_A, GPU0, LIMITS)
    with capture_logs() as logs:
        sup.stop(LEASE_A)
    assert not alive(daemon.pid)
    assert "quit" in commands(daemon.log_dir), "asked first"
    assert [(e["event"], e["killed"], e["exit_code"]) for e in logs] == [("mps.stopped", True, -signal.SIGKILL)]


def test_stop_of_a_device_without_daemon_is_a_no_op(supervisor: MpsSupervisor) -> None:
    with capture_logs() as logs:
        supervisor.stop(LEASE_A)
    assert logs == []


def test_stop_all_ends_every_daemon(supervisor: MpsSupervisor) -> None:
    daemons = [supervisor.ensure(LEASE_A, GPU0, LIMITS), supervisor.ensure(LEASE_B, GPU1, LIMITS)]
    supervisor.stop_all()
    assert not any(alive(d.pid) for d in daemons)
    assert supervisor.check() == []
    fresh = supervisor.ensure(LEASE_A, GPU0, LIMITS)
    assert fresh.pid not in {d.pid for d in daemons} and alive(fresh.pid)


def test_missing_binary_is_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere" / "nvidia-cuda-mps-control")
    with pytest.raises(MpsError, match=r"nowhere/nvidia-cuda-mps-control: not found"):
        MpsSupervisor(tmp_path / "mps", binary=missing).ensure(LEASE_A, GPU0, LIMITS)


def test_missing_binary_on_path_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MpsError, match="nvidia-cuda-mps-control: not found"):
        MpsSupervisor(tmp_path / "mps").ensure(LEASE_A, GPU0, LIMITS)


def test_daemon_that_exits_at_start_is_an_error_naming_its_logs(
    tmp_path: Path, fake_binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MPS_EXIT_AT_START", "1")
    sup = MpsSupervisor(tmp_path / "mps", binary=fake_binary)
    with pytest.raises(MpsError, match=f"exited with code 3.*{LEASE_A}/log"):
        sup.ensure(LEASE_A, GPU0, LIMITS)
    assert sup.check() == [], "a daemon that never started is not supervised"


@pytest.mark.parametrize("key", ["../escape", "", ".hidden", "a/b"], ids=["dot-dot", "empty", "dot", "slash"])
def test_lease_key_that_would_leave_its_directory_is_refused(supervisor: MpsSupervisor, key: str) -> None:
    with pytest.raises(ValueError, match="cannot name a directory"):
        supervisor.ensure(key, GPU0, LIMITS)


def test_device_list_is_refused(supervisor: MpsSupervisor) -> None:
    with pytest.raises(ValueError, match="is not one device"):
        supervisor.ensure(LEASE_A, f"{GPU0},{GPU1}", LIMITS)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return True


def test_the_lease_limits_are_the_daemons_defaults_before_any_client(supervisor: MpsSupervisor) -> None:
    daemon = supervisor.ensure(LEASE_A, GPU0, MpsLimits(memory_bytes=(3 << 30) + 1, compute_percent=30))
    sent = commands(daemon.log_dir)
    assert sent[sent.index("set_default_active_thread_percentage"):][:2] == ["set_default_active_thread_percentage",
                                                                           "30"]
    # Rounded up to whole MiB, on device 0: the only device the daemon sees.
    assert "3073M" in sent and sent[sent.index("3073M") - 2:sent.index("3073M")] == [
        "set_default_device_pinned_mem_limit", "0"]
    assert daemon.limits == MpsLimits((3 << 30) + 1, 30)
    # What a client of this daemon is held to (the fake libcuda reads it here, as a real server would hold it).
    assert (daemon.pipe_dir / "fake-limits").read_text().split() == ["3073", "30"]


def test_each_lease_daemon_holds_its_own_limits(supervisor: MpsSupervisor) -> None:
    a = supervisor.ensure(LEASE_A, GPU0, MpsLimits(4 << 30, 25))
    b = supervisor.ensure(LEASE_B, GPU0, MpsLimits(8 << 30, 50))
    assert a.pipe_dir != b.pipe_dir
    assert (a.pipe_dir / "fake-limits").read_text().split() == ["4096", "25"]
    assert (b.pipe_dir / "fake-limits").read_text().split() == ["8192", "50"]


def test_a_daemon_that_does_not_take_its_limits_is_never_handed_out(
    tmp_path: Path, fake_binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MPS_IGNORE_LIMITS", "1")
    sup = MpsSupervisor(tmp_path / "mps", binary=fake_binary, ready_timeout=5.0)
    with pytest.raises(MpsError, match=f"lease {LEASE_A} on {GPU0} shows an active thread percentage of '100.0' "
                                       "after it was set to 50"):
        sup.ensure(LEASE_A, GPU0, LIMITS)
    started = json.loads((tmp_path / "mps" / LEASE_A / "log" / "fake-env.json").read_text())["pid"]
    until(lambda: not alive(started) or _is_zombie(started))
    assert sup.daemons() == [] and sup.check() == []


def test_a_restarted_daemon_takes_the_same_limits_again(supervisor: MpsSupervisor) -> None:
    old = supervisor.ensure(LEASE_A, GPU0, MpsLimits(2 << 30, 40))
    os.kill(old.pid, signal.SIGKILL)
    until(lambda: _is_zombie(old.pid))
    assert supervisor.check() == [LEASE_A]
    new = supervisor.ensure(LEASE_A, GPU0)
    assert new.pid != old.pid and new.limits == MpsLimits(2 << 30, 40)
    assert (new.pipe_dir / "fake-limits").read_text().split() == ["2048", "40"]


def test_private_shm_gives_the_daemon_the_leases_shm_directory(tmp_path: Path, fake_binary: str) -> None:
    sup = MpsSupervisor(tmp_path / "mps", binary=fake_binary, private_shm=True)
    try:
        daemon = sup.ensure(LEASE_A, GPU0, LIMITS)
        # The daemon wrote into its /dev/shm; it landed in the lease's directory, not in the host's /dev/shm.
        marker = f"fake-mps-{daemon.pid}-{str(daemon.pipe_dir).replace('/', '_')}"
        assert (daemon.shm_dir / marker).exists()
        assert not (Path("/dev/shm") / marker).exists()
        assert stat.S_IMODE(daemon.shm_dir.stat().st_mode) == 0o1777
        assert started_with(daemon.log_dir)["pid"] == daemon.pid, "the supervised PID is the daemon itself"
    finally:
        sup.stop_all()


@pytest.mark.parametrize(
    ("answer", "percent"),
    [pytest.param("25", 25.0, id="whole"), pytest.param("25.0\n", 25.0, id="as-drivers-show-it"),
     pytest.param("0", None, id="zero"), pytest.param("25 %", None, id="with-a-unit"),
     pytest.param("", None, id="nothing")],
)
def test_parse_percent(answer: str, percent: float | None) -> None:
    assert parse_percent(answer) == percent


@pytest.mark.parametrize(
    ("answer", "size"),
    [pytest.param("20480M", 20 << 30, id="mebibytes"), pytest.param("20G\n", 20 << 30, id="gibibytes"),
     pytest.param("1024 MB", None, id="other-unit"), pytest.param("1.5G", None, id="fraction"),
     pytest.param("Unrecognized command", None, id="an-old-driver")],
)
def test_parse_memory(answer: str, size: int | None) -> None:
    assert parse_memory(answer) == size


@pytest.mark.parametrize(
    ("shown", "set_mib", "ok"),
    [pytest.param(512 << 20, 512, True, id="exact"), pytest.param(3 << 30, 3073, True, id="whole-gib-rounded-down"),
     pytest.param(4 << 30, 3073, False, id="rounded-up-is-not-what-was-set"),
     pytest.param(0, 512, False, id="no-limit")],
)
def test_memory_matches(shown: int, set_mib: int, ok: bool) -> None:
    assert memory_matches(shown, set_mib) is ok


# -- the pool: daemons started ahead, a lease's limits set when it takes one ------------------------------------
@pytest.fixture
def pooled(tmp_path: Path, fake_binary: str) -> Iterator[MpsSupervisor]:
    sup = MpsSupervisor(tmp_path / "mps", binary=fake_binary, ready_timeout=10.0, stop_timeout=5.0, pool=1)
    yield sup
    sup.stop_all()


def idle_on(sup: MpsSupervisor, device: str) -> list:
    return [d for d in sup.idle() if d.device_uuid == device and alive(d.pid)]


def test_a_pool_starts_a_daemon_ahead_with_no_limits_and_no_client(pooled: MpsSupervisor) -> None:
    with capture_logs() as logs:
        pooled.warm([GPU0, GPU1])
        until(lambda: len(idle_on(pooled, GPU0)) == 1 and len(idle_on(pooled, GPU1)) == 1)
    for daemon in pooled.idle():
        assert daemon.key.startswith("lease-") and daemon.limits is None
        assert (daemon.log_dir.parent / "pooled").exists(), "marked, so a broker started again finds it"
        assert started_with(daemon.log_dir)["env"]["CUDA_VISIBLE_DEVICES"] == daemon.device_uuid
        assert not any(c.startswith("set_") for c in commands(daemon.log_dir)), "nothing set before a lease"
    assert pooled.daemons() == [], "an idle daemon serves no lease"
    assert sorted(e["device"] for e in logs if e["event"] == "mps.pooled") == sorted([GPU0, GPU1])


def test_a_lease_takes_the_daemon_started_ahead_and_the_pool_fills_again(pooled: MpsSupervisor) -> None:
    pooled.warm([GPU0])
    [ahead] = until(lambda: idle_on(pooled, GPU0))
    with capture_logs() as logs:
        asked = time.time()
        daemon = pooled.take(GPU0, MpsLimits(4 << 30, 25))
    assert (daemon.pid, daemon.key, daemon.pipe_dir) == (ahead.pid, ahead.key, ahead.pipe_dir), "no daemon started"
    assert daemon.limits == MpsLimits(4 << 30, 25)
    assert (daemon.pipe_dir / "fake-limits").read_text().split() == ["4096", "25"], "read back before handed out"
    assert not (daemon.log_dir.parent / "pooled").exists()
    assert pooled.daemons() == [daemon]
    started = [e for e in logs if e["event"] == "mps.started"]
    assert [(e["lease"], e["pooled"], e["limits_ahead"]) for e in started] == [(daemon.key, True, False)]
    [next_one] = until(lambda: idle_on(pooled, GPU0))
    assert next_one.pid != daemon.pid and next_one.key != daemon.key
    started = (next_one.log_dir / "fake-env.json").stat().st_mtime
    assert started >= asked + 0.5, "not started while the container that took one starts"
    pooled.stop(daemon.key)
    assert not alive(daemon.pid) and (daemon.log_dir / "fake-env.json").exists(), "a lease's logs stay"


def test_the_next_daemon_holds_the_last_leases_limits_ahead_and_a_lease_asking_the_same_takes_it_as_it_is(
    pooled: MpsSupervisor,
) -> None:
    pooled.warm([GPU0])
    until(lambda: idle_on(pooled, GPU0))
    first = pooled.take(GPU0, MpsLimits(4 << 30, 25))
    [ahead] = until(lambda: idle_on(pooled, GPU0))
    assert ahead.limits == MpsLimits(4 << 30, 25), "the device's last lease's limits, set when it was started"
    assert (ahead.pipe_dir / "fake-limits").read_text().split() == ["4096", "25"], "and read back then"
    sent_ahead = commands(ahead.log_dir)
    with capture_logs() as logs:
        same = pooled.take(GPU0, MpsLimits(4 << 30, 25))
    assert (same.pid, same.limits) == (ahead.pid, MpsLimits(4 << 30, 25))
    assert commands(same.log_dir) == sent_ahead, "nothing left to send: its limits were in force already"
    assert [(e["pooled"], e["limits_ahead"]) for e in logs if e["event"] == "mps.started"] == [(True, True)]
    # A lease asking for other limits: the pooled daemon is given them, and shows them, before it is handed out.
    [other_ahead] = until(lambda: idle_on(pooled, GPU0))
    other = pooled.take(GPU0, MpsLimits(8 << 30, 50))
    assert other.pid == other_ahead.pid and other.limits == MpsLimits(8 << 30, 50)
    assert (other.pipe_dir / "fake-limits").read_text().split() == ["8192", "50"]
    assert {d.key for d in pooled.daemons()} == {first.key, same.key, other.key}


def test_a_daemon_that_does_not_take_the_limits_ahead_is_not_pooled(
    tmp_path: Path, pooled: MpsSupervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    pooled.warm([GPU0])
    until(lambda: idle_on(pooled, GPU0))
    monkeypatch.setenv("FAKE_MPS_IGNORE_LIMITS", "1")
    with capture_logs() as logs:
        with pytest.raises(MpsError, match="shows an active thread percentage"):
            pooled.take(GPU0, LIMITS)
        until(lambda: any(e["event"] == "mps.pool_failed" for e in logs))
    failed = next(e for e in logs if e["event"] == "mps.pool_failed")
    assert "shows an active thread percentage of '100.0' after it was set to 50" in failed["error"]
    assert pooled.idle() == [] and pooled.daemons() == []
    assert [p for p in (tmp_path / "mps").iterdir() if (p / "pooled").exists()] == [], "its directory removed"


def test_a_daemon_is_started_ahead_at_the_lowest_cpu_priority_and_pooled_at_the_brokers(
    tmp_path: Path, fake_binary: str, pooled: MpsSupervisor
) -> None:
    own = os.getpriority(os.PRIO_PROCESS, 0)
    # Only root may give a process its priority back: elsewhere the pool starts its daemons at the broker's own.
    ahead_nice = 19 if os.geteuid() == 0 else own
    pooled.warm([GPU0])
    [ahead] = until(lambda: idle_on(pooled, GPU0))
    assert started_with(ahead.log_dir)["nice"] == ahead_nice, "it started beside a starting container: behind it"
    assert os.getpriority(os.PRIO_PROCESS, ahead.pid) == own, "the MPS server it starts will inherit this"
    pooled.take(GPU0, LIMITS)
    [next_one] = until(lambda: idle_on(pooled, GPU0))
    assert next_one.limits == LIMITS, "given its limits ahead, at the lowest priority too"
    assert os.getpriority(os.PRIO_PROCESS, next_one.pid) == own
    cold = MpsSupervisor(tmp_path / "cold", fake_binary)
    try:
        assert started_with(cold.take(GPU0, LIMITS).log_dir)["nice"] == own, "a lease's own daemon: never behind"
    finally:
        cold.stop_all()


def test_without_a_pool_a_lease_starts_its_own_daemon(supervisor: MpsSupervisor) -> None:
    supervisor.warm([GPU0])
    with capture_logs() as logs:
        daemon = supervisor.take(GPU0, LIMITS)
    assert daemon.key.startswith("lease-") and alive(daemon.pid) and supervisor.idle() == []
    assert (daemon.pipe_dir / "fake-limits").read_text().split() == ["20480", "50"]
    assert [(e["event"], e["pooled"]) for e in logs] == [("mps.started", False)]


def test_a_pooled_daemon_that_does_not_take_its_limits_is_never_handed_out(
    pooled: MpsSupervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    pooled.warm([GPU0])
    [ahead] = until(lambda: idle_on(pooled, GPU0))
    monkeypatch.setenv("FAKE_MPS_IGNORE_LIMITS", "1")  # read by the control client: every daemon ignores them
    with capture_logs() as logs, pytest.raises(MpsError, match="shows an active thread percentage") as refused:
        pooled.take(GPU0, LIMITS)
    assert ahead.key not in str(refused.value), "a daemon started for the lease was tried too, and named"
    until(lambda: not alive(ahead.pid) or _is_zombie(ahead.pid))
    assert pooled.daemons() == []
    assert [(e["event"], e["lease"]) for e in logs if e["event"] == "mps.pool_refused"] == [
        ("mps.pool_refused", ahead.key)]
    assert (ahead.log_dir / "fake-env.json").exists(), "its log stays, as the error says"
    assert not (ahead.log_dir.parent / "pooled").exists(), "and no sweep takes it for a pooled daemon"


def test_a_lease_whose_pooled_daemon_fails_gets_one_started_for_it(pooled: MpsSupervisor) -> None:
    pooled.warm([GPU0])
    [ahead] = until(lambda: idle_on(pooled, GPU0))
    (ahead.pipe_dir / "control").unlink()  # the pooled daemon can no longer be reached
    with capture_logs() as logs:
        daemon = pooled.take(GPU0, LIMITS)
    assert daemon.key != ahead.key and daemon.pid != ahead.pid and alive(daemon.pid)
    assert (daemon.pipe_dir / "fake-limits").read_text().split() == ["20480", "50"]
    refused = [e for e in logs if e["event"] == "mps.pool_refused"]
    assert [e["lease"] for e in refused] == [ahead.key] and "refused" in refused[0]["error"]
    until(lambda: not alive(ahead.pid) or _is_zombie(ahead.pid))
    assert [d.key for d in pooled.daemons()] == [daemon.key]


def test_an_idle_daemon_that_died_is_replaced_and_never_handed_out(pooled: MpsSupervisor) -> None:
    pooled.warm([GPU0])
    [ahead] = until(lambda: idle_on(pooled, GPU0))
    with capture_logs() as logs:  # the filler may drop it first, at a wake of its own, or the take
        os.kill(ahead.pid, signal.SIGKILL)
        until(lambda: _is_zombie(ahead.pid))
        daemon = pooled.take(GPU0, LIMITS)
    assert daemon.pid != ahead.pid and alive(daemon.pid)
    assert not ahead.log_dir.parent.exists()
    assert [(e["lease"], e["why"]) for e in logs if e["event"] == "mps.pool_dropped"] == [(ahead.key, "exited")]


def test_stop_all_quits_the_idle_daemons_and_removes_their_directories(pooled: MpsSupervisor) -> None:
    pooled.warm([GPU0])
    lease = pooled.take(GPU0, LIMITS)
    [ahead] = until(lambda: idle_on(pooled, GPU0))
    pooled.stop_all()
    assert not alive(ahead.pid) and not alive(lease.pid)
    assert not ahead.log_dir.parent.exists(), "it served no lease: nothing to keep"
    assert (lease.log_dir / "fake-env.json").exists(), "the lease's logs stay"
    assert pooled.idle() == []
    pooled.warm([GPU0])
    time.sleep(0.3)
    assert pooled.idle() == [], "a stopped supervisor starts nothing ahead"


@pytest.mark.parametrize(("ignores_quit", "pool"), [(False, 1), (True, 1), (False, 0)],
                         ids=["quits", "killed-when-it-will-not-quit", "started-again-without-a-pool"])
def test_the_pool_a_killed_broker_left_is_stopped_and_removed_at_the_next_warm(
    tmp_path: Path, fake_binary: str, monkeypatch: pytest.MonkeyPatch, ignores_quit: bool, pool: int
) -> None:
    # A broker, killed once its pool is up: nothing stops the daemon it started ahead (it leads a session of its own).
    script = (f"import sys, time; sys.path.insert(0, {str(Path.cwd())!r})\n"
              "from pathlib import Path\nfrom shim.broker.mps import MpsSupervisor\n"
              f"sup = MpsSupervisor(Path({str(tmp_path / 'mps')!r}), {fake_binary!r}, pool=1)\n"
              f"sup.warm([{GPU0!r}])\n"
              "while not sup.idle(): time.sleep(0.02)\n"
              "print('idle', sup.idle()[0].key, sup.idle()[0].pid, flush=True)\ntime.sleep(60)\n")
    env = {**os.environ, **({"FAKE_MPS_IGNORE_QUIT": "1"} if ignores_quit else {})}
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env) as broker:
        said = []
        try:
            for line in broker.stdout:  # its log lines first; then what it started ahead
                said.append(line)
                if line.startswith("idle "):
                    key, pid = line.split()[1:]
                    break
            else:
                pytest.fail(f"the broker stopped before its pool was up: {''.join(said)}")
        finally:
            broker.kill()
    left = int(pid)
    assert alive(left)
    second = MpsSupervisor(tmp_path / "mps", binary=fake_binary, pool=pool, stop_timeout=1.0)
    try:
        with capture_logs() as logs:
            second.warm([GPU0])
        until(lambda: not alive(left) or _is_zombie(left))  # reaped by whoever adopted it
        assert not (tmp_path / "mps" / key).exists()
        swept = [e for e in logs if e["event"] == "mps.pool_swept"]
        assert [(e["lease"], e["pid"], e["killed"]) for e in swept] == [(key, left, ignores_quit)]
        if pool:
            [fresh] = until(lambda: idle_on(second, GPU0))
            assert fresh.key != key
        else:
            assert second.idle() == []
    finally:
        second.stop_all()


def test_a_pool_that_cannot_start_a_daemon_says_so_and_a_lease_gets_the_reason(
    tmp_path: Path, fake_binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MPS_EXIT_AT_START", "1")
    sup = MpsSupervisor(tmp_path / "mps", binary=fake_binary, pool=1)
    try:
        with capture_logs() as logs:
            sup.warm([GPU0])
            until(lambda: any(e["event"] == "mps.pool_failed" for e in logs))
            with pytest.raises(MpsError, match="exited with code 3"):
                sup.take(GPU0, LIMITS)
        failed = next(e for e in logs if e["event"] == "mps.pool_failed")
        assert failed["device"] == GPU0 and "exited with code 3" in failed["error"]
        assert sup.idle() == [] and sup.daemons() == []
        assert [p.name for p in (tmp_path / "mps").iterdir() if (p / "pooled").exists()] == [], "no pooled leftovers"
    finally:
        sup.stop_all()


def test_a_negative_pool_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pool of -1 daemons per device"):
        MpsSupervisor(tmp_path / "mps", pool=-1)
