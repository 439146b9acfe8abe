"""gpu-check's CUDA client against a fake libcuda: its commands, its answers, and how it fails.

It runs as the live test runs it: ``python -I -S`` on its own file, commands
on stdin, one JSON answer per line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shim.gpucheck import cuda_client
from tests.broker.fakes import dead_pid

CLIENT = Path(cuda_client.__file__)
COMMANDS = "(init, alloc MIB, busy MS [SMS], free, sleep MS, devices, exit)"


def run(libcuda: str, commands: list[str], env: dict[str, str] | None = None, *args: str,
        timeout: float = 30) -> tuple[int, list[dict], str]:
    proc = subprocess.run([sys.executable, "-I", "-S", str(CLIENT), "--libcuda", libcuda, *args],
                          input="".join(c + "\n" for c in commands), capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", **(env or {})}, timeout=timeout)
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines()], proc.stderr


def test_a_client_outside_mps_sees_the_whole_device(fake_libcuda: str, tmp_path: Path) -> None:
    code, lines, _ = run(fake_libcuda, ["init", "alloc 1024", "busy 50", "free", "exit"],
                         {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path), "FAKE_CUDA_TOTAL_MIB": "16384",
                          "FAKE_CUDA_SMS": "40"})
    assert code == 0
    load, init, alloc, busy, free = lines
    assert load["ok"] and load["pid"] > 0
    assert (init["op"], init["ok"], init["name"], init["sms"], init["total_bytes"]) == (
        "init", True, "Fake GPU", 40, 16384 << 20)
    assert (alloc["ok"], alloc["bytes"], alloc["held_bytes"]) == (True, 1 << 30, 1 << 30)
    assert (busy["ok"], busy["sms_used"], busy["sms_total"], busy["blocks"]) == (True, 40, 40, 160)
    assert free == {"op": "free", "ok": True}


def test_an_mps_client_is_held_to_its_servers_limits(fake_libcuda: str, tmp_path: Path) -> None:
    (tmp_path / "control").touch()  # a daemon listens here
    (tmp_path / "fake-limits").write_text("1024 25\n")
    code, lines, _ = run(fake_libcuda, ["init", "alloc 512", "alloc 600", "busy 10", "busy 10 132"],
                         {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path), "FAKE_CUDA_SMS": "132"})
    assert code == 0
    _, init, within, beyond, busy, busy_whole = lines
    # As the driver shows an MPS client: the device's memory (the limit only refuses), a share of its SMs.
    assert (init["total_bytes"], init["sms"]) == (81920 << 20, 32)
    assert within["ok"] is True
    assert beyond == {"op": "alloc", "ok": False, "error": "CUDA_ERROR_OUT_OF_MEMORY", "code": 2,
                      "call": "cuMemAlloc_v2"}
    assert (busy["sms_used"], busy["sms_total"], busy["blocks"]) == (32, 32, 128)
    # Given blocks for the whole device, it still runs on its share alone.
    assert (busy_whole["sms_used"], busy_whole["sms_total"], busy_whole["blocks"]) == (32, 32, 528)


def test_a_clients_own_limit_only_lowers_its_servers(fake_libcuda: str, tmp_path: Path) -> None:
    (tmp_path / "control").touch()
    (tmp_path / "fake-limits").write_text("1024 50\n")
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path), "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8192M"}
    _, lines, _ = run(fake_libcuda, ["init", "alloc 1000", "alloc 48"], env)
    assert lines[2]["ok"] and lines[3]["error"] == "CUDA_ERROR_OUT_OF_MEMORY"
    env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = "0=256M"
    _, lines, _ = run(fake_libcuda, ["init", "alloc 200", "alloc 512"], env)
    assert lines[2]["ok"] and lines[3]["error"] == "CUDA_ERROR_OUT_OF_MEMORY"


@pytest.mark.parametrize(
    ("command", "error"),
    [
        pytest.param("alloc", "alloc takes 1 argument(s), got 0", id="missing-argument"),
        pytest.param("alloc 1 2", "alloc takes 1 argument(s), got 2", id="extra-argument"),
        pytest.param("alloc lots", "alloc MIB must be a whole number, got 'lots'", id="not-a-number"),
        pytest.param("alloc 0", "alloc MIB must be within 1..16777216, got 0", id="zero"),
        pytest.param("alloc -5", "alloc MIB must be within 1..16777216, got -5", id="negative"),
        pytest.param("busy 600000", "busy MS must be within 1..60000, got 600000", id="busy-too-long"),
        pytest.param("busy 10 0", "busy SMS must be within 1..4096, got 0", id="busy-no-sms"),
        pytest.param("busy 10 20 30", "busy takes 1 to 2 argument(s), got 3", id="busy-extra-argument"),
        pytest.param("launch", f"unknown command 'launch' {COMMANDS}", id="unknown"),
        pytest.param("   ", f"empty command {COMMANDS}", id="empty"),
    ],
)
def test_a_bad_command_is_answered_and_the_client_goes_on(fake_libcuda: str, command: str, error: str) -> None:
    code, lines, _ = run(fake_libcuda, ["init", command, "alloc 1"])
    assert code == 0
    assert lines[2]["ok"] is False and lines[2]["error"] == error
    assert lines[3]["ok"] is True, "a bad command changes nothing"


def test_a_client_whose_mps_server_died_gets_errors_not_answers(fake_libcuda: str, tmp_path: Path) -> None:
    (tmp_path / "control").touch()
    (tmp_path / "fake-limits").write_text("1024 50\n")
    gone = dead_pid()
    (tmp_path / "fake-daemon.pid").write_text(f"{gone}\n")
    _, lines, _ = run(fake_libcuda, ["init", "alloc 16", "busy 10"], {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    assert [(d["ok"], d.get("error")) for d in lines[2:]] == [(False, "CUDA_ERROR_MPS_CONNECTION_FAILED")] * 2


def test_busy_before_init_names_what_to_do(fake_libcuda: str) -> None:
    _, lines, _ = run(fake_libcuda, ["busy 10"])
    assert lines[1]["ok"] is False and "send init first" in lines[1]["error"]


@pytest.mark.parametrize(
    ("fail", "command", "error", "call"),
    [
        pytest.param("cuInit=100", "init", "CUDA_ERROR_NO_DEVICE", "cuInit", id="no-device"),
        pytest.param("cuDevicePrimaryCtxRetain=2", "init", "CUDA_ERROR_OUT_OF_MEMORY", "cuDevicePrimaryCtxRetain",
                     id="no-memory-for-a-context"),
        pytest.param("cuModuleLoadData=218", "busy 10", "CUDA_ERROR_INVALID_PTX", "cuModuleLoadData",
                     id="ptx-refused"),
        pytest.param("cuLaunchKernel=9999", "busy 10", "CUDA_ERROR_9999", "cuLaunchKernel",
                     id="an-error-the-driver-cannot-name"),
    ],
)
def test_a_driver_error_is_named_with_its_call(fake_libcuda: str, fail: str, command: str, error: str,
                                               call: str) -> None:
    code, lines, _ = run(fake_libcuda, ["init", command] if command != "init" else ["init"],
                         {"FAKE_CUDA_FAIL": fail})
    assert code == 0
    assert {k: lines[-1][k] for k in ("ok", "error", "call")} == {"ok": False, "error": error, "call": call}


def test_a_hanging_driver_call_ends_at_max_seconds(fake_libcuda: str) -> None:
    code, lines, _ = run(fake_libcuda, ["init", "busy 10"], {"FAKE_CUDA_HANG": "cuLaunchKernel"},
                         "--max-seconds", "1")
    assert code == cuda_client.EXIT_TIMEOUT
    assert lines[-1] == {"ok": False, "error": "ran past --max-seconds 1"}


def test_a_library_that_is_not_libcuda_is_refused(tmp_path: Path) -> None:
    code, lines, _ = run("libc.so.6", ["init"])
    assert code == cuda_client.EXIT_NO_LIBCUDA
    assert lines[0]["ok"] is False and "cuInit" in lines[0]["error"]
    code, lines, _ = run(str(tmp_path / "nowhere.so"), ["init"])
    assert code == cuda_client.EXIT_NO_LIBCUDA and "cannot load" in lines[0]["error"]


@pytest.mark.parametrize("args", [["--max-seconds", "0"], ["--max-seconds", "soon"], ["--frobnicate"]],
                         ids=["zero-seconds", "not-a-number", "unknown-flag"])
def test_bad_arguments_exit_2(fake_libcuda: str, args: list[str]) -> None:
    code, lines, err = run(fake_libcuda, [], None, *args)
    assert code == cuda_client.EXIT_USAGE and lines == [] and "usage:" in err


def test_end_of_input_is_exit(fake_libcuda: str) -> None:
    code, lines, _ = run(fake_libcuda, ["init", "alloc 8"])
    assert code == 0 and [line["op"] for line in lines] == ["load", "init", "alloc"]


def test_commands_from_the_argument_as_a_container_runs_it(fake_libcuda: str, tmp_path: Path) -> None:
    # A container's client has no one on its stdin: its script is its argument, its answers its log.
    code, lines, _ = run(fake_libcuda, [], {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path), "NVIDIA_VISIBLE_DEVICES": "GPU-1",
                                            "CUDA_VISIBLE_DEVICES": "GPU-1", "OTHER": "x"},
                         "--commands", "devices; init ;sleep 20; alloc 64;", "--max-seconds", "20")
    assert code == 0
    load, devices, init, slept, alloc = lines
    assert load["ok"] and init["ok"] and alloc["bytes"] == 64 << 20
    assert slept == {"op": "sleep", "ok": True}
    assert devices["env"] == {"NVIDIA_VISIBLE_DEVICES": "GPU-1", "CUDA_VISIBLE_DEVICES": "GPU-1"}
    assert all(node.startswith("/dev/nvidia") for node in devices["nodes"])


def test_a_bad_scripted_command_is_answered_and_the_rest_still_run(fake_libcuda: str, tmp_path: Path) -> None:
    code, lines, _ = run(fake_libcuda, [], {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)},
                         "--commands", "sleep soon; init")
    assert code == 0
    assert lines[1] == {"op": "sleep", "ok": False, "error": "sleep MS must be a whole number, got 'soon'"}
    assert lines[2]["op"] == "init" and lines[2]["ok"] is True
