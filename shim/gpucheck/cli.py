"""``weft gpu-check [--json] [--broker-socket PATH] [--skip-live]``: the command line around the checks.

``shim/cli.py`` wires this in with :func:`add_parser`, and runs :func:`main`
before building its own parser, so that a node without a driver gets its
answer in a fraction of a second. Exit codes (documented in docs/gpu.md):

    0  nothing failed (there may be warnings)
    1  a check failed
    2  bad usage
    3  no NVIDIA driver on this machine (NVML's library is missing or the kernel module is not loaded)

With ``--json`` the last line of stdout is one JSON object: ``checks`` (each
``name``, ``result`` ok|warn|fail, ``detail``) and ``verdict``.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from shim.gpucheck.report import Check, Result, fail, json_line, table, verdict

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_DRIVER = 0, 1, 2, 3


@dataclass(frozen=True)
class Environment:
    """Where gpu-check looks; the defaults are a real node's. Tests hand it stand-ins."""

    nvml_library: Any = None  # None: pynvml
    mps_binary: str = "nvidia-cuda-mps-control"
    kubelet_dir: Path = Path("/var/lib/kubelet")
    mps_private_shm: bool = True
    live: Any = None  # shim.gpucheck.live.LiveSettings; None: its defaults
    host_root: Path = Path("/")  # where containerd's and NVIDIA's runtime's files are
    out: Any = field(default=None, repr=False)  # a text stream; None: sys.stdout


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "gpu-check", help="can this node enforce GPU leases: driver, MPS, device plugin, and a live test",
        description="Check this node's GPUs for weft: NVML inventory, CUDA MPS, what the GPU device plugin "
        "advertises, and (unless --skip-live) a live enforcement test through the broker. Reads device settings, "
        "never changes them. Exit 0: nothing failed; 1: a check failed; 2: bad usage; 3: no NVIDIA driver.")
    p.add_argument("--json", action="store_true", help="end with one JSON line: checks and verdict")
    p.add_argument("--broker-socket", type=Path, help="the broker to test through (default: /run/weft/broker.sock "
                   "if it answers, else a private broker for the test)")
    p.add_argument("--skip-live", action="store_true", help="only read: no leases, no CUDA clients")
    p.set_defaults(fn=lambda args: run(args.json, args.broker_socket, args.skip_live))
    return p


def main(argv: list[str]) -> int:
    """``weft gpu-check ...`` without the rest of weft's command line (it is what a driverless node waits for)."""
    p = argparse.ArgumentParser(prog="weft")
    add_parser(p.add_subparsers(dest="command", required=True))
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    from shim import log

    log.configure("warning")  # stderr: stdout is the table, or the JSON line
    return args.fn(args)


def run(as_json: bool, broker_socket: Path | None, skip_live: bool, env: Environment | None = None) -> int:
    env = env or Environment()
    out = env.out or sys.stdout
    checks, extra = gather(env, broker_socket, skip_live)
    no_driver = bool(checks) and checks[0].name == "nvml" and extra.get("no_driver")
    code = EXIT_NO_DRIVER if no_driver else EXIT_FAILED if verdict(checks) is Result.FAIL else EXIT_OK
    if as_json:
        out.write(json_line(checks, exit_code=code, **{k: v for k, v in extra.items() if k != "no_driver"}) + "\n")
    else:
        out.write(table(checks) + "\n")
    out.flush()
    return code


def gather(env: Environment, broker_socket: Path | None, skip_live: bool) -> tuple[list[Check], dict]:
    """Every check, in order; the NVML failure that makes the rest pointless ends it early."""
    from shim.broker.nvml import NvmlBackend, NvmlError, NvmlUnavailable

    try:
        backend = NvmlBackend(library=env.nvml_library)
    except NvmlUnavailable as exc:
        return [fail("nvml", f"no NVIDIA driver: {exc}. Nothing to check on this machine")], {"no_driver": True}
    except NvmlError as exc:
        return [fail("nvml", f"the NVIDIA driver answered an error: {exc}. Change: check the driver "
                             "(nvidia-smi; a driver/library version mismatch needs a reboot or module reload)")], {}
    try:
        inv = backend.inventory()
    except NvmlError as exc:
        return [fail("nvml", f"the NVIDIA driver answered an error: {exc}. Change: check the GPU and driver "
                             "(nvidia-smi -q)")], {}
    finally:
        backend.close()
    from shim.gpucheck import deviceplugin, inventory, mpscheck

    checks = inventory.checks(inv)
    # What the broker leases: GPUs without MIG on, and the instances of those with it.
    shareable = [d.device.uuid for d in inv.devices if not d.device.mig_enabled] + [
        i.instance.device.uuid for d in inv.devices for i in d.instances]
    first = shareable[0] if shareable else (inv.devices[0].device.uuid if inv.devices else None)
    # The broker runs its daemons with a private /dev/shm; that takes root (a mount namespace), as the broker has.
    checks += mpscheck.checks(env.mps_binary, first, private_shm=env.mps_private_shm and os.geteuid() == 0)
    checks += deviceplugin.checks(env.kubelet_dir, len(inv.devices), sum(len(d.instances) for d in inv.devices))
    from shim.gpucheck import runtime

    runtime_checks, runtime_extra = runtime.checks(env.host_root)
    checks += runtime_checks
    # New fields are added beside the old ones, never renamed: outside checks read this line.
    extra = {"driver_version": inv.driver_version, "cuda_driver_version": inv.cuda_driver_version,
             "devices": [{"index": d.device.index, "uuid": d.device.uuid, "name": d.device.name,
                          "memory_total": d.device.memory_total, "memory_used": d.memory_used,
                          "mig": d.device.mig_enabled, "mig_pending": d.mig_pending, "compute_mode": d.compute_mode,
                          "compute_capability": list(d.compute_capability),
                          "mig_instances": [{"uuid": i.instance.device.uuid, "name": i.instance.device.name,
                                             "memory_total": i.instance.device.memory_total,
                                             "memory_used": i.memory_used,
                                             "gpu_instance_id": i.instance.gpu_instance_id,
                                             "compute_instance_id": i.instance.compute_instance_id,
                                             "multiprocessors": i.instance.multiprocessors} for i in d.instances]}
                         for d in inv.devices], **runtime_extra}
    blocking = [c for c in checks if c.result is Result.FAIL and c.name in ("devices", "mps-control",
                                                                              "compute-mode", "cuda-driver")]
    if skip_live:
        return checks, extra
    if blocking:
        checks.append(fail("live", "not run: " + ", ".join(c.name for c in blocking) + " failed above"))
        return checks, extra
    from shim.gpucheck import live

    settings = env.live or live.LiveSettings()
    settings = replace(settings, broker_socket=broker_socket or settings.broker_socket, mps_binary=env.mps_binary,
                       nvml_library=env.nvml_library if settings.nvml_library is None else settings.nvml_library,
                       free_bytes={**{d.device.uuid: d.device.memory_total - d.memory_used for d in inv.devices},
                                   **{i.instance.device.uuid: i.instance.device.memory_total - i.memory_used
                                      for d in inv.devices for i in d.instances}})
    checks += live.run(settings)
    return checks, extra
