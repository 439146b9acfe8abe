"""``bench.gpu_value`` before it makes anything, and its workload (``bench.gpu_workload``) on its own.

The whole run, on the fake GPU through real containerd and agents, is ``integration/gpucheck/test_gpu_value.py``.
"""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from shim.bench.checkout import gpu_value, gpu_workload
from shim.broker.nvml import NvmlBackend, NvmlUnavailable
from tests.broker.fakes import A100, FakeMig, FakeNvml, proc

WORKLOAD = Path(gpu_workload.__file__)


@pytest.fixture
def nvml() -> FakeNvml:
    return FakeNvml()


def test_the_first_gpu_outside_mig_is_used_when_nothing_else_runs_on_it(nvml: FakeNvml) -> None:
    device = gpu_value.preflight(NvmlBackend(library=nvml))
    assert (device.index, device.uuid) == (0, A100)


def test_a_gpu_busy_with_another_process_stops_the_run_naming_it(nvml: FakeNvml) -> None:
    nvml.compute["h0"] = [proc(4242, 3 << 30)]
    with pytest.raises(gpu_value.Stopped, match=rf"GPU 0 \({A100}\) is busy: process\(es\) 4242 \(3072 MiB\)"):
        gpu_value.preflight(NvmlBackend(library=nvml))
    nvml.compute["h0"] = []
    nvml.compute["h1"] = [proc(99, 1 << 30)]  # another GPU's process is not in the way
    assert gpu_value.preflight(NvmlBackend(library=nvml)).uuid == A100


def test_no_gpu_outside_mig_or_a_driver_that_does_not_answer_stops_the_run(nvml: FakeNvml) -> None:
    nvml.handles = {"h0": A100}
    nvml.enable_mig({0: FakeMig("MIG-1", 1, 0, 10 << 30)})
    with pytest.raises(gpu_value.Stopped, match="no GPU outside MIG"):
        gpu_value.preflight(NvmlBackend(library=nvml))
    backend = NvmlBackend(library=FakeNvml())
    backend._nv.broken["nvmlDeviceGetComputeRunningProcesses"] = 15  # NVML_ERROR_GPU_IS_LOST
    with pytest.raises(gpu_value.Stopped, match="the driver did not answer"):
        gpu_value.preflight(backend)


def test_without_a_driver_the_run_says_so_and_makes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    def missing() -> NvmlBackend:
        raise NvmlUnavailable("nvmlInit: NVML Shared Library Not Found (is the NVIDIA driver installed and loaded?)")

    monkeypatch.setattr("shim.broker.nvml.NvmlBackend", missing)
    assert gpu_value.main(["--out", str(tmp_path / "out")]) == 2
    assert "no GPU to measure on: nvmlInit: NVML Shared Library Not Found" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_with_the_gpu_busy_the_run_stops_before_it_makes_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    nvml = FakeNvml()
    nvml.compute["h0"] = [proc(4242, 1 << 30)]
    monkeypatch.setattr("shim.broker.nvml.NvmlBackend", lambda: NvmlBackend(library=nvml))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # where its work directory would be
    assert gpu_value.main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "stopped before anything was made: GPU 0" in err and "is busy: process(es) 4242" in err
    assert (tmp_path / "out" / "summary.txt").read_text().startswith("gpu value: not started: GPU 0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no work directory, no fabric, no broker
    assert nvml.initialised == 0  # NVML let go


def test_a_plan_too_small_to_compare_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        gpu_value.main(["--out", str(tmp_path), "--pods", "1"])
    assert "want --pods >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_value.main(["--out", str(tmp_path), "--pods", "4", "--window", "30"])


# -- the workload ----------------------------------------------------------------------------------------------
def test_the_cpu_stage_decodes_what_it_made_and_what_pillow_makes() -> None:
    png = gpu_workload.make_png(7, 24)
    width, height, rgb = gpu_workload.decode_png(png)
    assert (width, height, len(rgb)) == (24, 24, 24 * 24 * 3)
    image = pytest.importorskip("PIL.Image")
    assert image.open(io.BytesIO(png)).tobytes() == rgb  # what it encodes is a PNG others read
    # Pillow's encoder picks each row's filter (None, Sub, Up, Average, Paeth): every one undone alike.
    noisy = image.frombytes("RGB", (40, 30), bytes((i * 37 + (i // 120) * 11) % 256 for i in range(40 * 30 * 3)))
    out = io.BytesIO()
    noisy.save(out, format="PNG", optimize=True)
    assert gpu_workload.decode_png(out.getvalue()) == (40, 30, noisy.tobytes())


def test_a_png_it_cannot_read_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="not a PNG"):
        gpu_workload.decode_png(b"GIF89a")
    ihdr = gpu_workload._chunk(b"IHDR", bytes.fromhex("00000004 00000004 10 06 000000"))
    with pytest.raises(ValueError, match="only 8-bit RGB, not depth 16 colour type 6"):
        gpu_workload.decode_png(gpu_workload.PNG_MAGIC + ihdr + gpu_workload._chunk(b"IDAT", zlib.compress(b"")))


def test_resizing_averages_the_pixels_each_output_pixel_covers() -> None:
    # A 4x4 image of four 2x2 quadrants, each one colour: down to 2x2, each pixel its quadrant's colour.
    quadrant = [(0, 0, 0), (200, 100, 50), (10, 20, 30), (255, 255, 255)]
    rgb = bytes(c for y in range(4) for x in range(4) for c in quadrant[(y // 2) * 2 + x // 2])
    assert gpu_workload.resize(4, 4, rgb, 2) == bytes(c for q in quadrant for c in q)
    # Stripes of 0 and 100 average to 50.
    stripes = bytes(c for y in range(4) for x in range(4) for c in ((0, 0, 0) if x % 2 else (100, 100, 100)))
    assert gpu_workload.resize(4, 4, stripes, 1) == bytes((50, 50, 50))


def _lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _stage(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-I", "-S", str(WORKLOAD), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={"PATH": "/usr/bin:/bin", **(env or {})})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_stages_stream_batches_and_count_what_a_gpu_stage_killed_mid_run_lost(fake_libcuda: str,
                                                                                  tmp_path: Path) -> None:
    port = _free_port()
    env = {"FAKE_GPU_WORLD": str(tmp_path), "FAKE_CUDA_KERNEL_TIME": "1"}
    gpu_args = ("gpu", "--port", str(port), "--kernel-ms", "20", "--alloc-mib", "64", "--libcuda", fake_libcuda)
    cpu = _stage("cpu", "--port", str(port), "--batch", "2", "--side", "16", "--out-side", "8")
    gpu = _stage(*gpu_args, env=env)  # after the CPU stage: it waits for its GPU stage, losing nothing
    try:
        _until(lambda: any(p.name.endswith(".kernels") and len(p.read_text().splitlines()) >= 5
                           for p in tmp_path.iterdir()))
        gpu.kill()  # as the OOM killer would: no last line
        gpu_out, _ = gpu.communicate(timeout=10)
        time.sleep(0.5)  # the CPU stage finds it gone, and waits with its next batch
        again = _stage(*gpu_args, env=env)  # kubelet's restart
        try:
            _until(lambda: sum(1 for p in tmp_path.iterdir() if p.name.endswith(".kernels")) == 2)
            time.sleep(0.3)
        finally:
            cpu.send_signal(signal.SIGTERM)  # the pod's end: the CPU stage first, then the GPU stage it feeds
            cpu_out, cpu_err = cpu.communicate(timeout=10)
            again.send_signal(signal.SIGTERM)
            try:
                again_out, again_err = again.communicate(timeout=10)
            finally:
                if again.poll() is None:
                    again.kill()
    finally:
        for stage in (cpu, gpu):  # nothing left running, however the test went
            if stage.poll() is None:
                stage.kill()
                stage.communicate(timeout=10)
    first, second, made = _lines(gpu_out), _lines(again_out), _lines(cpu_out)
    ready = [a for a in first if a["op"] == "ready"]
    assert ready and ready[0]["ok"] and ready[0]["sms"] == 132 and ready[0]["kernel_ms"] == 20
    batches = [a for a in first if a["op"] == "batch"]
    assert batches and all(a["items"] == 2 and a["kernel_s"] >= 0.02 for a in batches)
    assert second[-1]["op"] == "end" and second[-1]["done"] > 0, again_err
    end = made[-1]
    assert end["op"] == "end", cpu_err
    served = batches[-1]["done"] + second[-1]["done"]
    lost = [a for a in made if a["op"] == "lost"]
    # What the CPU stage made went to a GPU stage, was lost with the killed one (at most the batch in flight), or
    # was still held when it ended; nothing is counted twice.
    assert len(lost) <= 1 and end["lost"] == sum(a["items"] for a in lost)
    assert end["acked"] <= served <= end["acked"] + end["in_flight"] + 2
    assert end["made"] >= end["acked"] + end["lost"] + end["in_flight"]
    assert [a["op"] for a in made].count("connected") == 2  # to the first GPU stage, then to its restart


def test_calibration_reports_the_cpu_time_of_one_batch() -> None:
    res = subprocess.run([sys.executable, "-I", "-S", str(WORKLOAD), "calibrate", "--batch", "2", "--side", "16",
                          "--out-side", "8", "--seconds", "0.2"], capture_output=True, text=True, check=True)
    cal = json.loads(res.stdout)
    assert cal["batch_cpu_ms"] > 0 and cal["batches"] >= 3 and (cal["batch_items"], cal["side"]) == (2, 16)


def test_the_record_names_each_sample_as_its_exporter_would() -> None:
    broker = ('# TYPE weft_gpu_lease_bytes gauge\nweft_gpu_lease_bytes{gpu="0",UUID="GPU-1",pod="weft-0",'
              'namespace="gpu-value",container="gpu",lease="l1"} 4.0e+10\n# TYPE weft_gpu_lease_held_seconds counter\n'
              'weft_gpu_lease_held_seconds_total{gpu="0",UUID="GPU-1",pod="weft-0",namespace="gpu-value",'
              'container="gpu"} 1.5\n# TYPE weft_gpu_other gauge\nweft_gpu_other 1\n')
    pods = [{"name": "bundled-0", "window": "bundled", "uid": "u0", "started": 100.0, "running": 101.0},
            {"name": "weft-0", "window": "weft", "uid": "u1", "started": 200.0, "running": 201.5}]
    samples = [{"t": 102.0, "window": "bundled", "holders": ["bundled-0"], "util_percent": 20.0,
                "fb_used_bytes": 2048 * (1 << 20), "fb_free_bytes": 1024 * (1 << 20), "sm_active": None,
                "gr_engine_active": None, "containers": {"bundled-0/cpu": ["gpu-1", 3.5]}, "broker_metrics": ""},
               {"t": 150.0, "window": "", "holders": [], "util_percent": 0.0, "fb_used_bytes": 0.0,
                "fb_free_bytes": 3072 * (1 << 20), "sm_active": None, "gr_engine_active": None, "containers": {},
                "broker_metrics": ""},
               {"t": 202.0, "window": "weft", "holders": ["weft-0"], "util_percent": 55.0, "fb_used_bytes": 0.0,
                "fb_free_bytes": 3072 * (1 << 20), "sm_active": 0.25, "gr_engine_active": 0.5,
                "containers": {"weft-0/cpu": ["cpu-2", 1.25], "weft-0/gpu": ["gpu-1", None]},
                "broker_metrics": broker}]
    doc = {"figures": {"device": {"index": 0, "uuid": "GPU-1", "name": "NVIDIA H100 80GB HBM3", "memory_mib": 3072}},
           "plan": {"pods": 4}, "pods": pods, "samples": samples}
    lines = gpu_value.record(doc).splitlines()
    assert lines[-1] == "# EOF"
    gpu = 'gpu="0",UUID="GPU-1",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-1"'
    assert f'DCGM_FI_DEV_GPU_UTIL{{{gpu},container="gpu",namespace="gpu-value",pod="bundled-0"}} 20.0 102.000' in lines
    assert f'DCGM_FI_DEV_FB_USED{{{gpu},container="gpu",namespace="gpu-value",pod="bundled-0"}} 2048.0 102.000' \
        in lines
    assert f'DCGM_FI_DEV_GPU_UTIL{{{gpu},container="",namespace="",pod=""}} 0.0 150.000' in lines  # no pod holds it
    assert f'DCGM_FI_PROF_SM_ACTIVE{{{gpu},container="gpu",namespace="gpu-value",pod="weft-0"}} 0.25 202.000' in lines
    assert not any(line.startswith("DCGM_FI_PROF_SM_ACTIVE") and line.endswith(" 102.000") for line in lines)
    assert ('container_cpu_usage_seconds_total{namespace="gpu-value",pod="weft-0",container="cpu",node="cpu-2",'
            'cpu="total"} 1.25 202.000') in lines
    assert not any('container="gpu",node="gpu-1",cpu="total"} ' in line and "weft-0" in line for line in lines)
    assert ('weft_gpu_lease_bytes{gpu="0",UUID="GPU-1",pod="weft-0",namespace="gpu-value",container="gpu",'
            'lease="l1"} 40000000000.0 202.000') in lines
    assert any(line.startswith("weft_gpu_lease_held_seconds_total{") for line in lines)
    assert not any(line.startswith("weft_gpu_other") for line in lines)
    # Whole GPUs from the device plugin before; shared replicas while weft's pods share it.
    assert 'kube_node_labels{node="gpu-1"} 1.0 102.000' in lines
    assert 'kube_node_labels{node="gpu-1",label_nvidia_com_gpu_replicas="4"} 1.0 202.000' in lines
    assert 'kube_pod_labels{namespace="gpu-value",pod="weft-0",uid="u1",label_app="gpu-value"} 1.0 202.000' in lines
    families = [line for line in lines if line.startswith("# TYPE ")]
    assert len(families) == len(set(families))  # each family once, its samples together
