"""``weft gpu-check``'s live test on a MIG instance of the fake GPU: everything else real, as in test_gpu_check.py.

The fake A100 has MIG on with a 10 GiB and a 40 GiB instance (their capability files in a proc tree of the
test's own); the live test takes the larger, leases two shares of it through a private broker, and holds each
client to its share as on a whole GPU.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import psutil

from shim.gpucheck import cli
from shim.gpucheck.live import MPS_DEFAULT_PIPE, LiveSettings
from tests.broker.fakes import MIG_A, MIG_B, FakeNvml, install_fake_mps, two_instances, write_mig_caps
from tests.gpucheck import fakecuda

LIVE = ["live.broker", "live.leases", "live.mps-limits", "live.memory-within", "live.memory-beyond",
        "live.compute-shares", "live.cleared-env", "live.watchdog", "live.released"]


def test_live_on_a_mig_instance(tmp_path: Path) -> None:
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
