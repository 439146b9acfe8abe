"""The GPU proof's whole path (``bench.gpu_whole_path``) on the fake GPU: what ``scripts/gpu-proof.sh --whole-path``
runs on a GPU node, here with everything real but the GPU.

Real: containerd 2 with CDI, runc, the ``weft`` handler and its OCI hook, the agent, the broker with its MPS
supervisor and watchdog, the client's image (built from this machine's Python) and the CUDA client in it. Fake: the
NVML the broker reads, the MPS control binary, ``libcuda`` (``tests/gpucheck/fake_libcuda.c``, which holds an MPS
client to its daemon's limits) and the driver's CDI spec, written here as ``nvidia-ctk`` would write it for two GPUs
(their device nodes stand in by ``/dev/null``'s, the fake libcuda and its world mounted by the spec's edits).
Beside the GPU Operator, NVIDIA's real runtime (``nvidia-container-runtime`` v1.20, the toolkit line the proof
carries, built from the module by components/nvidia-toolkit/build.sh) runs in CDI mode from that spec; there the
fake libcuda answers without device nodes, so only the runtime's side shows (no node, no driver injected, the
variable ``void``), and the check says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import psutil
import pynvml
import pytest

from harness import binaries
from shim.bench.checkout.gpu_whole_path import GpuSide, WholePath, libcuda_in, libcuda_on_host, own_cdi, summary
from shim.broker.backend import GpuDevice
from shim.broker.nvml import NvmlBackend
from tests.broker.fakes import A100, T4, FakeNvml, install_fake_mps
from tests.gpucheck import fakecuda

FAKE_LIBCUDA_IN_CONTAINER = "/usr/lib/x86_64-linux-gnu/libcuda.so.1"


def fake_cdi(libcuda: str, world: Path):
    def write(directory: Path) -> Path:
        def node(i: int) -> dict:
            return {"path": f"/dev/nvidia{i}", "hostPath": "/dev/null"}

        devices = [{"name": name, "containerEdits": {"deviceNodes": [node(i)]}}
                   for i, uuid in enumerate((A100, T4)) for name in (str(i), uuid)]
        devices.append({"name": "all", "containerEdits": {"deviceNodes": [node(0), node(1)]}})
        spec = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": devices, "containerEdits": {
            "env": [f"FAKE_GPU_WORLD={world}", "FAKE_CUDA_TOTAL_MIB=81920", "FAKE_CUDA_SMS=132"],
            "mounts": [{"hostPath": libcuda, "containerPath": FAKE_LIBCUDA_IN_CONTAINER,
                        "options": ["ro", "nosuid", "nodev", "bind"]},
                       {"hostPath": str(world), "containerPath": str(world), "options": ["rw", "bind"]}]}}
        path = directory / "nvidia.json"
        path.write_text(json.dumps(spec))
        return path

    return write


def no_minor(handle: str) -> int:
    raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


@pytest.fixture
def proof(tmp_path: Path) -> dict:
    world = tmp_path / "world"
    world.mkdir()
    libcuda = fakecuda.build(tmp_path)
    nvml = FakeNvml(world)
    # No /dev/nvidia<N> here for the broker to hand a container: the fake CDI spec's nodes stand in for them.
    nvml.nvmlDeviceGetMinorNumber = no_minor
    backend = NvmlBackend(library=nvml)
    gpu = GpuSide(backend=backend, mps_binary=install_fake_mps(tmp_path / "bin"),
                  write_cdi=fake_cdi(libcuda, world), host_pid=True,
                  nvidia_runtime=str(binaries.nvidia_toolkit("1.20") / "nvidia-container-runtime"), real_driver=False)
    work = tmp_path / "work"
    try:
        doc = WholePath(gpu, work, starts=2, step_timeout=60).run()
    finally:
        backend.close()
    left = [p.info for p in psutil.process_iter(["pid", "cmdline"])
            if any(str(tmp_path) in part for part in (p.info["cmdline"] or []))]
    assert left == [], "nothing the proof started is left running"
    return doc


def test_the_whole_path_is_proven_on_the_fake_gpu(proof: dict) -> None:
    print(summary(proof))  # what the GPU node's run says, in this run's log
    by_name = {c["name"]: c for c in proof["checks"]}
    assert proof["verdict"] == "proven", summary(proof)
    assert list(by_name) == [
        "cdi.spec", "plain.whole-gpu", "shares.leases", "share-25.device", "share-25.memory", "share-25.compute",
        "share-50.device", "share-50.memory", "share-50.compute", "released", "start-times", "fault.cdi-missing",
        "fault.cdi-stale", "fault.mps-killed.client", "fault.mps-killed.released", "fault.mps-killed.next-pod",
        "nothing-left", "nvidia-runtime.plain", "nvidia-runtime.no-lease", "nvidia-runtime.leased",
        "nvidia-runtime.nothing-left", "pool-stopped"]
    figures = proof["figures"]
    assert figures["device"]["uuid"] == A100
    # The plain pod had the whole GPU (both devices' nodes, all 132 SMs); each share ran on its part of the SMs, as
    # MPS shows a client its share, rounded to whole TPCs.
    assert "/dev/nvidia1" in by_name["plain.whole-gpu"]["detail"] and figures["plain"]["sms_used"] == 132
    assert {k: (v["sms_seen"], v["sms_used"], v["within"], v["beyond"]) for k, v in figures["shares"].items()} == {
        "25": (32, 32, True, "CUDA_ERROR_OUT_OF_MEMORY"), "50": (66, 66, True, "CUDA_ERROR_OUT_OF_MEMORY")}
    assert figures["shares"]["25"]["limit_mib"] == 20480
    assert figures["start"]["weft_p50_ms"] > 0 and figures["start"]["plain_p50_ms"] > 0
    assert figures["start"]["mps_pool"] == 1, "timed as an installed broker runs: with daemons started ahead"
    start = figures["start"]
    assert len(start["weft_mps_ms"]) == 2 and all(0 < m < w for m, w in zip(start["weft_mps_ms"], start["weft_ms"],
                                                                            strict=True)), start
    # The CDI fault names what was missing: the leased device's CDI name.
    for fault in ("fault.cdi-missing", "fault.cdi-stale"):
        assert f"unresolvable CDI devices nvidia.com/gpu={A100}" in by_name[fault]["detail"]
    assert "CUDA_ERROR_MPS_CONNECTION_FAILED" in by_name["fault.mps-killed.client"]["detail"]
    # NVIDIA's runtime the default, every image asking for all GPUs: the plain pod got every GPU from the runtime
    # alone; the opted-in container without a lease got nothing, its variable void; the leased one its GPU.
    seen = figures["nvidia_runtime"]
    assert (seen["nvidia-plain"]["nodes"], seen["nvidia-plain"]["driver_injected"], seen["nvidia-plain"]["leases"]) \
        == (["/dev/nvidia0", "/dev/nvidia1"], True, [])
    assert seen["nvidia-plain"]["init"].startswith("ok")
    no_lease = seen["nvidia-no-lease"]
    assert (no_lease["nodes"], no_lease["driver_injected"], no_lease["env"], no_lease["leases"]) == (
        [], False, {"NVIDIA_VISIBLE_DEVICES": "void"}, [])
    assert no_lease["libcuda"] == "/usr/local/cuda/compat/libcuda.so.1"
    assert "not shown here: that CUDA finds no device" in by_name["nvidia-runtime.no-lease"]["detail"]
    leased = seen["nvidia-leased"]
    assert (leased["nodes"], leased["driver_injected"], leased["env"]["CUDA_VISIBLE_DEVICES"]) == (
        ["/dev/nvidia0"], True, A100)
    assert leased["init"].startswith("ok") and leased["leases"][0].endswith(f"bound on {A100}")


def test_where_the_spec_puts_libcuda() -> None:
    spec = {"containerEdits": {"mounts": [
        {"hostPath": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.1", "containerPath": "/usr/lib/libnvidia-ml.so"},
        {"hostPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04",
         "containerPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04"}]}}
    assert libcuda_in(spec) == "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04"
    assert libcuda_on_host(spec) == "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04"
    assert libcuda_on_host({"devices": [{"containerEdits": {"mounts": [
        {"hostPath": "/opt/fake/libcuda.so", "containerPath": "/usr/lib/libcuda.so.1"}]}}]}) == "/opt/fake/libcuda.so"
    with pytest.raises(ValueError, match=r"no libcuda\.so"):
        libcuda_in({"devices": [{"name": "0", "containerEdits": {}}]})
    with pytest.raises(ValueError, match=r"no libcuda\.so"):
        libcuda_on_host({})


@pytest.mark.parametrize("real_driver", [True, False])
def test_a_container_without_a_lease_passes_on_a_real_driver_only_where_cuda_finds_no_device(
        real_driver: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What the fake libcuda answers in a container with no GPU node: init ok. On a real driver that fails the check;
    # on the fake it passes on what the runtime did, and says what it could not show.
    proof = WholePath(GpuSide(backend=None, mps_binary="", write_cdi=lambda d: d, real_driver=real_driver), tmp_path)
    seen = {"exit": 0, "nodes": [], "driver_injected": False, "libcuda": "/usr/local/cuda/compat/libcuda.so.1",
            "env": {"NVIDIA_VISIBLE_DEVICES": "void"}, "init": "ok, 132 SMs", "leases": [], "init_ok": True,
            "load": {"op": "load", "ok": True}, "lease_list": [], "tail": ""}
    monkeypatch.setattr(proof, "_probe", lambda *a, **k: seen)
    proof.nvidia_no_lease()
    [check] = proof.checks
    assert check["result"] == ("fail" if real_driver else "ok")
    assert ("not shown here" in check["detail"]) is not real_driver
    seen.update(init_ok=False, init="CUDA_ERROR_NO_DEVICE")
    proof.nvidia_no_lease()
    assert proof.checks[-1]["result"] == "ok"
    seen.update(nodes=["/dev/nvidia0", "/dev/nvidiactl"])  # a GPU node: fails whatever CUDA says
    proof.nvidia_no_lease()
    assert proof.checks[-1]["result"] == "fail"


def test_where_the_toolkit_writes_no_spec_the_proof_says_so_and_goes_on_with_its_own(tmp_path: Path) -> None:
    # As on a machine whose driver libraries are outside the loader's cache, where nvidia-ctk finds no libcuda.
    driver = tmp_path / "nvidia" / "lib64"
    driver.mkdir(parents=True)
    for name in ("libcuda.so.580.1", "libnvidia-ptxjitcompiler.so.580.1", "libnvidia-ml.so.580.1", "libGL.so.1"):
        (driver / name).touch()
    devices = [GpuDevice(index=0, uuid=A100, name="A100", memory_total=80 << 30, mig_enabled=False, minor=0)]

    def toolkit(directory: Path) -> Path:
        raise RuntimeError("nvidia-ctk cdi generate failed (1): failed to locate libcuda.so")

    proof = WholePath(GpuSide(backend=None, mps_binary="", write_cdi=toolkit,
                              fallback_cdi=own_cdi(devices, driver / "libcuda.so.580.1")), tmp_path)
    proof.ctrd = SimpleNamespace(cdi_spec_dir=tmp_path)
    path, where = proof._cdi_spec()
    assert where == str(driver / "libcuda.so.580.1")
    assert proof.checks == [{"name": "cdi.spec", "result": "fail", "detail": "RuntimeError: nvidia-ctk cdi generate "
                             "failed (1): failed to locate libcuda.so; the rest runs on a spec of the proof's own"}]
    spec = json.loads(path.read_text())
    assert [d["name"] for d in spec["devices"]] == ["0", A100, "all"]
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0"}]
    assert sorted(Path(m["hostPath"]).name for m in spec["containerEdits"]["mounts"]) == [
        "libcuda.so.580.1", "libnvidia-ml.so.580.1", "libnvidia-ptxjitcompiler.so.580.1"]
    assert spec["containerEdits"]["env"] == [f"LD_LIBRARY_PATH={driver}"]
