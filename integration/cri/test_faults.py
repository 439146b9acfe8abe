"""Faults around the agent: containerd gone and back, a second agent, signals.

The agent must keep serving while containerd is away (UNAVAILABLE naming the
socket), recover by itself when it returns, refuse to steal a live socket,
replace a stale one, and leave nothing behind when stopped.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from shim.localfabric import pods
from shim.localfabric.agent import AgentProcess
from shim.localfabric.containerd import Containerd


def _version(ch: grpc.Channel) -> tuple[grpc.StatusCode, str]:
    try:
        cri_grpc.RuntimeServiceStub(ch).Version(cri.VersionRequest(), timeout=5)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def test_containerd_restart_gives_unavailable_then_recovers(fresh_containerd: Containerd, tmp_path: Path) -> None:
    with AgentProcess(fresh_containerd, tmp_path / "agent") as agent, agent.channel() as ch:
        rt = cri_grpc.RuntimeServiceStub(ch)
        cfg = pods.sandbox_config("survivor", fresh_containerd.pod_log_dir)
        sb = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=cfg)).pod_sandbox_id
        pid = agent.pid

        fresh_containerd.stop()
        code, details = _version(ch)
        assert code is grpc.StatusCode.UNAVAILABLE
        assert str(fresh_containerd.socket) in details and "containerd is unavailable" in details
        assert agent.get("/readyz")[0] == 503
        assert agent.get("/healthz")[0] == 200  # the agent itself is alive

        fresh_containerd.start()
        deadline = time.monotonic() + 10
        while _version(ch)[0] is not grpc.StatusCode.OK:
            assert time.monotonic() < deadline, "agent did not recover after containerd came back"
            time.sleep(0.1)
        assert agent.pid == pid and agent.proc.poll() is None
        # The pod outlived containerd's restart, and the agent sees it again.
        listed = rt.ListPodSandbox(cri.ListPodSandboxRequest(filter=cri.PodSandboxFilter(id=sb))).items
        assert [s.id for s in listed] == [sb]
        names = [e["event"] for e in agent.events()]
        assert "upstream.unavailable" in names and "upstream.recovered" in names
        assert names.count("upstream.unavailable") == 1  # logged on change, not per call


def test_missing_containerd_socket_names_it(tmp_path: Path) -> None:
    class Nowhere:
        socket = tmp_path / "no-such" / "containerd.sock"

    with AgentProcess(Nowhere(), tmp_path / "agent") as agent, agent.channel() as ch:  # type: ignore[arg-type]
        for _ in range(3):  # keeps serving, answers the same each time
            code, details = _version(ch)
            assert code is grpc.StatusCode.UNAVAILABLE
            assert str(Nowhere.socket) in details
        assert agent.proc.poll() is None


def test_second_agent_on_same_socket_refuses(agent: AgentProcess, tmp_path: Path) -> None:
    second = subprocess.run(
        [sys.executable, "-m", "shim", "agent", "--socket", str(agent.socket),
         "--containerd-socket", str(agent.containerd.socket), "--state-dir", str(tmp_path / "s2"),
         "--metrics-address", ""],
        capture_output=True, text=True, timeout=30,
    )
    assert second.returncode == 2
    assert f"another weft agent is serving {agent.socket}" in second.stderr
    with agent.channel() as ch:  # the first one is untouched
        assert _version(ch)[0] is grpc.StatusCode.OK


def test_socket_is_private_and_removed_on_sigterm(containerd: Containerd, tmp_path: Path) -> None:
    agent = AgentProcess(containerd, tmp_path / "agent").start()
    mode = os.stat(agent.socket).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert agent.stop(signal.SIGTERM) == 0
    assert not agent.socket.exists()
    events = [e["event"] for e in agent.events()]
    assert events[-2:] == ["agent.stopping", "agent.stopped"]


def test_stale_socket_after_kill_is_replaced(containerd: Containerd, tmp_path: Path) -> None:
    first = AgentProcess(containerd, tmp_path / "agent").start()
    first.stop(signal.SIGKILL)
    assert first.socket.exists()  # kill -9 leaves the socket file behind
    with AgentProcess(containerd, tmp_path / "agent") as second, second.channel() as ch:
        assert _version(ch)[0] is grpc.StatusCode.OK


def test_in_flight_calls_finish_on_sigterm(containerd: Containerd, tmp_path: Path) -> None:
    agent = AgentProcess(containerd, tmp_path / "agent").start()
    with agent.channel() as ch:
        rt = cri_grpc.RuntimeServiceStub(ch)
        cfg = pods.sandbox_config("graceful", containerd.pod_log_dir)
        future = rt.RunPodSandbox.future(cri.RunPodSandboxRequest(config=cfg), timeout=30)
        time.sleep(0.02)
        agent.proc.send_signal(signal.SIGTERM)
        assert future.result().pod_sandbox_id
    assert agent.stop() == 0


def test_bad_config_names_the_field(tmp_path: Path) -> None:
    conf = tmp_path / "weft.toml"
    conf.write_text('[agent]\nlog_level = "chatty"\n')
    res = subprocess.run([sys.executable, "-m", "shim", "agent", "--config", str(conf),
                          "--socket", str(tmp_path / "a.sock")], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2
    assert "agent.log_level" in res.stderr and "chatty" in res.stderr
    assert not (tmp_path / "a.sock").exists()


def test_client_pings_after_answers_weft_gave_do_not_make_containerd_hang_up(containerd: Containerd,
                                                                              tmp_path: Path) -> None:
    """gRPC clients send a bandwidth-probe PING after each answer; after calls weft answered itself,
    containerd would count those as pings without data and end the connection (too_many_pings)."""
    with AgentProcess(containerd, tmp_path / "agent") as agent, agent.channel() as ch:
        status = ch.unary_unary("/weft.agent.v1.Admin/Status")
        version = ch.unary_unary("/runtime.v1.RuntimeService/Version")
        version(cri.VersionRequest().SerializeToString(), timeout=5)
        for _ in range(40):
            status(b"", timeout=5)
            time.sleep(0.05)
        version(cri.VersionRequest().SerializeToString(), timeout=5)
        events = [e.get("event") for e in agent.events()]
    assert "upstream.unavailable" not in events, events
