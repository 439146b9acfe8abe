"""``weft gpu-check``'s live enforcement test, end to end on a fake GPU: real cgroups, mount namespaces and broker.

Everything but the GPU is real: the broker (a private one, or one the test
runs as the node's), its MPS supervisor and watchdog, the cgroups the leases
are bound to, the clients' mount namespaces, and the CUDA client itself. The
GPU is the fake libcuda (``tests/gpucheck/fake_libcuda.c``), the fake NVML
and the fake MPS control binary: the fake libcuda holds an MPS client to
the limits its daemon was given and writes what it holds where the fake NVML
reads its process list, so the watchdog sees what the clients do. Faults: a
daemon killed mid-test, a client stuck in a driver call, a driver error, a
broker that only logs.
"""

from __future__ import annotations

import io
import json
import os
import signal
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from shim.broker.mps import MpsSupervisor
from shim.broker.nvml import NvmlBackend
from shim.broker.watchdog import CGROUP_ROOT
from shim.brokerd import Broker, BrokerConfig
from shim.gpucheck import cli
from shim.gpucheck.live import MPS_DEFAULT_PIPE, LiveSettings, LiveTest
from shim.localfabric.waiting import wait_for
from tests.broker.fakes import MIG_A, MIG_B, FakeNvml, install_fake_mps, two_instances, write_mig_caps
from tests.gpucheck import fakecuda

LIVE = ["live.broker", "live.leases", "live.mps-limits", "live.memory-within", "live.memory-beyond",
        "live.compute-shares", "live.cleared-env", "live.watchdog", "live.released"]


@pytest.fixture(scope="module")
def libcuda(tmp_path_factory: pytest.TempPathFactory) -> str:
    return fakecuda.build(tmp_path_factory.mktemp("fake-libcuda"))


@pytest.fixture
def world(tmp_path: Path) -> Path:
    path = tmp_path / "world"
    path.mkdir()
    return path


@pytest.fixture
def node(tmp_path: Path, world: Path, libcuda: str) -> Iterator[dict]:
    """The fake GPU node: NVML, MPS control, libcuda, and live-test settings that use them."""
    had_default_pipe = MPS_DEFAULT_PIPE.exists()
    settings = LiveSettings(default_socket=tmp_path / "no-broker.sock", libcuda=libcuda, work_parent=tmp_path,
                            step_timeout=20, watchdog_timeout=20, client_env={
                                "FAKE_GPU_WORLD": str(world), "FAKE_CUDA_TOTAL_MIB": "81920",
                                "FAKE_CUDA_SMS": "132"})
    yield {"nvml": FakeNvml(world), "mps": install_fake_mps(tmp_path / "bin"), "settings": settings,
           "tmp": tmp_path}
    assert MPS_DEFAULT_PIPE.exists() == had_default_pipe, "the mount point made for the test is gone again"
    assert not list(CGROUP_ROOT.glob("*/weft-gpu-check-*")) and not list(CGROUP_ROOT.glob("weft-gpu-check-*"))
    left = [p.info for p in psutil.process_iter(["pid", "cmdline"])
            if any(str(tmp_path) in part for part in (p.info["cmdline"] or []))]
    assert left == [], "nothing the test started is left running"


def gpu_check(node: dict, settings: LiveSettings | None = None, broker_socket: Path | None = None) -> tuple[int, dict]:
    out = io.StringIO()
    env = cli.Environment(nvml_library=node["nvml"], mps_binary=node["mps"], kubelet_dir=node["tmp"] / "kubelet",
                          live=settings or node["settings"], out=out)
    code = cli.run(True, broker_socket, False, env)
    return code, json.loads(out.getvalue().splitlines()[-1])


def live(doc: dict) -> dict[str, dict]:
    return {c["name"]: c for c in doc["checks"] if c["name"].startswith("live")}


def test_two_leases_on_one_gpu_are_each_held_to_their_share(node: dict) -> None:
    code, doc = gpu_check(node)
    checks = live(doc)
    assert list(checks) == LIVE
    assert {n: c["result"] for n, c in checks.items()} == dict.fromkeys(LIVE, "ok"), checks
    assert code == cli.EXIT_OK and doc["verdict"] == "warn", "only the device plugin (no kubelet here) warns"
    assert "a private one for this test" in checks["live.broker"]["detail"]
    assert "each with its own MPS daemon" in checks["live.leases"]["detail"]
    assert checks["live.mps-limits"]["detail"] == ("lease a: 1024 MiB, 25% on its daemon; "
                                                   "lease b: 1024 MiB, 50% on its daemon")
    assert "client a sees 81920 MiB of Fake GPU (32 SMs)" in checks["live.memory-within"]["detail"]
    assert "CUDA_ERROR_OUT_OF_MEMORY" in checks["live.memory-beyond"]["detail"]
    # The device's 132 SMs read by a client outside MPS; each lease's client, given blocks for all of them, runs
    # on its share alone (25% of 132 is 32 SMs in whole TPCs, as the driver rounds it).
    assert checks["live.compute-shares"]["detail"] == (
        "client a (25%), given blocks for all 132 SMs, ran on 32 (24%; it sees 32); "
        "client b (50%), given blocks for all 132 SMs, ran on 66 (50%; it sees 66)")
    assert "no CUDA_MPS_* or CUDA_VISIBLE_DEVICES variables" in checks["live.cleared-env"]["detail"]
    assert "was killed with lease a's processes; client b still answers" in checks["live.watchdog"]["detail"]
    assert "released" in checks["live.released"]["detail"]


def test_an_mps_daemon_killed_mid_test_fails_that_step_and_leaves_nothing(node: dict) -> None:
    def kill_daemon(step: str, test: LiveTest) -> None:
        if step == "live.memory-beyond":
            [daemon] = [d for d in test.private_broker.mps.daemons()
                        if d.key == test.leases["a"].lease.lease_id]
            os.kill(daemon.pid, signal.SIGKILL)
            wait_for(lambda: _gone(daemon.pid), what="the daemon to die")

    code, doc = gpu_check(node, replace(node["settings"], on_step=kill_daemon))
    checks = live(doc)
    assert code == cli.EXIT_FAILED
    assert checks["live.memory-beyond"] == {
        "name": "live.memory-beyond", "result": "fail",
        "detail": "client a: 'alloc 640' failed, but not for memory: CUDA_ERROR_MPS_CONNECTION_FAILED "
                  "(cuMemAlloc_v2)"}
    assert checks["live.released"]["result"] == "ok", checks["live.released"]


def test_a_client_stuck_in_the_driver_is_named_and_killed(node: dict) -> None:
    settings = replace(node["settings"], step_timeout=3,
                       client_env={**node["settings"].client_env, "FAKE_CUDA_HANG": "cuLaunchKernel"})
    code, doc = gpu_check(node, settings)
    checks = live(doc)
    assert code == cli.EXIT_FAILED
    assert checks["live.compute-shares"]["detail"] == "client a did not answer 'busy 300' within 3s"
    assert checks["live.released"]["result"] == "ok", checks["live.released"]


def test_without_the_devices_sm_count_the_compute_shares_are_not_judged(node: dict) -> None:
    # As on a GPU in EXCLUSIVE_PROCESS mode while an MPS server runs: only MPS clients get a context.
    settings = replace(node["settings"], client_env={**node["settings"].client_env, "FAKE_CUDA_MPS_ONLY": "1"})
    code, doc = gpu_check(node, settings)
    checks = live(doc)
    assert checks["live.compute-shares"] == {
        "name": "live.compute-shares", "result": "warn",
        "detail": "the device's SM count could not be read outside MPS (a client outside MPS could not make a "
                  "context: CUDA_ERROR_DEVICES_UNAVAILABLE (cuDevicePrimaryCtxRetain)), so the shares cannot be "
                  "judged against it: client a (25%) sees 32 SMs and ran on 32; client b (50%) sees 66 SMs and "
                  "ran on 66"}
    assert "could not make a context of its own" in checks["live.watchdog"]["detail"]
    assert code == cli.EXIT_OK and checks["live.released"]["result"] == "ok", checks


def test_a_driver_error_in_a_client_is_a_fail_line_naming_it(node: dict) -> None:
    settings = replace(node["settings"], client_env={**node["settings"].client_env, "FAKE_CUDA_FAIL": "cuInit=100"})
    code, doc = gpu_check(node, settings)
    checks = live(doc)
    assert code == cli.EXIT_FAILED
    assert checks["live.memory-within"]["detail"] == "client a: 'init' failed: CUDA_ERROR_NO_DEVICE (cuInit)"
    assert checks["live.released"]["result"] == "ok", checks["live.released"]


@pytest.fixture
def nodes_broker(node: dict) -> Iterator[Broker]:
    """A broker the test runs as the node's own (with its MPS pool), over the same fake GPU, only logging."""
    tmp = node["tmp"]
    cfg = BrokerConfig(socket=tmp / "b.sock", state_dir=tmp / "broker-state", backend="nvml", enforce="log",
                       watchdog_interval=0.3, mps_dir=tmp / "broker-mps")
    broker = Broker(cfg, backend=NvmlBackend(library=node["nvml"]),
                    mps=MpsSupervisor(cfg.mps_dir, node["mps"], private_shm=True, pool=cfg.mps_pool)).start()
    yield broker
    broker.stop()


def test_through_the_nodes_broker_that_only_logs_the_watchdog_check_fails(node: dict, nodes_broker: Broker) -> None:
    settings = replace(node["settings"], watchdog_timeout=3)
    code, doc = gpu_check(node, settings, broker_socket=nodes_broker.cfg.socket)
    checks = live(doc)
    assert code == cli.EXIT_FAILED
    assert checks["live.broker"]["detail"] == f"the node's broker at {nodes_broker.cfg.socket} (backend nvml)"
    assert checks["live.watchdog"]["result"] == "fail"
    assert "still ran after 3s" in checks["live.watchdog"]["detail"]
    assert "--enforce kill" in checks["live.watchdog"]["detail"]
    assert checks["live.released"]["result"] == "ok"
    assert nodes_broker.service.leases() == [], "no lease left bound on the node's broker"


def test_a_broker_socket_where_nothing_answers_fails_and_takes_nothing(node: dict) -> None:
    code, doc = gpu_check(node, broker_socket=node["tmp"] / "nothing.sock")
    checks = live(doc)
    assert code == cli.EXIT_FAILED
    assert list(checks) == ["live.broker", "live.released"]
    assert checks["live.broker"]["detail"].startswith(f"no broker answers at {node['tmp'] / 'nothing.sock'}")
    assert checks["live.released"] == {"name": "live.released", "result": "ok",
                                       "detail": "no lease was taken; no client, MPS daemon or cgroup of the test "
                                                 "left"}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_live_on_a_mig_instance(tmp_path: Path) -> None:
    """The fake A100 with MIG on (a 10 GiB and a 40 GiB instance, their capability files in a proc tree of the
    test's own): the live test takes the larger, leases two shares of it, and holds each client to its share."""
    had = MPS_DEFAULT_PIPE.exists()
    (tmp_path / "cuda").mkdir()
    libcuda = fakecuda.build(tmp_path / "cuda")
    world = tmp_path / "world"
    world.mkdir()
    nvml = FakeNvml(world)
    nvml.enable_mig(two_instances(), world_slot=2)
    nvml.handles = {"h0": nvml.handles["h0"]}
    proc_root = tmp_path / "proc"
    write_mig_caps(proc_root, 0, 7, 0, 66, 67)
    write_mig_caps(proc_root, 0, 2, 0, 21, 22)
    settings = LiveSettings(default_socket=tmp_path / "no-broker.sock", libcuda=libcuda, work_parent=tmp_path,
                            step_timeout=20, watchdog_timeout=20, nvml_proc_root=proc_root, client_env={
                                "FAKE_GPU_WORLD": str(world), "FAKE_CUDA_TOTAL_MIB": "40960",
                                "FAKE_CUDA_SMS": "42"})
    out = io.StringIO()
    env = cli.Environment(nvml_library=nvml, mps_binary=install_fake_mps(tmp_path / "bin"),
                          kubelet_dir=tmp_path / "kubelet", live=settings, out=out)
    code = cli.run(True, None, False, env)
    doc = json.loads(out.getvalue().splitlines()[-1])
    checks = {c["name"]: c for c in doc["checks"]}
    assert [n for n in checks if n.startswith("live")] == LIVE
    assert {n: checks[n]["result"] for n in LIVE} == dict.fromkeys(LIVE, "ok"), checks
    assert f"on {MIG_B}:" in checks["live.leases"]["detail"]
    assert checks["mig"]["result"] == "ok" and MIG_A in checks["mig"]["detail"]
    assert code == cli.EXIT_OK
    assert MPS_DEFAULT_PIPE.exists() == had
    left = [p.info for p in psutil.process_iter(["pid", "cmdline"])
            if any(str(tmp_path) in part for part in (p.info["cmdline"] or []))]
    assert left == []
