"""The MPS supervisor against a fake ``nvidia-cuda-mps-control``.

The fake behaves as the real binary does where the supervisor can tell: with
``-f`` it is the daemon, listening on ``$CUDA_MPS_PIPE_DIRECTORY/control``;
without it, it is the client, passing stdin's command to that daemon and failing
when no daemon listens. The daemon records its environment and the commands it
receives in its log directory so tests can see what it was started with.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from shim.broker.mps import MpsError, MpsSupervisor

GPU0 = "GPU-5e1a0000-0000-4000-8000-000000000000"
GPU1 = "GPU-5e1a0000-0000-4000-8000-000000000001"

FAKE = f"""#!{sys.executable}
import json, os, sys

pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
logs = os.environ["CUDA_MPS_LOG_DIRECTORY"]
control = os.path.join(pipe, "control")

if sys.argv[1:] == ["-f"]:
    with open(os.path.join(logs, "fake-env.json"), "w") as f:
        json.dump({{"env": dict(os.environ), "pid": os.getpid(), "sid": os.getsid(0)}}, f)
    if os.environ.get("FAKE_MPS_EXIT_AT_START"):
        sys.exit(3)
    if not os.path.exists(control):
        os.mkfifo(control)
    # Read-write, so the daemon holds a writer too and never sees end-of-file
    # between one client and the next.
    fifo = os.fdopen(os.open(control, os.O_RDWR), "r")
    while True:
        command = fifo.readline().strip()
        with open(os.path.join(logs, "fake-commands.log"), "a") as f:
            f.write(command + "\\n")
        if command == "quit" and not os.environ.get("FAKE_MPS_IGNORE_QUIT"):
            sys.exit(0)
else:
    command = sys.stdin.read()
    try:
        fd = os.open(control, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no FIFO, or nobody reading it
        print("Cannot find MPS control daemon process", file=sys.stderr)
        sys.exit(1)
    os.write(fd, command.encode())
    os.close(fd)
    if command.strip() != "quit":
        print("100")
"""


@pytest.fixture
def fake_binary(tmp_path: Path) -> str:
    path = tmp_path / "bin" / "nvidia-cuda-mps-control"
    path.parent.mkdir()
    path.write_text(FAKE)
    path.chmod(0o755)
    return str(path)


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
            daemon = supervisor.ensure(GPU0)
    finally:
        os.umask(umask)
    assert daemon.pipe_dir == tmp_path / "mps" / GPU0 / "pipe"
    assert daemon.log_dir == tmp_path / "mps" / GPU0 / "log"
    seen = started_with(daemon.log_dir)
    assert seen["pid"] == daemon.pid and alive(daemon.pid)
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == GPU0
    assert seen["env"]["CUDA_MPS_PIPE_DIRECTORY"] == str(daemon.pipe_dir)
    assert seen["env"]["CUDA_MPS_LOG_DIRECTORY"] == str(daemon.log_dir)
    assert seen["sid"] == daemon.pid, "the daemon leads its own session"
    for path in (daemon.pipe_dir, daemon.log_dir):
        assert stat.S_IMODE(path.stat().st_mode) == 0o755
    assert [e["event"] for e in logs] == ["mps.started"]
    assert logs[0]["device"] == GPU0 and logs[0]["pid"] == daemon.pid


def test_each_device_gets_its_own_daemon(supervisor: MpsSupervisor) -> None:
    first, second = supervisor.ensure(GPU0), supervisor.ensure(GPU1)
    assert first.pid != second.pid and first.pipe_dir != second.pipe_dir
    assert started_with(second.log_dir)["env"]["CUDA_VISIBLE_DEVICES"] == GPU1


def test_ensure_returns_the_running_daemon(supervisor: MpsSupervisor) -> None:
    first = supervisor.ensure(GPU0)
    with capture_logs() as logs:
        again = supervisor.ensure(GPU0)
    assert again == first
    assert logs == []


@pytest.mark.parametrize("notice", ["check", "ensure"], ids=["check-restarts", "ensure-restarts"])
def test_a_killed_daemon_is_restarted(supervisor: MpsSupervisor, notice: str) -> None:
    old = supervisor.ensure(GPU0)
    os.kill(old.pid, signal.SIGKILL)
    until(lambda: not alive(old.pid) or _is_zombie(old.pid))
    with capture_logs() as logs:
        if notice == "check":
            assert until(supervisor.check) == [GPU0]
            new = supervisor.ensure(GPU0)
        else:
            new = supervisor.ensure(GPU0)
    assert new.pid != old.pid and alive(new.pid)
    assert started_with(new.log_dir)["pid"] == new.pid
    restarted = [e for e in logs if e["event"] == "mps.restarted"]
    assert len(restarted) == 1
    assert restarted[0]["device"] == GPU0 and restarted[0]["exit_code"] == -signal.SIGKILL
    assert (restarted[0]["old_pid"], restarted[0]["pid"]) == (old.pid, new.pid)


def test_a_failed_restart_is_tried_again_at_the_next_check(
    supervisor: MpsSupervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = supervisor.ensure(GPU0)
    monkeypatch.setenv("FAKE_MPS_EXIT_AT_START", "1")
    os.kill(old.pid, signal.SIGKILL)
    until(lambda: _is_zombie(old.pid))
    with capture_logs() as logs:
        assert supervisor.check() == []
    assert [(e["event"], e["exit_code"]) for e in logs] == [("mps.restart_failed", -signal.SIGKILL)]
    monkeypatch.delenv("FAKE_MPS_EXIT_AT_START")
    assert supervisor.check() == [GPU0]
    assert alive(supervisor.ensure(GPU0).pid)


def test_check_leaves_live_daemons_alone(supervisor: MpsSupervisor) -> None:
    daemon = supervisor.ensure(GPU0)
    assert supervisor.check() == []
    assert supervisor.ensure(GPU0).pid == daemon.pid


def test_stop_quits_the_daemon_and_keeps_its_logs(supervisor: MpsSupervisor) -> None:
    daemon = supervisor.ensure(GPU0)
    with capture_logs() as logs:
        supervisor.stop(GPU0)
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
    daemon = sup.ensure(GPU0)
    with capture_logs() as logs:
        sup.stop(GPU0)
    assert not alive(daemon.pid)
    assert "quit" in commands(daemon.log_dir), "asked first"
    assert [(e["event"], e["killed"], e["exit_code"]) for e in logs] == [("mps.stopped", True, -signal.SIGKILL)]


def test_stop_of_a_device_without_daemon_is_a_no_op(supervisor: MpsSupervisor) -> None:
    with capture_logs() as logs:
        supervisor.stop(GPU0)
    assert logs == []


def test_stop_all_ends_every_daemon(supervisor: MpsSupervisor) -> None:
    daemons = [supervisor.ensure(GPU0), supervisor.ensure(GPU1)]
    supervisor.stop_all()
    assert not any(alive(d.pid) for d in daemons)
    assert supervisor.check() == []
    fresh = supervisor.ensure(GPU0)
    assert fresh.pid not in {d.pid for d in daemons} and alive(fresh.pid)


def test_missing_binary_is_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere" / "nvidia-cuda-mps-control")
    with pytest.raises(MpsError, match=r"nowhere/nvidia-cuda-mps-control: not found"):
        MpsSupervisor(tmp_path / "mps", binary=missing).ensure(GPU0)


def test_missing_binary_on_path_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MpsError, match="nvidia-cuda-mps-control: not found"):
        MpsSupervisor(tmp_path / "mps").ensure(GPU0)


def test_daemon_that_exits_at_start_is_an_error_naming_its_logs(
    tmp_path: Path, fake_binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MPS_EXIT_AT_START", "1")
    sup = MpsSupervisor(tmp_path / "mps", binary=fake_binary)
    with pytest.raises(MpsError, match=f"exited with code 3.*{GPU0}/log"):
        sup.ensure(GPU0)
    assert sup.check() == [], "a daemon that never started is not supervised"


def test_uuid_that_would_nest_directories_is_refused(supervisor: MpsSupervisor) -> None:
    with pytest.raises(ValueError, match="cannot name a directory"):
        supervisor.ensure("MIG-GPU-5e1a0000-0000-4000-8000-000000000000/1/0")


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return True
