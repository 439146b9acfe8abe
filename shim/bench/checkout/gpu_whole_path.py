"""A GPU pod's whole path: containerd, the ``weft`` handler, the OCI hook, CDI and the broker, two pods on one GPU.

What a user runs, driven through the agent's CRI socket as kubelet would drive it: an opted-in pod whose GPU
container asks for a 25 % memory and 25 % compute share, beside a second one at 50 % on the same GPU (a device
plugin with shared replicas gave both the same device by its CDI name), and a plain pod asking for the whole GPU
through CDI. Each container runs weft's CUDA client (``shim/gpucheck/cuda_client.py``: the driver API through
ctypes, a PTX kernel) from an image built here, offline, from this machine's Python; the client's answers are
its log. Then the faults: the driver's CDI spec gone when a container is made, and an MPS daemon killed under a
running pod. Last, on a containerd of its own, the node as the GPU Operator's toolkit leaves it: NVIDIA's runtime
(``nvidia-container-runtime`` in CDI mode, injecting from the same CDI spec) the default and run by the ``weft``
handler too, and an image whose config sets ``NVIDIA_VISIBLE_DEVICES=all``, as CUDA images do: a container of an
opted-in pod that holds no lease sees no GPU, a leased one exactly its lease, a plain pod every GPU (the control).

Everything is real but the GPU's side, which ``GpuSide`` stands for: on a GPU node (``scripts/gpu-proof.sh
--whole-path``) NVML, the NVIDIA driver's MPS control and ``libcuda``, and the CDI spec ``nvidia-ctk cdi
generate`` writes; in the integration test, the fakes the broker's and gpu-check's tests use.

    python -m bench.gpu_whole_path --out DIR [--starts 3] [--nvidia-ctk PATH] [--cdi-hook PATH] [--mps-control PATH]
                                   [--nvidia-runtime PATH]

writes DIR/whole-path.json (every check with its detail, the figures) and DIR/summary.txt; exit 0 when every
check passed, 1 when one failed, 2 when it could not start.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from shim.broker.mps import MpsSupervisor
from shim.gpucheck import cuda_client
from shim.localfabric import images, pods
from shim.localfabric.agent import AgentProcess
from shim.localfabric.broker import weft_handler
from shim.localfabric.containerd import Containerd, RuntimeHandler

CLIENT_IMAGE = "docker.io/library/weft-cuda-client:whole-path"
CLIENT_IN_IMAGE = "/weft/cuda_client.py"
# The same client in an image whose config asks for every GPU, as CUDA base images do (NVIDIA's runtime reads it).
CUDA_LIKE_IMAGE = "docker.io/library/weft-cuda-client:visible-all"
# Where that image's containers find a libcuda of their own, as a CUDA image carries one (its forward-compatibility
# copy): the driver's, bound in by the proof, so the client can try the GPU where the runtime gave no driver.
OWN_LIBCUDA = "/usr/local/cuda/compat/libcuda.so.1"
# Run before the client: what the runtime put into the container (the GPU nodes under /dev; whether the driver's
# libcuda is where the CDI spec mounts it), then the client on that libcuda, or on the image's own where it is not.
PROBE = (
    "import json, os, sys\n"
    "injected, own = sys.argv[1:3]\n"
    "nodes = sorted('/dev/' + n for n in os.listdir('/dev') if n.startswith('nvidia'))\n"
    "lib = injected if os.path.exists(injected) else own\n"
    "print(json.dumps({'op': 'driver', 'injected': lib == injected, 'libcuda': lib, 'nodes': nodes}), flush=True)\n"
    f"sys.path.insert(0, {os.path.dirname(CLIENT_IN_IMAGE)!r})\n"
    "import cuda_client\n"
    "sys.exit(cuda_client.main(['--libcuda', lib, *sys.argv[3:]]))\n"
)
# How long the two shared pods hold before allocating, so both are running when their leases are read.
HOLD_MS = 3000
MIB = 1 << 20


def client_answers(log: Path) -> list[dict]:
    """The CUDA client's answers in a container's CRI log (one JSON object per stdout line)."""
    out = []
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            parts = line.split(" ", 3)  # CRI log lines: time, stream, tag, text
            if len(parts) == 4 and parts[1] == "stdout":
                with contextlib.suppress(ValueError):
                    out.append(json.loads(parts[3]))
    return out


@dataclass
class GpuSide:
    """What stands for the GPU: NVML (a broker backend), the MPS control binary, and the driver's CDI spec."""

    backend: Any
    mps_binary: str
    # Writes the driver's CDI spec into containerd's spec directory; returns the spec's path.
    write_cdi: Callable[[Path], Path]
    # Writes a spec of the proof's own where write_cdi fails (the rest of the path is still worth seeing).
    fallback_cdi: Callable[[Path], Path] | None = None
    client_env: dict[str, str] = field(default_factory=dict)
    # The fake libcuda finds its MPS server by the host's PID: its pods share the host's PID namespace.
    host_pid: bool = False
    python: str = sys.executable  # whose interpreter and standard library the client's image carries
    # NVIDIA's runtime (the toolkit's ``nvidia-container-runtime``) for the node as the GPU Operator leaves it.
    nvidia_runtime: str = "nvidia-container-runtime"
    # Whether libcuda is the driver's, which reaches a GPU only through its /dev/nvidia* nodes; the fake libcuda
    # answers without them, so there a container without GPU nodes cannot show that CUDA finds no device.
    real_driver: bool = True


def libcuda_in(spec: dict) -> str:
    """Where the CDI spec's edits put ``libcuda.so.1`` in the container (the client loads it from there)."""
    edits = [spec.get("containerEdits") or {}, *((d.get("containerEdits") or {}) for d in spec.get("devices", []))]
    for edit in edits:
        for mount in edit.get("mounts") or []:
            path = str(mount.get("containerPath", ""))
            if os.path.basename(path).startswith("libcuda.so"):
                return str(Path(path).with_name("libcuda.so.1")) if path.endswith(".so.1") else path
    raise ValueError("the CDI spec mounts no libcuda.so into the container")


def libcuda_on_host(spec: dict) -> str:
    """The host's file the CDI spec mounts as ``libcuda.so`` (bound into a container that brings its own)."""
    edits = [spec.get("containerEdits") or {}, *((d.get("containerEdits") or {}) for d in spec.get("devices", []))]
    for edit in edits:
        for mount in edit.get("mounts") or []:
            if os.path.basename(str(mount.get("containerPath", ""))).startswith("libcuda.so"):
                return str(mount.get("hostPath") or mount["containerPath"])
    raise ValueError("the CDI spec mounts no libcuda.so into the container")


def nvidia_toolkit_config(directory: Path, runtime: str, spec_dir: Path, runc: str) -> Path:
    """NVIDIA's runtime as the GPU Operator's toolkit lays it out, in CDI mode: a config file, and a wrapper (to
    name as containerd's ``BinaryName``) that gives the runtime that file (``NVIDIA_CTK_CONFIG_FILE_PATH`` from
    v1.18, ``XDG_CONFIG_HOME`` before). Returns the wrapper; the runtime's debug log is beside it."""
    config_dir = directory / "config"
    config = config_dir / "nvidia-container-runtime" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(f"""accept-nvidia-visible-devices-envvar-when-unprivileged = true
accept-nvidia-visible-devices-as-volume-mounts = false

[nvidia-container-runtime]
mode = "cdi"
runtimes = ["{runc}"]
log-level = "debug"
debug = "{directory / 'nvidia-container-runtime.log'}"

[nvidia-container-runtime.modes.cdi]
default-kind = "nvidia.com/gpu"
spec-dirs = ["{spec_dir}"]
""")
    wrapper = directory / "nvidia-container-runtime"
    wrapper.write_text(f'#!/bin/sh\nNVIDIA_CTK_CONFIG_FILE_PATH={config} XDG_CONFIG_HOME={config_dir} '
                       f'exec {runtime} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def nvidia_ctk_cdi(nvidia_ctk: str, cdi_hook: str, log: Path) -> Callable[[Path], Path]:
    """The driver's CDI spec as a GPU node's is made: ``nvidia-ctk cdi generate``, by index and by UUID."""

    def write(directory: Path) -> Path:
        out = directory / "nvidia.json"
        res = subprocess.run([nvidia_ctk, "cdi", "generate", "--format", "json", f"--output={out}",
                              f"--nvidia-cdi-hook-path={cdi_hook}", "--device-name-strategy", "index",
                              "--device-name-strategy", "uuid"], capture_output=True, text=True, timeout=120)
        log.write_text(res.stdout + res.stderr)
        if res.returncode != 0 or not out.is_file():
            raise RuntimeError(f"nvidia-ctk cdi generate failed ({res.returncode}): {res.stderr.strip()[-1500:]}")
        return out

    return write


# The driver's user-space libraries a CUDA program loads (libcuda opens the others by their sonames).
DRIVER_LIBRARIES = ("libcuda.so", "libnvidia-ptxjitcompiler.so", "libnvidia-ml.so", "libnvidia-nvvm.so",
                    "libnvidia-gpucomp.so")


def loaded_library(soname: str) -> Path:
    """Where this process's loader finds ``soname`` (it is loaded, and its path read from /proc/self/maps)."""
    import ctypes

    ctypes.CDLL(soname)
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if os.path.basename(path).startswith(soname.split(".so")[0] + ".so"):
            return Path(path)
    raise OSError(f"{soname} is loaded but not in /proc/self/maps")


def own_cdi(devices: list, libcuda: Path) -> Callable[[Path], Path]:
    """A CDI spec as the toolkit's would say it, made from NVML's devices and the directory libcuda is in: each
    GPU by index and UUID with its device node, the control nodes, the driver's libraries mounted where they are,
    and that directory on the loader's path (no hook runs ldconfig)."""

    def write(directory: Path) -> Path:
        def node(minor: int) -> dict:
            return {"path": f"/dev/nvidia{minor}"}

        gpus = [d for d in devices if d.minor is not None and not d.mig_enabled and not getattr(d, "parent_uuid", None)]
        entries = [{"name": name, "containerEdits": {"deviceNodes": [node(d.minor)]}}
                   for d in gpus for name in (str(d.index), d.uuid)]
        entries.append({"name": "all", "containerEdits": {"deviceNodes": [node(d.minor) for d in gpus]}})
        libs = sorted(str(p) for p in libcuda.parent.iterdir() if p.name.startswith(DRIVER_LIBRARIES))
        control = [{"path": p} for p in ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
                   if os.path.exists(p)]
        spec = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": entries, "containerEdits": {
            "deviceNodes": control, "env": [f"LD_LIBRARY_PATH={libcuda.parent}"],
            "mounts": [{"hostPath": p, "containerPath": p, "options": ["ro", "nosuid", "nodev", "bind"]}
                       for p in libs]}}
        path = directory / "weft-proof-nvidia.json"
        path.write_text(json.dumps(spec))
        return path

    return write


class Failed(Exception):
    """A step could not go on (its check is recorded as failed)."""


def mps_processes(mps_dir: Path, mps: MpsSupervisor) -> list[int]:
    """PIDs of the MPS control daemons and servers under ``mps_dir`` (by their pipe directory), less the idle
    daemons the broker's pool started ahead for leases to come (they serve none yet)."""
    needle = f"CUDA_MPS_PIPE_DIRECTORY={mps_dir}".encode()
    idle = [f"CUDA_MPS_PIPE_DIRECTORY={d.pipe_dir}\0".encode() for d in mps.idle()]
    found = []
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            env = pid_dir.joinpath("environ").read_bytes() + b"\0"
            if needle in env and b"mps" in (pid_dir / "cmdline").read_bytes() and not any(i in env for i in idle):
                found.append(int(pid_dir.name))
    return found


class WholePath:
    def __init__(self, gpu: GpuSide, work: Path, *, starts: int = 3, step_timeout: float = 120.0) -> None:
        self.gpu, self.work, self.starts, self.step_timeout = gpu, work, starts, step_timeout
        self.checks: list[dict] = []
        self.figures: dict[str, Any] = {}

    # -- recording -----------------------------------------------------------
    def check(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append({"name": name, "result": "ok" if ok else "fail", "detail": detail})
        return ok

    def document(self) -> dict:
        proven = bool(self.checks) and all(c["result"] == "ok" for c in self.checks)
        return {"verdict": "proven" if proven else "not proven", "checks": self.checks, "figures": self.figures}

    # -- the run -------------------------------------------------------------
    def run(self) -> dict:
        from shim.brokerd import Broker, BrokerConfig

        devices = [d for d in self.gpu.backend.devices() if not d.mig_enabled]
        if not devices:
            self.check("device", False, "no GPU outside MIG to run on")
            return self.document()
        self.device = devices[0]
        self.figures["device"] = {"index": self.device.index, "uuid": self.device.uuid, "name": self.device.name,
                                  "memory_mib": self.device.memory_total // MIB}
        cfg = BrokerConfig(socket=self.work / "broker" / "broker.sock", state_dir=self.work / "broker" / "state",
                           backend="nvml", enforce="kill", watchdog_interval=0.5, mps_dir=self.work / "broker" / "mps")
        assert cfg.mps_dir is not None
        self.mps_dir = cfg.mps_dir
        # As the installed broker runs it: with its pool of daemons started ahead.
        self.mps = MpsSupervisor(cfg.mps_dir, self.gpu.mps_binary, private_shm=True, pool=cfg.mps_pool)
        with contextlib.ExitStack() as stack:
            self.broker = Broker(cfg, backend=self.gpu.backend, mps=self.mps).start()
            stack.callback(self.broker.stop)
            with contextlib.ExitStack() as node:
                self.ctrd = node.enter_context(Containerd(handlers=[weft_handler(self.work, cfg.socket)], line="2"))
                self.spec_path, self.libcuda = self._cdi_spec()
                self.spec_text = self.spec_path.read_text()
                self.client_layer = images.python_layer(self.gpu.python, {
                    CLIENT_IN_IMAGE.lstrip("/"): Path(cuda_client.__file__).read_bytes()}, libraries_of=[self.libcuda])
                archive = images.build_archive(images.ImageSpec(CLIENT_IMAGE, ("python3",)),
                                               self.work / "client-image.tar", extra_layers=(self.client_layer,))
                self.ctrd.import_image(archive, CLIENT_IMAGE)
                self._open_node(node, self.work / "agent")
                for step in (self.plain_whole_gpu, self.two_shares, self.released, self.start_times,
                             self.cdi_missing, self.mps_killed, self.nothing_left):
                    self._step(step)
            # After the first node is gone (its agent and containerd with it): a node of its own, NVIDIA's runtime
            # the default, on the same broker.
            try:
                self.nvidia_runtime()
            except (Failed, grpc.RpcError, RuntimeError, ValueError, KeyError, OSError,
                    subprocess.SubprocessError) as exc:
                self.check("nvidia-runtime", False, f"stopped: {_reason(exc)}")
        # The broker stopped: the daemons its pool started ahead went with it.
        left = self._wait_no_mps()
        self.check("pool-stopped", not left, f"MPS processes left after the broker stopped: {left}")
        return self.document()

    def _open_node(self, stack: contextlib.ExitStack, agent_dir: Path) -> None:
        """The agent on ``self.ctrd``, and the CRI clients the steps use: through it, and to containerd alone."""
        self.agent = stack.enter_context(AgentProcess(self.ctrd, agent_dir,
                                                      extra_args=["--broker-socket", str(self.broker.cfg.socket)]))
        self.rt = cri_grpc.RuntimeServiceStub(stack.enter_context(grpc.insecure_channel(self.agent.address)))
        self.direct = cri_grpc.RuntimeServiceStub(stack.enter_context(self.ctrd.channel()))

    def _step(self, step: Callable[[], None], name: str = "") -> None:
        """Run a step; one that cannot go on is recorded as its failed check, and what it left is removed."""
        try:
            step()
        except (Failed, grpc.RpcError, RuntimeError, ValueError, KeyError) as exc:
            self.check(name or step.__name__.replace("_", "-"), False, f"stopped: {_reason(exc)}")
            self._remove_all()

    def _cdi_spec(self) -> tuple[Path, str]:
        """The driver's CDI spec and where it puts libcuda in a container. Where the toolkit cannot write one
        (it finds the driver's libraries through the loader's cache and standard directories only), the proof
        goes on with one of its own from NVML and the libcuda this machine loads, and says so."""
        try:
            path = self.gpu.write_cdi(self.ctrd.cdi_spec_dir)
            where = libcuda_in(json.loads(path.read_text()))
        except (RuntimeError, ValueError, OSError) as exc:
            if self.gpu.fallback_cdi is None:
                raise
            self.check("cdi.spec", False, f"{_reason(exc)}; the rest runs on a spec of the proof's own")
            path = self.gpu.fallback_cdi(self.ctrd.cdi_spec_dir)
            return path, libcuda_in(json.loads(path.read_text()))
        self.check("cdi.spec", True, f"{path.name}: libcuda at {where} in a container")
        return path, where

    # -- pods ----------------------------------------------------------------
    def _pod(self, name: str, *, weft: bool, share: int | None = None,
             rt: cri_grpc.RuntimeServiceStub | None = None) -> tuple[str, cri.PodSandboxConfig]:
        annotations = {}
        if share is not None:
            annotations = {"weft.io/gpu-memory.cuda": f"{self.share_mib(share)}Mi",
                           "weft.io/gpu-compute.cuda": str(share)}
        # The node's network: nothing here needs a pod network, and a GPU node need not have CNI plugins.
        cfg = pods.sandbox_config(name, self.ctrd.pod_log_dir, cgroup_parent=self.ctrd.cgroup_root,
                                  annotations=annotations, host_network=True, host_pid=self.gpu.host_pid)
        sb = (rt or self.rt).RunPodSandbox(cri.RunPodSandboxRequest(config=cfg, runtime_handler="weft" if weft else ""),
                                           timeout=self.step_timeout).pod_sandbox_id
        return sb, cfg

    def _client(self, sb: str, cfg: cri.PodSandboxConfig, script: str, cdi: str,
                rt: cri_grpc.RuntimeServiceStub | None = None) -> tuple[str, float]:
        """Create and start the CUDA client's container; its id and the seconds create and start took."""
        rt = rt or self.rt
        ccfg = pods.container_config("cuda", ["python3", "-I", "-S", CLIENT_IN_IMAGE, "--libcuda", self.libcuda,
                                              "--max-seconds", str(int(self.step_timeout)), "--commands", script],
                                     image=CLIENT_IMAGE, envs=self.gpu.client_env, host_network=True,
                                     host_pid=self.gpu.host_pid)
        ccfg.linux.resources.memory_limit_in_bytes = 4 << 30  # libcuda maps far more than a shell's 64 MiB
        ccfg.CDI_devices.add(name=cdi)
        started = time.monotonic()
        cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sb, config=ccfg, sandbox_config=cfg),
                                 timeout=self.step_timeout).container_id
        rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=self.step_timeout)
        return cid, time.monotonic() - started

    def _exited(self, cid: str, rt: cri_grpc.RuntimeServiceStub | None = None) -> tuple[int, list[dict]]:
        """Wait for the container to exit: its exit code and the client's answers (its log)."""
        rt = rt or self.rt
        deadline = time.monotonic() + self.step_timeout
        while True:
            status = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid), timeout=30).status
            if status.state == cri.CONTAINER_EXITED:
                return status.exit_code, client_answers(Path(status.log_path))
            if time.monotonic() > deadline:
                raise Failed(f"container {cid[:12]} still runs after {self.step_timeout:.0f} s")
            time.sleep(0.2)

    def _log_tail(self, cid: str, chars: int = 1500) -> str:
        """The end of a container's log (its stderr too): why a client that said nothing ended."""
        with contextlib.suppress(Exception):
            status = self.rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid), timeout=30).status
            return Path(status.log_path).read_text(errors="replace")[-chars:]
        return ""

    def _wait_answer(self, cid: str, op: str, count: int = 1) -> None:
        deadline = time.monotonic() + self.step_timeout
        while time.monotonic() < deadline:
            status = self.rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid), timeout=30).status
            if sum(a.get("op") == op for a in client_answers(Path(status.log_path))) >= count:
                return
            if status.state == cri.CONTAINER_EXITED:
                break
            time.sleep(0.1)
        raise Failed(f"container {cid[:12]} did not answer {op!r}")

    def _remove(self, sb: str, rt: cri_grpc.RuntimeServiceStub | None = None) -> None:
        rt = rt or self.rt
        rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sb), timeout=self.step_timeout)
        rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sb), timeout=self.step_timeout)

    def _remove_all(self) -> None:
        with contextlib.suppress(grpc.RpcError):
            for sb in self.direct.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=30).items:
                with contextlib.suppress(grpc.RpcError):
                    self._remove(sb.id)

    def share_mib(self, percent: int) -> int:
        return self.device.memory_total * percent // 100 // MIB

    def leases(self) -> list:
        from shim._pb import broker_pb2 as pb
        from shim._pb import broker_pb2_grpc as pb_grpc

        with grpc.insecure_channel(f"unix://{self.broker.cfg.socket}") as ch:
            return list(pb_grpc.BrokerStub(ch).List(pb.ListRequest(), timeout=10).leases)

    def _wait_no_leases(self, timeout: float = 30.0) -> tuple[float, list]:
        started = time.monotonic()
        while (left := self.leases()) and time.monotonic() - started < timeout:
            time.sleep(0.05)
        return time.monotonic() - started, left

    def _wait_no_mps(self, timeout: float = 10.0) -> list[int]:
        """The run's MPS processes still there after waiting up to ``timeout`` for them to go."""
        deadline = time.monotonic() + timeout
        while (mps := self.mps_processes()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return mps

    def mps_processes(self) -> list[int]:
        """PIDs of MPS control daemons and servers of this run's leases (by their pipe directory)."""
        return mps_processes(self.mps_dir, self.mps)

    def own_device_node(self, nodes: list[str]) -> bool:
        """Whether the GPU nodes a container sees are its leased device's alone (control nodes aside)."""
        gpus = {n for n in nodes if n.removeprefix("/dev/nvidia").isdigit()}
        return gpus == {f"/dev/nvidia{self.device.index}"} or (not gpus and self.device.minor is None)

    # -- the steps -----------------------------------------------------------
    def plain_whole_gpu(self) -> None:
        """A plain pod asking for the whole GPU through CDI gets it, as without weft, and no lease."""
        sb, cfg = self._pod("plain-gpu", weft=False)
        big = self.device.memory_total * 6 // 10 // MIB
        cid, _ = self._client(sb, cfg, f"devices; init; alloc {big}; busy 500; exit", "nvidia.com/gpu=all")
        leased = [lease for lease in self.leases() if lease.container_id == cid]
        code, answers = self._exited(cid)
        by_op = _by_op(answers)
        init, alloc, busy = by_op.get("init", {}), (by_op["alloc"] or [{}])[0], (by_op["busy"] or [{}])[0]
        self.sms_all = int(init.get("sms") or 0)
        self.figures["plain"] = {"sms": self.sms_all, "total_mib": int(init.get("total_bytes", 0)) // MIB,
                                 "alloc_mib": big, "alloc": alloc.get("ok"), "sms_used": busy.get("sms_used")}
        self.check("plain.whole-gpu", code == 0 and alloc.get("ok") is True and not leased and self.sms_all > 0
                   and busy.get("sms_used") == self.sms_all,
                   ("" if init else f"the client said nothing; its log ends: {self._log_tail(cid)!r}; ")
                   + f"exit {code}; saw {init.get('total_bytes', 0) // MIB} MiB and {self.sms_all} SMs, allocated "
                   f"{big} MiB ({alloc.get('error', 'ok') if alloc else 'no answer'}), its kernel ran on "
                   f"{busy.get('sms_used')} SMs; leases taken: {len(leased)}; devices {by_op.get('devices', {})}")
        self._remove(sb)

    def two_shares(self) -> None:
        """Two opted-in pods share the GPU at 25 % and 50 %: each sees its device, is held to its share."""
        if not getattr(self, "sms_all", 0):
            raise Failed("the plain pod did not say how many SMs the GPU has")
        runs: dict[int, tuple[str, str]] = {}
        for share in (25, 50):
            mib = self.share_mib(share)
            script = (f"devices; init; sleep {HOLD_MS}; alloc {mib // 2}; alloc {mib * 3 // 4}; "
                      f"busy 1000 {self.sms_all}; exit")
            sb, cfg = self._pod(f"share-{share}", weft=True, share=share)
            cid, _seconds = self._client(sb, cfg, script, f"nvidia.com/gpu={self.device.index}")
            runs[share] = (sb, cid)
        leases = {lease.container_id: lease for lease in self.leases()}
        held = [leases.get(cid) for _, cid in runs.values()]
        self.check("shares.leases", all(h is not None and h.state == "bound" and h.shared and
                                        list(h.device_uuids) == [self.device.uuid] for h in held),
                   "; ".join(f"{share} %: " + (f"{h.lease_id} {h.state} on {','.join(h.device_uuids)}, "
                                               f"{h.memory_bytes // MIB} MiB, {h.compute_percent} %" if h else "none")
                             for share, h in zip(runs, held, strict=True)))
        self.figures["shares"] = {}
        for share, (_sb, cid) in runs.items():
            code, answers = self._exited(cid)
            by_op = _by_op(answers)
            devices, init = by_op.get("devices", {}), by_op.get("init", {})
            allocs = by_op.get("alloc", [])
            busy = (by_op.get("busy") or [{}])[0]
            within, beyond = ([*allocs, {}, {}])[:2]
            lease = leases.get(cid)
            uuid = lease.device_uuids[0] if lease and lease.device_uuids else ""
            want_sms = self.sms_all * share // 100
            sms_used = int(busy.get("sms_used") or 0)
            self.figures["shares"][str(share)] = {
                "limit_mib": self.share_mib(share), "sms_seen": init.get("sms"), "sms_used": sms_used,
                "sms_all": self.sms_all, "within_mib": self.share_mib(share) // 2, "within": within.get("ok"),
                "beyond_mib": self.share_mib(share) * 3 // 4, "beyond": beyond.get("error", beyond.get("ok"))}
            # The lease's GPU by its UUID: in CUDA_VISIBLE_DEVICES, which the broker sets, or NVIDIA_VISIBLE_DEVICES
            # where the CDI spec does not set that to "void" (nvidia-ctk's does, so no runtime hook adds devices).
            env = devices.get("env", {})
            visible = env.get("CUDA_VISIBLE_DEVICES") or env.get("NVIDIA_VISIBLE_DEVICES")
            self.check(f"share-{share}.device", visible == uuid != ""
                       and env.get("NVIDIA_VISIBLE_DEVICES") in (uuid, "void")
                       and self.own_device_node(devices.get("nodes", [])),
                       f"visible devices {devices.get('env')}, device nodes {devices.get('nodes')}; leased {uuid}")
            self.check(f"share-{share}.memory", within.get("ok") is True and
                       beyond.get("error") == "CUDA_ERROR_OUT_OF_MEMORY",
                       f"allocated {self.share_mib(share) // 2} MiB of its {self.share_mib(share)} MiB "
                       f"({within.get('error', 'ok')}), refused {self.share_mib(share) * 3 // 4} MiB more "
                       f"({beyond.get('error', 'granted' if beyond.get('ok') else 'no answer')})")
            # MPS rounds a share to whole TPCs (two SMs each).
            self.check(f"share-{share}.compute", code == 0 and 0 < sms_used <= int(init.get("sms") or 0) + 1
                       and abs(sms_used - want_sms) <= 2,
                       f"exit {code}; given blocks for all {self.sms_all} SMs, its kernel ran on {sms_used} "
                       f"(it sees {init.get('sms')}; {share} % is {want_sms})")
        self.runs = runs

    def released(self) -> None:
        """Removing the pods releases their leases and stops their MPS daemons."""
        if not getattr(self, "runs", None):
            raise Failed("no shared pods ran")
        started = time.monotonic()
        for sb, _ in self.runs.values():
            self._remove(sb)
        _waited, left = self._wait_no_leases()
        release_s = time.monotonic() - started
        mps = self._wait_no_mps()
        self.figures["release_s"] = round(release_s, 3)
        self.check("released", not left and not mps,
                   f"both pods removed and their leases released in {release_s:.2f} s; leases left {len(left)}, "
                   f"MPS processes left {mps}")

    def start_times(self) -> None:
        """The opted-in GPU container's create and start through weft against a plain one's on containerd; and of
        the former, how long the broker took to have the share's MPS daemon ready with its limits."""
        weft_s, plain_s, mps_s = [], [], []
        take = self.mps.take

        def timed_take(device_uuid: str, limits: Any) -> Any:
            started = time.monotonic()
            try:
                return take(device_uuid, limits)
            finally:
                mps_s.append(time.monotonic() - started)

        for i in range(self.starts):
            sb, cfg = self._pod(f"start-weft-{i}", weft=True, share=25)
            self.mps.take = timed_take  # type: ignore[method-assign]  # this pod's lease only
            try:
                cid, seconds = self._client(sb, cfg, "devices; exit", f"nvidia.com/gpu={self.device.index}")
            finally:
                del self.mps.take
            weft_s.append(seconds)
            self._exited(cid)
            self._remove(sb)
            sb, cfg = self._pod(f"start-plain-{i}", weft=False, rt=self.direct)
            cid, seconds = self._client(sb, cfg, "devices; exit", "nvidia.com/gpu=all", rt=self.direct)
            plain_s.append(seconds)
            self._exited(cid, rt=self.direct)
            self._remove(sb, rt=self.direct)
        p50w, p50p = statistics.median(weft_s), statistics.median(plain_s)
        self.figures["start"] = {"weft_ms": [round(s * 1000, 1) for s in weft_s],
                                 "plain_ms": [round(s * 1000, 1) for s in plain_s],
                                 "weft_p50_ms": round(p50w * 1000, 1), "plain_p50_ms": round(p50p * 1000, 1),
                                 "ratio_p50": round(p50w / p50p, 2) if p50p else None,
                                 "mps_pool": self.broker.cfg.mps_pool,
                                 "weft_mps_ms": [round(s * 1000, 1) for s in mps_s]}
        self.check("start-times", True, f"create and start, median of {self.starts}: {p50w * 1000:.0f} ms opted in "
                   f"(25 % share, through weft; its MPS daemon ready with its limits in "
                   f"{statistics.median(mps_s) * 1000 if mps_s else 0:.0f} ms) vs {p50p * 1000:.0f} ms plain "
                   f"(whole GPU, containerd alone)")

    def cdi_missing(self) -> None:
        """The driver's CDI spec gone, or stale (written before this GPU was in the node): the container fails with
        containerd's reason naming the CDI device, and no lease stays."""
        original = self.spec_path.read_text()
        spec = json.loads(original)
        ours = {str(self.device.index), self.device.uuid}
        stale = {**spec, "devices": [d for d in spec.get("devices", []) if d.get("name") not in ours]}
        try:
            self.spec_path.unlink()
            self._create_fails("fault.cdi-missing", "no-cdi")
            self.spec_path.write_text(json.dumps(stale))
            self._create_fails("fault.cdi-stale", "stale-cdi")
        finally:
            self.spec_path.write_text(original)

    def _create_fails(self, name: str, pod: str) -> None:
        sb, cfg = self._pod(pod, weft=True, share=25)
        try:
            self._client(sb, cfg, "init; exit", f"nvidia.com/gpu={self.device.index}")
            error = ""
        except grpc.RpcError as exc:
            error = f"{exc.code().name}: {exc.details()}"
        _waited, left = self._wait_no_leases(10)
        self.check(name, "CDI" in error and not left,
                   f"CreateContainer: {error or 'succeeded'}; leases left {len(left)}")
        self._remove(sb)

    def mps_killed(self) -> None:
        """An MPS daemon killed under a running pod: its client sees CUDA errors, the lease is released when the pod
        goes, and the next pod gets a working share."""
        sb, cfg = self._pod("mps-killed", weft=True, share=25)
        cid, _ = self._client(sb, cfg, f"init; alloc 64; sleep {HOLD_MS}; alloc 64; busy 200 {self.sms_all}; exit",
                              f"nvidia.com/gpu={self.device.index}")
        self._wait_answer(cid, "alloc")
        [lease] = [lease for lease in self.leases() if lease.container_id == cid]
        daemon = next(d for d in self.mps.daemons() if d.key == lease.lease_id)
        pipe = f"CUDA_MPS_PIPE_DIRECTORY={daemon.pipe_dir}".encode()
        killed = [pid for pid in self.mps_processes() if pipe in Path(f"/proc/{pid}/environ").read_bytes()]
        for pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        code, answers = self._exited(cid)
        after = [a for a in answers if a.get("op") in ("alloc", "busy")][1:]
        # Its GPU work fails without its server (a small allocation may still be served from what the client
        # already holds: a real driver's answered, the kernel after it failed).
        kernels = [a for a in after if a.get("op") == "busy"]
        self.check("fault.mps-killed.client", bool(kernels) and all(a.get("ok") is False for a in kernels),
                   f"killed MPS processes {killed} of {lease.lease_id}; the client then answered "
                   f"{[a.get('error', 'ok') for a in after]} (exit {code})")
        self._remove(sb)
        waited, left = self._wait_no_leases()
        self.check("fault.mps-killed.released", not left, f"lease {lease.lease_id} released {waited:.2f} s after the "
                   f"pod was removed; leases left {len(left)}")
        mib = self.share_mib(25)
        sb, cfg = self._pod("after-mps-killed", weft=True, share=25)
        cid, _ = self._client(sb, cfg, f"init; alloc {mib // 2}; alloc {mib * 3 // 4}; exit",
                              f"nvidia.com/gpu={self.device.index}")
        code, answers = self._exited(cid)
        allocs = [*_by_op(answers).get("alloc", []), {}, {}]
        self.check("fault.mps-killed.next-pod", code == 0 and allocs[0].get("ok") is True
                   and allocs[1].get("error") == "CUDA_ERROR_OUT_OF_MEMORY",
                   f"the next pod allocated {mib // 2} MiB ({allocs[0].get('error', 'ok')}) and was refused "
                   f"{mib * 3 // 4} MiB more ({allocs[1].get('error', 'granted' if allocs[1].get('ok') else '?')})")
        self._remove(sb)

    def nothing_left(self, name: str = "nothing-left") -> None:
        self._remove_all()
        _waited, left = self._wait_no_leases()
        mps = self._wait_no_mps()
        containers = self.direct.ListContainers(cri.ListContainersRequest(), timeout=30).containers
        sandboxes = self.direct.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=30).items
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split()[4] for line in f if str(self.mps_dir) in line]
        self.check(name, not (left or mps or containers or sandboxes or mounts),
                   f"leases {len(left)}, MPS processes {mps}, containers {len(containers)}, "
                   f"sandboxes {len(sandboxes)}, mounts under the MPS directory {mounts}")

    # -- beside the GPU Operator: NVIDIA's runtime the default ---------------
    def nvidia_runtime(self) -> None:
        """A node as the GPU Operator's toolkit leaves it: containerd's default runtime NVIDIA's
        (``nvidia-container-runtime``, CDI mode: it injects what ``NVIDIA_VISIBLE_DEVICES`` names from the driver's
        CDI spec, no libnvidia-container), and the ``weft`` handler running it too (``weft install`` copies the
        default runtime). Every container comes from an image whose config sets ``NVIDIA_VISIBLE_DEVICES=all`` and
        that brings a libcuda of its own, asks for no CDI device, and runs the client after a look at what the
        runtime put into it."""
        runtime = shutil.which(self.gpu.nvidia_runtime)
        if runtime is None:
            raise Failed(f"no NVIDIA runtime at {self.gpu.nvidia_runtime!r} (the toolkit's nvidia-container-runtime)")
        runc = shutil.which("runc")
        if runc is None:
            raise Failed("no runc on PATH for NVIDIA's runtime to run")
        toolkit = self.work / "nvidia"
        toolkit.mkdir(parents=True, exist_ok=True)
        wrapper = toolkit / "nvidia-container-runtime"  # written once containerd has its CDI directory
        nvidia = RuntimeHandler("nvidia", binary_name=str(wrapper))
        weft = dataclasses.replace(weft_handler(toolkit, self.broker.cfg.socket), binary_name=str(wrapper))
        self.own_libcuda = libcuda_on_host(json.loads(self.spec_text))
        self.figures["nvidia_runtime"] = {}
        with contextlib.ExitStack() as node:
            self.ctrd = node.enter_context(Containerd(handlers=[nvidia, weft], default_runtime="nvidia", line="2"))
            # One spec directory for containerd and the runtime, as /var/run/cdi is on a GPU Operator's node.
            (self.ctrd.cdi_spec_dir / self.spec_path.name).write_text(self.spec_text)
            nvidia_toolkit_config(toolkit, runtime, self.ctrd.cdi_spec_dir, runc)
            archive = images.build_archive(
                images.ImageSpec(CUDA_LIKE_IMAGE, ("python3",), env=("NVIDIA_VISIBLE_DEVICES=all",)),
                self.work / "cuda-like-image.tar", extra_layers=(self.client_layer,))
            self.ctrd.import_image(archive, CUDA_LIKE_IMAGE)
            self._open_node(node, self.work / "agent-nvidia")
            for step in (self.nvidia_plain, self.nvidia_no_lease, self.nvidia_leased):
                self._step(step, step.__name__.replace("nvidia_", "nvidia-runtime.").replace("_", "-"))
            self._step(lambda: self.nothing_left("nvidia-runtime.nothing-left"), "nvidia-runtime.nothing-left")

    def _probe(self, pod: str, *, weft: bool, share: int | None = None,
               envs: dict[str, str] | None = None) -> dict[str, Any]:
        """A container of the image that asks for every GPU, its pod made through the agent: what the runtime
        put into it, what the client then saw, and the lease it held (removed once it exited)."""
        sb, cfg = self._pod(pod, weft=weft, share=share)
        argv = ["python3", "-I", "-S", "-c", PROBE, self.libcuda, OWN_LIBCUDA, "--max-seconds",
                str(int(self.step_timeout)), "--commands", "devices; init; exit"]
        ccfg = pods.container_config("cuda", argv, image=CUDA_LIKE_IMAGE, envs={**self.gpu.client_env, **(envs or {})},
                                     host_network=True, host_pid=self.gpu.host_pid)
        ccfg.linux.resources.memory_limit_in_bytes = 4 << 30
        ccfg.mounts.add(container_path=OWN_LIBCUDA, host_path=self.own_libcuda, readonly=True)
        cid = self.rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sb, config=ccfg, sandbox_config=cfg),
                                      timeout=self.step_timeout).container_id
        self.rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=self.step_timeout)
        leases = [lease for lease in self.leases() if lease.container_id == cid]
        code, answers = self._exited(cid)
        tail = "" if answers else self._log_tail(cid)
        self._remove(sb)
        by_op = _by_op(answers)
        driver, devices, init = by_op.get("driver", {}), by_op.get("devices", {}), by_op.get("init", {})
        load = by_op.get("load", {})
        seen = {"exit": code, "nodes": driver.get("nodes"), "driver_injected": driver.get("injected"),
                "libcuda": driver.get("libcuda"), "env": devices.get("env"),
                "init": (f"ok, {init.get('sms')} SMs" if init.get("ok") else init.get("error", "no answer")),
                "leases": [f"{lease.lease_id} {lease.state} on {','.join(lease.device_uuids)}" for lease in leases]}
        self.figures["nvidia_runtime"][pod] = seen
        return {**seen, "init_ok": init.get("ok"), "load": load, "lease_list": leases, "tail": tail}

    @staticmethod
    def _said(seen: dict[str, Any]) -> str:
        said = (f"exit {seen['exit']}; GPU nodes {seen['nodes']}; the driver's libcuda "
                f"{'injected' if seen['driver_injected'] else 'absent'}; visible devices {seen['env']}; "
                f"the client on {seen['libcuda']}: init {seen['init']}; leases {seen['leases'] or 'none'}")
        if seen["load"].get("ok") is False:
            said += f"; {seen['load'].get('error')}"
        if seen["tail"]:
            said += f"; the client said nothing, its log ends: {seen['tail']!r}"
        return said

    def nvidia_plain(self) -> None:
        """The control: a plain pod's container under the default runtime gets every GPU, because of the image's
        variable alone (it asks for no CDI device), and takes no lease."""
        seen = self._probe("nvidia-plain", weft=False)
        gpus = [n for n in seen["nodes"] or [] if n.removeprefix("/dev/nvidia").isdigit()]
        self.check("nvidia-runtime.plain", seen["exit"] == 0 and bool(seen["driver_injected"]) and bool(gpus)
                   and seen["init_ok"] is True and not seen["lease_list"],
                   "the runtime honours the image's NVIDIA_VISIBLE_DEVICES=all: " + self._said(seen))

    def nvidia_no_lease(self) -> None:
        """An opted-in pod's container that asks for no GPU and so holds no lease: though its image asks for every
        GPU, the runtime injects nothing (the agent set NVIDIA_VISIBLE_DEVICES=void over the image's value), so no
        GPU node and no driver; CUDA, on the libcuda the image brings, finds no device."""
        seen = self._probe("nvidia-no-lease", weft=True)
        shown = (seen["exit"] == 0 and seen["nodes"] == [] and seen["driver_injected"] is False
                 and (seen["env"] or {}).get("NVIDIA_VISIBLE_DEVICES") == "void" and not seen["lease_list"])
        if self.gpu.real_driver:
            self.check("nvidia-runtime.no-lease", shown and seen["init_ok"] is False, self._said(seen))
            return
        self.check("nvidia-runtime.no-lease", shown and seen["init_ok"] is not None,
                   self._said(seen) + "; not shown here: that CUDA finds no device without the nodes (this libcuda "
                   "is a stand-in that answers without /dev/nvidia* nodes; on a GPU node the driver's cuInit must "
                   "fail for this check to pass)")

    def nvidia_leased(self) -> None:
        """An opted-in GPU container, given its GPU as NVIDIA's device plugin gives it by default (its UUID in
        NVIDIA_VISIBLE_DEVICES, no CDI device), sees exactly its lease: that GPU's node alone, its UUID."""
        uuid = self.device.uuid
        seen = self._probe("nvidia-leased", weft=True, share=25, envs={"NVIDIA_VISIBLE_DEVICES": uuid})
        env = seen["env"] or {}
        held = seen["lease_list"]
        self.check("nvidia-runtime.leased", seen["exit"] == 0 and len(held) == 1 and held[0].state == "bound"
                   and list(held[0].device_uuids) == [uuid] and bool(seen["driver_injected"])
                   and self.own_device_node(seen["nodes"] or []) and env.get("CUDA_VISIBLE_DEVICES") == uuid
                   and env.get("NVIDIA_VISIBLE_DEVICES") in (uuid, "void") and seen["init_ok"] is True,
                   self._said(seen) + f"; leased {uuid}")


def _by_op(answers: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {"alloc": [], "busy": []}
    for a in answers:
        op = a.get("op")
        if op in ("alloc", "busy"):
            out[op].append(a)
        elif op:
            out[op] = a
    return out


def _reason(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
    return f"{type(exc).__name__}: {exc}"


def summary(doc: dict) -> str:
    lines = [f"whole path: {doc['verdict']}"]
    lines += [f"  {c['result']:<4}  {c['name']}: {c['detail']}" for c in doc["checks"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_whole_path", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="where whole-path.json and summary.txt go")
    p.add_argument("--starts", type=int, default=3, help="container starts timed on each side (default 3)")
    p.add_argument("--nvidia-ctk", default="nvidia-ctk", help="the toolkit's CLI that writes the driver's CDI spec")
    p.add_argument("--cdi-hook", default="nvidia-cdi-hook", help="the toolkit's hook the CDI spec runs")
    p.add_argument("--mps-control", default=shutil.which("nvidia-cuda-mps-control") or "nvidia-cuda-mps-control",
                   help="the driver's MPS control binary")
    p.add_argument("--nvidia-runtime", default="nvidia-container-runtime",
                   help="the toolkit's nvidia-container-runtime, run in CDI mode as containerd's default runtime")
    args = p.parse_args(argv)
    from shim.broker.nvml import NvmlBackend, NvmlError

    args.out.mkdir(parents=True, exist_ok=True)
    try:
        backend = NvmlBackend()
    except NvmlError as exc:
        print(f"gpu_whole_path: {exc}", file=sys.stderr)
        return 2
    try:
        fallback = own_cdi(backend.devices(), loaded_library("libcuda.so.1"))
    except OSError as exc:
        print(f"gpu_whole_path: no spec of its own to fall back on: {exc}", file=sys.stderr)
        fallback = None
    gpu = GpuSide(backend=backend, mps_binary=args.mps_control,
                  write_cdi=nvidia_ctk_cdi(args.nvidia_ctk, args.cdi_hook, args.out / "nvidia-ctk.log"),
                  fallback_cdi=fallback, nvidia_runtime=args.nvidia_runtime)
    work = Path(tempfile.mkdtemp(prefix="weft-wp-"))
    try:
        doc = WholePath(gpu, work, starts=args.starts).run()
    except Exception as exc:  # noqa: BLE001 - what stopped the run goes into its record
        doc = {"verdict": "not proven", "checks": [{"name": "setup", "result": "fail", "detail": _reason(exc)}],
               "figures": {}}
    finally:
        backend.close()
        # The agents' logs, and NVIDIA runtime's, explain a failed check.
        for log, kept in ((work / "agent" / "weft.log", "agent.log"),
                          (work / "agent-nvidia" / "weft.log", "agent-nvidia.log"),
                          (work / "nvidia" / "nvidia-container-runtime.log", "nvidia-runtime.log")):
            with contextlib.suppress(OSError):
                shutil.copy(log, args.out / kept)
        shutil.rmtree(work, ignore_errors=True)
    (args.out / "whole-path.json").write_text(json.dumps(doc, indent=2) + "\n")
    text = summary(doc)
    (args.out / "summary.txt").write_text(text)
    print(text, end="")
    return 0 if doc["verdict"] == "proven" else 1


if __name__ == "__main__":
    sys.exit(main())
