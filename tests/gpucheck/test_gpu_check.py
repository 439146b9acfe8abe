"""``weft gpu-check --skip-live`` against the fake NVML, the fake MPS control binary and a fake kubelet directory.

Each case is what an operator sees: the JSON line's checks and verdict (the
contract outside checks rely on), the table, and the exit code.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from shim._pb import broker_pb2 as pb
from shim.gpucheck import cli
from shim.gpucheck.live import pick_device
from tests.broker.fakes import A100, GI, MIG_A, MIG_B, T4, FakeMig, FakeNvml, install_fake_mps, two_instances
from tests.install.conftest import HOSTROOTS


@pytest.fixture
def mps_binary(tmp_path: Path) -> str:
    return install_fake_mps(tmp_path / "bin")


@pytest.fixture
def kubelet(tmp_path: Path) -> Path:
    """A kubelet whose NVIDIA device plugin advertises each GPU four times (time-slicing replicas)."""
    root = tmp_path / "kubelet"
    (root / "device-plugins").mkdir(parents=True)
    ids = [f"{u}::{i}" for u in (A100, T4) for i in range(4)]
    write_checkpoint(root, {"nvidia.com/gpu": ids})
    return root


def write_checkpoint(root: Path, registered: dict) -> None:
    (root / "device-plugins" / "kubelet_internal_checkpoint").write_text(json.dumps(
        {"Data": {"PodDeviceEntries": None, "RegisteredDevices": registered}, "Checksum": 1}))


def check(nvml: FakeNvml, mps_binary: str, kubelet: Path, *, as_json: bool = True,
          host_root: Path = HOSTROOTS / "kubeadm") -> tuple[int, dict | str]:
    out = io.StringIO()
    env = cli.Environment(nvml_library=nvml, mps_binary=mps_binary, kubelet_dir=kubelet, out=out,
                          host_root=host_root)
    code = cli.run(as_json, None, True, env)
    text = out.getvalue()
    return code, json.loads(text.splitlines()[-1]) if as_json else text


def by_name(doc: dict) -> dict[str, dict]:
    return {c["name"]: c for c in doc["checks"]}


def test_a_node_that_can_enforce_leases(mps_binary: str, kubelet: Path) -> None:
    nvml = FakeNvml()
    code, doc = check(nvml, mps_binary, kubelet)
    # other-mps reads the whole machine, where another test's daemon may be running at that moment.
    results = {c["name"]: c["result"] for c in doc["checks"] if c["name"] != "other-mps"}
    assert code == cli.EXIT_OK and set(results.values()) == {"ok"}, doc
    assert [c["name"] for c in doc["checks"]] == [
        "nvml", "cuda-driver", "devices", "compute-capability", "compute-mode", "mig", "persistence-mode",
        "mps-control", "mps-server", "other-mps", "device-plugin", "containerd", "nvidia-runtime"][
        :len(doc["checks"])]
    checks = by_name(doc)
    assert all(set(c) == {"name", "result", "detail"} for c in doc["checks"])
    assert checks["nvml"]["detail"] == "driver 550.54.15, CUDA driver 12.4"
    assert A100 in checks["devices"]["detail"] and "80.0 GiB" in checks["devices"]["detail"]
    assert "took a 1024 MiB memory and 50% compute limit and read them back" in checks["mps-control"]["detail"]
    assert "4 replicas each" in checks["device-plugin"]["detail"] and checks["device-plugin"]["result"] == "ok"
    assert not [name for name, _ in nvml.calls if "Set" in name], "gpu-check changes no device setting"


def test_no_driver_exits_with_its_own_code(mps_binary: str, kubelet: Path) -> None:
    nvml = FakeNvml()
    nvml.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    code, doc = check(nvml, mps_binary, kubelet)
    assert code == cli.EXIT_NO_DRIVER
    assert doc["verdict"] == "fail" and [c["name"] for c in doc["checks"]] == ["nvml"]
    assert doc["checks"][0]["detail"].startswith("no NVIDIA driver")


def test_on_this_machine_without_a_driver_weft_says_so() -> None:
    proc = subprocess.run([sys.executable, "-m", "shim", "gpu-check", "--json"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == cli.EXIT_NO_DRIVER, proc.stderr
    doc = json.loads(proc.stdout.splitlines()[-1])
    assert doc["verdict"] == "fail" and doc["checks"][0]["name"] == "nvml"
    assert "no NVIDIA driver" in doc["checks"][0]["detail"]
    table = subprocess.run([sys.executable, "-m", "shim", "gpu-check"], capture_output=True, text=True, timeout=60)
    assert table.returncode == cli.EXIT_NO_DRIVER and "no NVIDIA driver" in table.stdout


@pytest.mark.parametrize(
    ("broken", "words"),
    [
        pytest.param({"init_error": pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH}, ["answered an error", "nvmlInit"],
                     id="driver-library-mismatch"),
        pytest.param({"broken": {"nvmlDeviceGetComputeMode": pynvml.NVML_ERROR_GPU_IS_LOST}},
                     ["nvmlDeviceGetComputeMode on", "GPU is lost"], id="gpu-lost-mid-inventory"),
        pytest.param({"broken": {"nvmlDeviceGetCount": pynvml.NVML_ERROR_UNKNOWN}}, ["nvmlDeviceGetCount"],
                     id="device-count-fails"),
    ],
)
def test_a_driver_that_answers_an_error_is_a_failed_check_naming_the_call(
    mps_binary: str, kubelet: Path, broken: dict, words: list[str]
) -> None:
    nvml = FakeNvml()
    for attr, value in broken.items():
        setattr(nvml, attr, value)
    code, doc = check(nvml, mps_binary, kubelet)
    assert code == cli.EXIT_FAILED and doc["verdict"] == "fail"
    [nvml_check] = [c for c in doc["checks"] if c["name"] == "nvml"]
    assert nvml_check["result"] == "fail" and all(w in nvml_check["detail"] for w in words)


@pytest.mark.parametrize(
    ("setup", "name", "result", "words"),
    [
        pytest.param(lambda n: n.compute_mode.update(h1=pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS), "compute-mode",
                     "fail", ["GPU 1 is Exclusive_Process", "nvidia-smi -i 1 -c DEFAULT"], id="exclusive-process"),
        pytest.param(lambda n: n.compute_mode.update(h0=pynvml.NVML_COMPUTEMODE_PROHIBITED), "compute-mode",
                     "fail", ["GPU 0 is Prohibited", "nvidia-smi -i 0 -c DEFAULT"], id="prohibited"),
        pytest.param(lambda n: n.enable_mig({}), "mig", "warn",
                     ["GPU 0 has MIG on and no MIG instances: nothing on it can be leased",
                      "nvidia-smi mig -i 0 -cgi <profiles> -C", "nvidia-smi -i 0 -mig 0"],
                     id="mig-on-without-instances"),
        pytest.param(lambda n: n.mig.update(h0=[pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE]),
                     "mig", "warn", ["GPU 0 has MIG on pending"], id="mig-pending"),
        pytest.param(lambda n: n.persistence.update(h1=pynvml.NVML_FEATURE_DISABLED), "persistence-mode", "warn",
                     ["off on GPU 1", "nvidia-smi -i 1 -pm 1"], id="persistence-off"),
        pytest.param(lambda n: setattr(n, "cuda_version", 11040), "cuda-driver", "fail",
                     ["CUDA driver 11.4", "11.5 or newer"], id="cuda-too-old-for-memory-limits"),
        pytest.param(lambda n: n.capability.update(h1=(6, 1)), "compute-capability", "fail",
                     ["GPU 1 is 6.1", "Volta"], id="pre-volta-gpu"),
        pytest.param(lambda n: n.handles.clear(), "devices", "fail", ["NVML shows no GPU"], id="no-gpu"),
    ],
)
def test_a_setting_weft_cannot_work_with_says_what_to_change(
    mps_binary: str, kubelet: Path, setup, name: str, result: str, words: list[str]
) -> None:
    nvml = FakeNvml()
    setup(nvml)
    code, doc = check(nvml, mps_binary, kubelet)
    got = by_name(doc)[name]
    assert got["result"] == result and all(w in got["detail"] for w in words), got
    assert code == (cli.EXIT_FAILED if result == "fail" else cli.EXIT_OK)
    assert doc["verdict"] == result


def test_no_mps_binary_fails_and_says_what_to_install(tmp_path: Path, kubelet: Path) -> None:
    code, doc = check(FakeNvml(), str(tmp_path / "nowhere" / "nvidia-cuda-mps-control"), kubelet)
    got = by_name(doc)["mps-control"]
    assert code == cli.EXIT_FAILED and got["result"] == "fail"
    assert "is not on PATH" in got["detail"] and "nvidia-compute-utils" in got["detail"]


@pytest.mark.parametrize(
    ("fault", "words"),
    [
        pytest.param("FAKE_MPS_IGNORE_LIMITS", ["did not take its limits", "active thread percentage of '100.0'"],
                     id="a-daemon-that-ignores-limits"),
        pytest.param("FAKE_MPS_EXIT_AT_START", ["exited with code 3"], id="a-daemon-that-dies-as-it-starts"),
    ],
)
def test_an_mps_daemon_at_fault_fails_the_node(
    fault: str, words: list[str], mps_binary: str, kubelet: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(fault, "1")
    code, doc = check(FakeNvml(), mps_binary, kubelet)
    got = by_name(doc)["mps-control"]
    assert code == cli.EXIT_FAILED and got["result"] == "fail"
    assert all(w in got["detail"] for w in words), got


@pytest.mark.parametrize(
    ("registered", "dra", "result", "words"),
    [
        pytest.param({"nvidia.com/gpu": [A100, T4]}, None, "warn",
                     ["2 whole GPU(s)", "only within the GPUs each pod was given", "sharing.timeSlicing"],
                     id="whole-gpus"),
        pytest.param({"nvidia.com/gpu": [f"{A100}::{i}" for i in range(8)] + [f"{T4}::{i}" for i in range(8)]},
                     None, "ok", ["2 GPU(s) advertised as 16", "up to 8 pods on one GPU"], id="replicas"),
        pytest.param({"nvidia.com/gpu": [A100]}, None, "warn", ["1 whole GPU(s)", "NVML shows 2"],
                     id="plugin-sees-fewer-gpus"),
        pytest.param({"example.com/fpga": ["f0"]}, "gpu.nvidia.com", "ok", ["DRA driver gpu.nvidia.com"],
                     id="dra-driver"),
        pytest.param({"example.com/fpga": ["f0"]}, None, "warn", ["no GPU resource registered"],
                     id="no-gpu-plugin"),
    ],
)
def test_what_the_device_plugin_advertises_and_what_weft_can_pack(
    mps_binary: str, kubelet: Path, registered: dict, dra: str | None, result: str, words: list[str]
) -> None:
    write_checkpoint(kubelet, registered)
    if dra:
        (kubelet / "plugins_registry").mkdir()
        (kubelet / "plugins_registry" / f"{dra}-reg.sock").touch()
    _, doc = check(FakeNvml(), mps_binary, kubelet)
    got = by_name(doc)["device-plugin"]
    assert got["result"] == result and all(w in got["detail"] for w in words), got


@pytest.mark.parametrize("state", ["missing", "unreadable"])
def test_a_node_without_kubelet_state_is_a_warning(mps_binary: str, tmp_path: Path, state: str) -> None:
    kubelet = tmp_path / "kubelet"
    if state == "unreadable":
        (kubelet / "device-plugins").mkdir(parents=True)
        (kubelet / "device-plugins" / "kubelet_internal_checkpoint").write_text("{not json")
    _, doc = check(FakeNvml(), mps_binary, kubelet)
    got = by_name(doc)["device-plugin"]
    assert got["result"] == "warn"
    assert ("no kubelet state" if state == "missing" else "no readable device-manager checkpoint") in got["detail"]


def test_the_table_shows_every_check_and_the_verdict(mps_binary: str, kubelet: Path) -> None:
    nvml = FakeNvml()
    nvml.persistence["h0"] = pynvml.NVML_FEATURE_DISABLED
    code, text = check(nvml, mps_binary, kubelet, as_json=False)
    assert code == cli.EXIT_OK
    rows = text.splitlines()
    assert rows[0].split() == ["CHECK", "DETAIL"]
    assert any(r.startswith("persistence-mode") and " warn " in r for r in rows)
    assert rows[-1] == "verdict: warn (nothing failed; see the warnings)"


def test_live_is_not_run_where_a_check_it_needs_failed(mps_binary: str, kubelet: Path) -> None:
    nvml = FakeNvml()
    nvml.compute_mode["h0"] = pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    out = io.StringIO()
    env = cli.Environment(nvml_library=nvml, mps_binary=mps_binary, kubelet_dir=kubelet, out=out)
    assert cli.run(True, None, False, env) == cli.EXIT_FAILED
    live = by_name(json.loads(out.getvalue().splitlines()[-1]))["live"]
    assert live == {"name": "live", "result": "fail", "detail": "not run: compute-mode failed above"}


@pytest.mark.parametrize("argv", [["gpu-check", "--bogus"], ["gpu-check", "--broker-socket"]],
                         ids=["unknown-flag", "flag-without-its-value"])
def test_bad_usage_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from shim.cli import main

    assert main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "usage: weft" in err and argv[1] in err


def test_gpu_check_is_in_weft_help() -> None:
    from shim.cli import parser

    assert "gpu-check" in parser().format_help()


def test_an_mps_daemon_weft_did_not_start_is_named(mps_binary: str, kubelet: Path, tmp_path: Path) -> None:
    from shim.broker.mps import MpsSupervisor

    theirs = MpsSupervisor(tmp_path / "theirs", mps_binary)  # run by this test, not by a weft broker
    daemon = theirs.ensure("their-mps", A100)
    try:
        code, doc = check(FakeNvml(), mps_binary, kubelet)
    finally:
        theirs.stop_all()
    got = by_name(doc)["other-mps"]
    assert code == cli.EXIT_OK and got["result"] == "warn"
    assert f"pid {daemon.pid} (pipe directory {daemon.pipe_dir})" in got["detail"]


# -- MIG ------------------------------------------------------------------------------------------
DEVICE_FIELDS = {"index", "uuid", "name", "memory_total", "memory_used", "mig", "compute_mode", "compute_capability"}


def test_mig_mode_and_instances_are_reported_and_the_instances_are_what_is_shared(
        mps_binary: str, kubelet: Path) -> None:
    nvml = FakeNvml()
    nvml.enable_mig(two_instances())
    nvml.instances["h0"][2].used = 3 * GI
    nvml.mig["h0"] = [pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE]
    nvml.handles = {"h0": A100}  # the only GPU has MIG on: the MPS probe takes its first instance
    write_checkpoint(kubelet, {"nvidia.com/mig-1g.10gb": [f"{MIG_A}::{i}" for i in range(2)],
                               "nvidia.com/mig-3g.40gb": [f"{MIG_B}::{i}" for i in range(2)]})
    code, doc = check(nvml, mps_binary, kubelet)
    checks = by_name(doc)
    assert checks["mig"]["result"] == "warn", "a pending change is still named"
    assert checks["compute-mode"]["result"] == "ok" and checks["devices"]["result"] == "ok"
    assert "GPU 0 has MIG off pending (at its next reset)" in checks["mig"]["detail"]
    assert f"GPU 0 has MIG on with 2 MIG instance(s) ({MIG_A}, {MIG_B})" in checks["mig"]["detail"]
    devices = checks["devices"]["detail"]
    assert "MIG on (off at its next reset)" in devices
    assert (f"MIG instances: {MIG_A} (NVIDIA A100-SXM4-80GB MIG 1g.10gb, 10.0 GiB, 0.0 GiB used, 14 SMs, GPU instance "
            f"7, compute instance 0), {MIG_B} (NVIDIA A100-SXM4-80GB MIG 3g.40gb, 40.0 GiB, 3.0 GiB used, 42 SMs, "
            "GPU instance 2, compute instance 0)") in devices
    assert f"a private daemon for {MIG_A} took" in checks["mps-control"]["detail"]
    assert checks["device-plugin"]["result"] == "ok" and "NVML shows" not in checks["device-plugin"]["detail"]
    assert "1 MIG instance(s) advertised as 2" in checks["device-plugin"]["detail"]
    assert code == cli.EXIT_OK
    [gpu] = doc["devices"]
    assert set(gpu) >= DEVICE_FIELDS, "fields are added, never renamed"
    assert (gpu["uuid"], gpu["mig"], gpu["mig_pending"]) == (A100, True, False)
    assert gpu["mig_instances"] == [
        {"uuid": MIG_A, "name": "NVIDIA A100-SXM4-80GB MIG 1g.10gb", "memory_total": 10 * GI, "memory_used": 0,
         "gpu_instance_id": 7, "compute_instance_id": 0, "multiprocessors": 14},
        {"uuid": MIG_B, "name": "NVIDIA A100-SXM4-80GB MIG 3g.40gb", "memory_total": 40 * GI, "memory_used": 3 * GI,
         "gpu_instance_id": 2, "compute_instance_id": 0, "multiprocessors": 42}]
    assert not [name for name, _ in nvml.calls if "Set" in name or "Create" in name or "Destroy" in name], \
        "gpu-check changes no MIG setting"


def test_mig_on_with_instances_is_no_warning(mps_binary: str, kubelet: Path) -> None:
    nvml = FakeNvml()
    nvml.enable_mig(two_instances())
    _, doc = check(nvml, mps_binary, kubelet)
    assert by_name(doc)["mig"] == {"name": "mig", "result": "ok", "detail": (
        f"GPU 0 has MIG on with 2 MIG instance(s) ({MIG_A}, {MIG_B}), each leased whole or shared by its own UUID, "
        "the GPU itself never")}


def test_without_mig_the_json_devices_keep_their_fields_and_add_empty_instances(
        mps_binary: str, kubelet: Path) -> None:
    _, doc = check(FakeNvml(), mps_binary, kubelet)
    for gpu in doc["devices"]:
        assert set(gpu) >= DEVICE_FIELDS
        assert (gpu["mig"], gpu["mig_pending"], gpu["mig_instances"]) == (False, False, [])


def test_an_instance_without_an_sm_count_is_shown_without_one(mps_binary: str, kubelet: Path) -> None:
    nvml = FakeNvml()
    nvml.enable_mig({3: FakeMig(MIG_A, 1, 0, 20 * GI, sms=None)})
    _, doc = check(nvml, mps_binary, kubelet)
    assert f"{MIG_A} (NVIDIA A100-SXM4-80GB MIG 1g.10gb, 20.0 GiB, 0.0 GiB used, GPU instance 1" in \
        by_name(doc)["devices"]["detail"]
    assert doc["devices"][0]["mig_instances"][0]["multiprocessors"] is None


def test_a_device_plugin_that_names_more_mig_instances_than_nvml_shows_is_named(
        mps_binary: str, kubelet: Path) -> None:
    nvml = FakeNvml()
    nvml.enable_mig({0: FakeMig(MIG_A, 7, 0, 10 * GI)})
    write_checkpoint(kubelet, {"nvidia.com/gpu": [MIG_A, MIG_B]})
    _, doc = check(nvml, mps_binary, kubelet)
    got = by_name(doc)["device-plugin"]
    assert got["result"] == "warn"
    assert "nvidia.com/gpu: 2 whole MIG instance(s): weft packs only within the MIG instances each pod was given" \
        in got["detail"]
    assert "names 2 MIG instance(s) but NVML shows 1" in got["detail"]


def device(uuid: str, memory: int, *, mig: bool = False, leased: int = 0, exclusive: bool = False) -> pb.Device:
    return pb.Device(uuid=uuid, memory_total=memory, mig_enabled=mig, memory_leased=leased, exclusive=exclusive)


@pytest.mark.parametrize(
    ("devices", "free", "picked"),
    [
        pytest.param([device(A100, 80 * GI, mig=True), device(MIG_A, 10 * GI), device(MIG_B, 40 * GI)], {},
                     MIG_B, id="the-largest-instance-when-the-gpu-has-mig-on"),
        pytest.param([device(A100, 80 * GI, mig=True), device(MIG_A, 10 * GI), device(MIG_B, 40 * GI, exclusive=True)],
                     {}, MIG_A, id="not-an-instance-leased-whole"),
        pytest.param([device(A100, 80 * GI, mig=True), device(MIG_A, 10 * GI), device(MIG_B, 40 * GI)],
                     {MIG_B: 4 * GI}, MIG_A, id="not-an-instance-with-too-little-free"),
        pytest.param([device(A100, 80 * GI, mig=True), device(T4, 16 * GI), device(MIG_B, 40 * GI)], {}, T4,
                     id="a-gpu-without-mig-before-any-instance"),
        pytest.param([device(T4, 16 * GI, leased=15 * GI), device(MIG_A, 10 * GI)], {}, MIG_A,
                     id="not-a-gpu-leased-to-the-brim"),
        pytest.param([device(A100, 80 * GI, mig=True)], {}, None, id="never-the-mig-enabled-gpu"),
    ],
)
def test_the_live_test_picks_a_leasable_device(devices: list[pb.Device], free: dict, picked: str | None) -> None:
    assert pick_device(devices, 2 * GI, 5 * GI, free) == picked
