"""The founding promise's run (``bench.gpu_value``) on the fake GPU: what ``scripts/gpu-proof.sh --value`` runs on a
GPU node, here with two pods each way and a short window.

Real: three test nodes (containerd 2, runc, CNI, the agents and their mesh, each node on CPUs of its own), the
``weft`` handler and its OCI hook, the broker with its MPS supervisor and watchdog, the workload's image (this
machine's Python) and both of its stages, the stitched localhost between a rerouted CPU stage and its GPU stage,
and a real Prometheus backfilled from the run's record for ``weft report``. Fake: NVML, the MPS control binary,
``libcuda`` (whose kernels here take the time they ask for and say when they ran, from which the fake NVML's
utilisation comes) and the driver's CDI spec, as in ``test_whole_path.py``. The figures it prints prove the
plumbing, not the promise: the fake GPU's kernels cost nothing but time.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import time
from pathlib import Path

import psutil
import pytest

from integration.gpucheck.test_whole_path import fake_cdi, no_minor
from shim.bench.checkout.gpu_value import GpuValue, Plan, ValueGpu, record, report, summary, write
from shim.broker.nvml import NvmlBackend
from tests.broker.fakes import A100, FakeNvml, install_fake_mps
from tests.gpucheck import fakecuda


class BusyNvml(FakeNvml):
    """The fake NVML, its first GPU as busy as the fake libcuda's kernels kept it over the last second (any kernel
    running counts, as NVML's utilisation does), and its memory used what its live clients hold (each keeps a
    locked file of its own: a pod's clients have PIDs of their pods' namespaces, which the host cannot read)."""

    def nvmlDeviceGetUtilizationRates(self, h: str):  # noqa: N802 - pynvml's name
        rates = super().nvmlDeviceGetUtilizationRates(h)
        if h != "h0" or self.world is None:
            return rates
        now = time.time_ns()
        since = now - 1_000_000_000
        spans = []
        for path in self.world.glob("*.kernels"):
            for line in path.read_text().splitlines():
                start, _, end = line.partition(" ")
                if end and int(end) > since and int(start) < now:
                    spans.append((max(int(start), since), min(int(end), now)))
        busy, reach = 0, since
        for start, end in sorted(spans):
            if end > reach:
                busy += end - max(start, reach)
                reach = end
        rates.gpu = round(100 * busy / (now - since))
        return rates

    def nvmlDeviceGetMemoryInfo(self, h: str):  # noqa: N802
        info = super().nvmlDeviceGetMemoryInfo(h)
        if h == "h0" and self.world is not None:
            info.used = sum(_held(path) for path in self.world.glob("live-*"))
            info.free = info.total - info.used
        return info


def _held(path: Path) -> int:
    """The bytes a live client says it holds; 0 for one gone (nobody holds its lock)."""
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return int(f.read().strip() or 0)
        return 0


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp_path = tmp_path_factory.mktemp("gpu-value")
    world = tmp_path / "world"
    world.mkdir()
    libcuda = fakecuda.build(tmp_path)
    nvml = BusyNvml(world)
    nvml.nvmlDeviceGetMinorNumber = no_minor  # no /dev/nvidia<N> here: the fake CDI spec's nodes stand in
    backend = NvmlBackend(library=nvml)
    gpu = ValueGpu(backend=backend, mps_binary=install_fake_mps(tmp_path / "bin"), write_cdi=fake_cdi(libcuda, world),
                   client_env={"FAKE_CUDA_KERNEL_TIME": "1", "FAKE_GPU_WORLD_LIVE": "1"}, real_driver=False, nvml=nvml)
    plan = Plan(pods=2, window_s=20.0, busy=0.2, kill_one=True, sample_s=0.5, calibrate_s=1.0)
    out = tmp_path / "out"
    value = GpuValue(gpu, tmp_path / "work", plan)
    try:
        doc = value.run()
    finally:
        backend.close()
    write(out, doc, getattr(value, "logs", None))
    left = [p.info for p in psutil.process_iter(["pid", "cmdline"])
            if any(str(tmp_path) in part for part in (p.info["cmdline"] or []))]
    assert left == [], "nothing the run started is left running"
    code = report(out) if shutil.which("prometheus") and shutil.which("promtool") else None
    return {"doc": doc, "out": out, "report_code": code}


def test_the_same_pods_run_bundled_then_split_by_weft_and_nothing_is_left(run: dict) -> None:
    doc = run["doc"]
    print(summary(doc))  # what the GPU node's run says, in this run's log
    by_name = {c["name"]: c for c in doc["checks"]}
    assert doc["verdict"] == "measured", summary(doc)
    assert list(by_name) == ["gpu.free", "cdi.spec", "bundled.ran", "weft.placed", "fault.kill.released", "weft.ran",
                             "nothing-left"]
    f = doc["figures"]
    assert f["device"]["uuid"] == A100 and f["calibration"]["kernel_ms"] >= 1
    bundled, weft = f["bundled"], f["weft"]
    # Bundled: each pod had the whole GPU and ran both stages on the GPU node, one after the other.
    assert list(bundled["per_pod"]) == ["bundled-0", "bundled-1"]
    for pod in bundled["per_pod"].values():
        assert pod["share"] == 1.0 and pod["items"] > 0 and pod["placements"] == {"gpu": "plain", "cpu": "plain"}
    first, second = (p for p in doc["pods"] if p["window"] == "bundled")
    assert first["removed"] <= second["started"]  # never two at once, as the device plugin allows
    # weft: both at once, each GPU stage on half the GPU, each CPU stage on a CPU node.
    for name, pod in weft["per_pod"].items():
        assert pod["share"] == 0.5 and pod["items"] > 0, name
        assert pod["placements"]["gpu"] == "local" and pod["placements"]["cpu"].startswith("remote:cpu-")
    a, b = (p for p in doc["pods"] if p["window"] == "weft")
    assert a["running"] < b["removed"] and b["running"] < a["removed"]
    assert a["lease"]["memory_bytes"] == b["lease"]["memory_bytes"] == 40 << 30
    # Both windows were sampled, the GPU node's and the CPU nodes' CPU read; the fake GPU has no SM activity.
    assert bundled["samples"] > 0 and weft["samples"] > 0 and not doc["sampler_errors"]
    assert bundled["cpu"]["gpu-1"]["cpu_s"] > 0 and weft["cpu"]["gpu-1"] is not None
    assert bundled["sm_active_mean"] is None and "no GPM" in f["sm_activity"]
    assert set(f["weft_over_bundled"]) >= {"items_per_gpu_hour", "gpu_util_mean", "gpu_held_s", "gpu_node_cpu_s"}


def test_a_gpu_stage_killed_mid_run_has_its_lease_released_and_the_figures_say_what_was_lost(run: dict) -> None:
    doc = run["doc"]
    killed = doc["figures"]["weft"]["per_pod"]["weft-0"]["killed"]
    assert killed["lease_released_s"] is not None and killed["lease"]
    assert killed["seconds_without_gpu_stage"] > 0
    pod = doc["figures"]["weft"]["per_pod"]["weft-0"]
    # Its lease's GPU-seconds end with the lease, and its CPU stage says what it made that no GPU stage served.
    assert pod["held_wall_s"] < doc["figures"]["weft"]["per_pod"]["weft-1"]["held_wall_s"]
    assert pod["cpu_made"] is not None and pod["cpu_made"] >= pod["items"]
    assert pod["cpu_lost"] is not None and pod["cpu_unsent"] is not None and pod["cpu_lost"] + pod["cpu_unsent"] > 0
    text = summary(doc)
    assert "weft-0: " in text and "GPU stage killed, lease released" in text


def test_the_run_leaves_its_figures_and_a_record_in_dcgm_exporters_names(run: dict) -> None:
    out = run["out"]
    assert {p.name for p in out.iterdir()} >= {"agent-cpu-1.log", "agent-cpu-2.log", "agent-gpu-1.log", "record.om",
                                               "summary.txt", "value.json"}
    doc = json.loads((out / "value.json").read_text())
    text = (out / "record.om").read_text()
    assert text == record(doc) and text.endswith("# EOF\n")
    names = {line.split("{")[0] for line in text.splitlines() if not line.startswith("#")}
    assert {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "weft_gpu_lease_bytes",
            "weft_gpu_device_memory_bytes", "weft_gpu_lease_held_seconds_total", "kube_pod_info",
            "container_cpu_usage_seconds_total"} <= names
    assert "DCGM_FI_PROF_SM_ACTIVE" not in names  # the fake GPU has no GPM: left out, not made up
    # dcgm-exporter's pod mapping: the GPU's series name each pod it is allocated to, in each window.
    for pod in ("bundled-0", "bundled-1", "weft-0", "weft-1"):
        assert f'DCGM_FI_DEV_GPU_UTIL{{gpu="0",UUID="{A100}"' in text and f'pod="{pod}"' in text
    # A rerouted CPU stage's CPU is on the CPU node it ran on.
    assert any(line.startswith("container_cpu_usage_seconds_total{") and 'container="cpu"' in line
               and 'node="cpu-' in line for line in text.splitlines())


def test_weft_report_reads_the_record_from_a_real_prometheus(run: dict) -> None:
    if run["report_code"] is None:
        pytest.skip("no prometheus and promtool here (scripts/setup.sh installs Debian's prometheus)")
    out = run["out"]
    assert run["report_code"] in (0, 3), (out / "report.md").read_text()
    doc = json.loads((out / "report.json").read_text())
    assert doc["workload"]["selector"] and doc["windows_from"] == "flags"
    assert sorted(doc["pods"]) == ["bundled-0", "bundled-1", "weft-0", "weft-1"]
    assert doc["before"]["held_from"] and doc["after"]["held_from"]
    assert doc["verdict"]["outcome"] in ("kept", "no change", "worse", "no verdict")
    assert "Verdict" in (out / "report.md").read_text() or "verdict" in (out / "report.md").read_text()
