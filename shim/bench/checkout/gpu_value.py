"""The founding promise on one GPU: the same pods, bundled as they run today and split by weft, side by side.

On one GPU node, N two-stage pods (``gpu_workload.py`` beside this: a CPU stage that makes, decodes and resizes
images and streams batches over the pod's localhost to a GPU stage that runs CUDA work per batch) run for the
same wall time each way, every call through the node's agent as kubelet makes it:

- **bundled**: not opted in, each pod asking for the whole GPU (its GPU container given the device by its CDI
  name, as the device plugin gives it), so they run one after another, as the device plugin allows, each for
  its slice of the window, their CPU stages on the GPU node's CPUs;
- **weft**: opted in (``runtimeClassName: weft``), all at once: each GPU stage a share of the one GPU from the
  broker (1/N of its memory and compute, enforced by MPS), each CPU stage rerouted to a CPU node: test nodes on
  this machine (``shim.localfabric.fabric.Fabric3``, as ``weft bench e2e --cpusets`` runs them) on CPUs apart
  from the GPU node's.

Sampled through both windows: NVML's utilisation, SM activity where the GPU reports it (GPM, Hopper and newer),
the GPU's memory used, the broker's leases and each node's CPU (its pods' cgroups). Reported side by side: items
done per GPU-hour, the GPU's active fraction, its memory used, GPU-seconds held and active per pod, the GPU
node's CPU, and the ratio of each. The GPU stage's kernel is sized from a calibration on the GPU node's CPUs so
the GPU is busy ``--busy`` of a bundled pod's time.

Everything is real but the GPU's side (``GpuSide``, as in ``gpu_whole_path``): on a GPU node
(``scripts/gpu-proof.sh --value``) NVML, the driver's MPS and libcuda, and nvidia-ctk's CDI spec; in the
integration test, the fakes. A GPU missing, or busy with another process, stops the run before it makes
anything.

    python -m bench.gpu_value --out DIR [--pods 4] [--window 120] [--busy 0.2] [--kill-one]
                              [--nvidia-ctk PATH] [--cdi-hook PATH] [--mps-control PATH]

writes DIR/value.json (checks, figures, samples), DIR/summary.txt and DIR/record.om (the samples as
dcgm-exporter and the broker would have been scraped; ``--report DIR`` fills a Prometheus from it and runs
``weft report``); exit 0 when it measured and left nothing, 1 when a check failed, 2 when it could not start.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from harness import prometheus
from shim.bench.checkout import gpu_workload
from shim.bench.checkout.gpu_whole_path import (
    GpuSide,
    _reason,
    client_answers,
    libcuda_in,
    libcuda_on_host,
    loaded_library,
    mps_processes,
    nvidia_ctk_cdi,
    own_cdi,
)
from shim.broker.mps import MpsSupervisor
from shim.config import MeshConfig
from shim.gpucheck import cuda_client
from shim.localfabric import cpuset, images, pods
from shim.localfabric.containerd import CGROUP_FS, cgroup_hierarchies
from shim.localfabric.fabric import Fabric3

IMAGE = "docker.io/library/weft-gpu-value:workload"
WORKLOAD_IN_IMAGE = "/weft/gpu_workload.py"
CLIENT_IN_IMAGE = "/weft/cuda_client.py"
PORT = 9000
NAMESPACE = "gpu-value"
APP = "gpu-value"
ORIGIN, HOSTS = "gpu-1", ("cpu-1", "cpu-2")
MIB = 1 << 20
RPC_TIMEOUT = 60.0


@dataclass(frozen=True)
class Plan:
    pods: int = 4
    window_s: float = 120.0
    busy: float = 0.2  # the GPU's share of a bundled pod's time the kernel is sized for
    batch: int = 16
    side: int = 96
    out_side: int = 32
    cpu_cores: float = 1.0  # each CPU stage's limit
    sample_s: float = 1.0
    kill_one: bool = False  # one pod's GPU stage killed half way through the weft window
    calibrate_s: float = 3.0

    def check(self) -> None:
        if self.pods < 2 or self.window_s < 10 * self.pods or not 0.01 <= self.busy <= 0.9:
            raise ValueError(f"want --pods >= 2, --window >= 10 s per pod and --busy within 0.01..0.9; got "
                             f"{self.pods}, {self.window_s:g}, {self.busy:g}")


@dataclass
class ValueGpu(GpuSide):
    """The GPU side (``GpuSide``) and the NVML library to sample it with (pynvml, or a fake)."""

    nvml: Any = None


class Stopped(Exception):
    """The run cannot start or go on; what it says is the reason."""


# -- before anything is made -------------------------------------------------------------------------------
def preflight(backend: Any) -> Any:
    """The GPU the run uses (the first outside MIG), or Stopped: none there, or busy with another process."""
    try:
        devices = [d for d in backend.devices() if not d.mig_enabled and d.parent_uuid is None]
        procs = backend.processes()
    except Exception as exc:  # the driver's answer, whatever it is, is the reason to stop
        raise Stopped(f"the driver did not answer: {_reason(exc)}") from exc
    if not devices:
        raise Stopped("no GPU outside MIG on this machine (a MIG instance is not the one GPU the run compares on)")
    device = devices[0]
    busy = [p for p in procs if p.device_uuid == device.uuid]
    if busy:
        raise Stopped(f"GPU {device.index} ({device.uuid}) is busy: process(es) "
                      + ", ".join(f"{p.pid} ({p.used_memory // MIB} MiB)" for p in busy)
                      + " use it; the run needs it to itself")
    return device


# -- sampling ----------------------------------------------------------------------------------------------
def cgroup_cpu_s(cgroup: str) -> float | None:
    """CPU-seconds used under ``cgroup`` (a path below the hierarchy's root), v2 or v1; None if unreadable."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        stat = CGROUP_FS / cgroup.lstrip("/") / "cpu.stat"
        if (CGROUP_FS / "cgroup.controllers").exists():
            usage = next(line for line in stat.read_text().splitlines() if line.startswith("usage_usec "))
            return int(usage.split()[1]) / 1e6
        for hierarchy in cgroup_hierarchies():
            path = hierarchy / cgroup.lstrip("/") / "cpuacct.usage"
            if path.exists():
                return int(path.read_text()) / 1e9
    return None


class GpuReader:
    """NVML's utilisation and memory of one device, and SM activity through GPM where the GPU has it."""

    def __init__(self, nvml: Any, index: int) -> None:
        self.nv = nvml
        self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self.gpm = None
        self.gpm_note = "SM activity: this NVML has no GPM (nvmlGpmMetricsGet)"
        if hasattr(nvml, "nvmlGpmQueryDeviceSupport"):
            try:
                if nvml.nvmlGpmQueryDeviceSupport(self.handle).isSupportedDevice:
                    self.gpm = nvml.nvmlGpmSampleGet(self.handle, nvml.nvmlGpmSampleAlloc())
                    self.gpm_note = "SM activity from GPM (NVML_GPM_METRIC_SM_UTIL)"
                else:
                    self.gpm_note = "SM activity: the GPU does not support GPM (Hopper and newer do)"
            except Exception as exc:  # noqa: BLE001 - an older driver's answer: no SM activity, said so
                self.gpm_note = f"SM activity: GPM unavailable ({_reason(exc)})"

    def read(self) -> dict[str, float | None]:
        nv = self.nv
        util = nv.nvmlDeviceGetUtilizationRates(self.handle)
        memory = nv.nvmlDeviceGetMemoryInfo(self.handle)
        return {"util_percent": float(util.gpu), "fb_used_bytes": float(memory.used),
                "fb_free_bytes": float(memory.free), **self._gpm()}

    def _gpm(self) -> dict[str, float | None]:
        """Since the last read: SM activity (what DCGM_FI_PROF_SM_ACTIVE is) and the graphics/compute engine's
        (DCGM_FI_PROF_GR_ENGINE_ACTIVE), as ratios; None where the GPU has no GPM."""
        if self.gpm is None:
            return {"sm_active": None, "gr_engine_active": None}
        nv = self.nv
        try:
            newer = nv.nvmlGpmSampleGet(self.handle, nv.nvmlGpmSampleAlloc())
            metrics = nv.c_nvmlGpmMetricsGet_t()
            metrics.version = nv.NVML_GPM_METRICS_GET_VERSION
            metrics.numMetrics = 2
            metrics.sample1, metrics.sample2 = self.gpm, newer
            metrics.metrics[0].metricId = nv.NVML_GPM_METRIC_SM_UTIL
            metrics.metrics[1].metricId = nv.NVML_GPM_METRIC_GRAPHICS_UTIL
            nv.nvmlGpmMetricsGet(metrics)
        except Exception as exc:  # noqa: BLE001 - one failed read is a gap in the samples, said once
            self.gpm_note = f"SM activity: a GPM read failed ({_reason(exc)})"
            return {"sm_active": None, "gr_engine_active": None}
        with contextlib.suppress(Exception):
            nv.nvmlGpmSampleFree(self.gpm)
        self.gpm = newer
        return {"sm_active": round(float(metrics.metrics[0].value) / 100, 4),
                "gr_engine_active": round(float(metrics.metrics[1].value) / 100, 4)}

    def close(self) -> None:
        if self.gpm is not None:
            with contextlib.suppress(Exception):
                self.nv.nvmlGpmSampleFree(self.gpm)
            self.gpm = None


class Sampler:
    """Every ``interval``: the GPU (``GpuReader``), the broker's leases and metrics, each node's CPU, and which
    pods hold the GPU now (``holders()``), each sample tagged with the window it falls in."""

    def __init__(self, reader: GpuReader, leases: Callable[[], list], metrics_text: Callable[[], str],
                 cgroups: dict[str, str], holders: Callable[[], tuple[str, list[str]]], interval: float,
                 containers: Callable[[], dict[str, tuple[str, str]]] = dict) -> None:
        self.reader, self.leases, self.metrics_text = reader, leases, metrics_text
        self.cgroups, self.holders, self.interval = cgroups, holders, interval
        self.containers = containers  # "pod/container" -> (node, its cgroup), as cAdvisor reads them
        self.samples: list[dict] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gpu-value-sampler", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            try:
                window, holding = self.holders()
                sample: dict[str, Any] = {"t": round(t, 3), "window": window, "holders": holding,
                                          **self.reader.read(),
                                          "cpu_s": {node: cgroup_cpu_s(cg) for node, cg in self.cgroups.items()},
                                          "containers": {key: [node, cgroup_cpu_s(cg)]
                                                         for key, (node, cg) in self.containers().items()},
                                          "leases": [{"lease": x.lease_id, "pod": x.pod, "namespace": x.namespace,
                                                      "container": x.container, "memory_bytes": x.memory_bytes,
                                                      "compute_percent": x.compute_percent, "state": x.state.value,
                                                      "uuid": ",".join(x.device_uuids)} for x in self.leases()],
                                          "broker_metrics": self.metrics_text()}
                self.samples.append(sample)
            except Exception as exc:  # noqa: BLE001 - a failed sample is a gap, counted and shown
                if len(self.errors) < 20:
                    self.errors.append(f"{time.strftime('%H:%M:%S')}: {_reason(exc)}")
            self._stop.wait(max(0.0, self.interval - (time.time() - t)))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.reader.close()


# -- the pods ------------------------------------------------------------------------------------------------
@dataclass
class PodRun:
    """One pod of one window: what was made, when, and what its stages said."""

    name: str
    window: str
    sandbox_id: str = ""
    config: cri.PodSandboxConfig | None = None
    gpu_id: str = ""
    cpu_id: str = ""
    started: float = 0.0  # RunPodSandbox asked
    running: float = 0.0  # both stages running
    removed: float = 0.0
    placements: dict[str, str] = field(default_factory=dict)
    lease: dict[str, Any] = field(default_factory=dict)
    gpu_log: list[dict] = field(default_factory=list)
    cpu_log: list[dict] = field(default_factory=list)
    killed: dict[str, Any] = field(default_factory=dict)
    cgroups: dict[str, tuple[str, str]] = field(default_factory=dict)  # container -> (node, cgroup)
    tails: dict[str, str] = field(default_factory=dict)  # container -> its log's end, where it said no last line


class GpuValue:
    def __init__(self, gpu: ValueGpu, work: Path, plan: Plan, *, say: Callable[[str], None] = print) -> None:
        self.gpu, self.work, self.plan, self.say = gpu, work, plan, say
        self.checks: list[dict] = []
        self.figures: dict[str, Any] = {}
        self.runs: list[PodRun] = []
        self.window: str = ""
        self.holding: list[str] = []
        self.samples: list[dict] = []
        self.sampler_errors: list[str] = []
        self.windows: dict[str, tuple[float, float]] = {}

    # -- recording -------------------------------------------------------------------------------------------
    def check(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append({"name": name, "result": "ok" if ok else "fail", "detail": detail})
        return ok

    def document(self) -> dict:
        measured = bool(self.checks) and all(c["result"] == "ok" for c in self.checks)
        return {"verdict": "measured" if measured else "not measured", "checks": self.checks,
                "figures": self.figures, "plan": self.plan.__dict__, "windows": self.windows,
                "pods": [self._pod_doc(r) for r in self.runs], "samples": self.samples,
                "sampler_errors": self.sampler_errors}

    @staticmethod
    def _pod_doc(r: PodRun) -> dict:
        return {"name": r.name, "window": r.window, "sandbox_id": r.sandbox_id, "started": r.started,
                "running": r.running, "removed": r.removed, "placements": r.placements, "lease": r.lease,
                "killed": r.killed, "gpu_end": next((a for a in r.gpu_log if a.get("op") == "end"), None),
                "cpu_end": next((a for a in r.cpu_log if a.get("op") == "end"), None),
                "uid": r.config.metadata.uid if r.config else "",
                "ready": next((a for a in r.gpu_log if a.get("op") == "ready"), None), "log_tails": r.tails}

    # -- the run -----------------------------------------------------------------------------------------------
    def run(self) -> dict:
        """Both windows on one fabric; Stopped (before anything is made) when the GPU cannot be used."""
        from shim.brokerd import Broker, BrokerConfig

        self.device = preflight(self.gpu.backend)
        self.check("gpu.free", True, f"GPU {self.device.index} {self.device.name} ({self.device.uuid}), "
                   f"{self.device.memory_total // MIB} MiB, no other process on it")
        cfg = BrokerConfig(socket=self.work / "broker" / "broker.sock", state_dir=self.work / "broker" / "state",
                           backend="nvml", enforce="kill", watchdog_interval=0.5, mps_dir=self.work / "broker" / "mps")
        assert cfg.mps_dir is not None
        self.mps_dir = cfg.mps_dir
        mps = MpsSupervisor(cfg.mps_dir, self.gpu.mps_binary, private_shm=True, pool=cfg.mps_pool)
        everything = os.sched_getaffinity(0)
        origin_cpus, host_cpus = cpuset.split()
        self.figures["cpus"] = {"gpu_node": origin_cpus, "cpu_nodes": host_cpus}
        with contextlib.ExitStack() as stack:
            stack.callback(os.sched_setaffinity, 0, everything)
            # The broker (and the MPS daemons it starts) on the GPU node's CPUs, as on a node; this process too,
            # in kubelet's place, once the fabric has split the machine.
            os.sched_setaffinity(0, {int(c) for c in origin_cpus.split(",")})
            self.broker = Broker(cfg, backend=self.gpu.backend, mps=mps).start()
            stack.callback(self.broker.stop)
            os.sched_setaffinity(0, everything)
            defaults = MeshConfig()  # the fence and loss timeouts a user gets, as weft bench e2e runs them
            self.fabric = Fabric3(self.work / "fabric", fence_s=defaults.fence_timeout, loss_s=defaults.loss_timeout,
                                  cpusets=True, broker_socket=cfg.socket, containerd_line="2")
            stack.callback(self.fabric.close)
            self.say("starting the GPU node and two CPU nodes (containerd 2, agents, mesh)")
            self.fabric.open()
            os.sched_setaffinity(0, {int(c) for c in origin_cpus.split(",")})
            ctrd = self.fabric.node(ORIGIN).containerd
            self.spec_path, self.libcuda = self._cdi_spec(ctrd.cdi_spec_dir)
            self._image()
            self.rt = cri_grpc.RuntimeServiceStub(stack.enter_context(grpc.insecure_channel(
                self.fabric.agents[ORIGIN].address, options=[("grpc.http2.bdp_probe", 0)])))
            self.direct = cri_grpc.RuntimeServiceStub(stack.enter_context(ctrd.channel()))
            self.kernel_ms = self._calibrate()
            reader = GpuReader(self.gpu.nvml, self.device.index)
            self.figures["sm_activity"] = reader.gpm_note
            cgroups = {name: self.fabric.node(name).containerd.cgroup_root for name in (ORIGIN, *HOSTS)}
            from prometheus_client import generate_latest

            self.figures["device"] = {"index": self.device.index, "uuid": self.device.uuid, "name": self.device.name,
                                      "memory_mib": self.device.memory_total // MIB}
            sampler = Sampler(reader, self.broker.service.leases,
                              lambda: generate_latest(self.broker.metrics.registry).decode(), cgroups,
                              lambda: (self.window, list(self.holding)), self.plan.sample_s, self._container_cgroups)
            try:
                with sampler:
                    for window in (self.bundled, self.weft):
                        try:
                            window()
                        except (Stopped, grpc.RpcError, RuntimeError, ValueError, KeyError, OSError) as exc:
                            self.check(f"{window.__name__}.ran", False, f"stopped: {_reason(exc)}")
                        finally:
                            self.window, self.holding = "", []
                            self._remove_all()
            finally:
                self.samples, self.sampler_errors = sampler.samples, sampler.errors
                self.figures.update(figures(self))
                self.nothing_left()
                self._keep_logs()
        return self.document()

    def _cdi_spec(self, spec_dir: Path) -> tuple[Path, str]:
        """The driver's CDI spec (the proof's own where the toolkit writes none) and libcuda's place in a container."""
        try:
            path = self.gpu.write_cdi(spec_dir)
            where = libcuda_in(json.loads(path.read_text()))
        except (RuntimeError, ValueError, OSError) as exc:
            if self.gpu.fallback_cdi is None:
                raise
            self.check("cdi.spec", False, f"{_reason(exc)}; the rest runs on a spec of the proof's own")
            path = self.gpu.fallback_cdi(spec_dir)
            where = libcuda_in(json.loads(path.read_text()))
        else:
            self.check("cdi.spec", True, f"{path.name}: libcuda at {where} in a container")
        return path, where

    def _image(self) -> None:
        """One image for both stages, from this machine's Python, imported on every node."""
        host_libcuda = libcuda_on_host(json.loads(self.spec_path.read_text()))
        layer = images.python_layer(self.gpu.python, {
            WORKLOAD_IN_IMAGE.lstrip("/"): Path(gpu_workload.__file__).read_bytes(),
            CLIENT_IN_IMAGE.lstrip("/"): Path(cuda_client.__file__).read_bytes()}, libraries_of=[host_libcuda])
        archive = images.build_archive(images.ImageSpec(IMAGE, ("python3",)), self.work / "workload-image.tar",
                                       extra_layers=(layer,))
        assert self.fabric.cluster is not None
        for node in self.fabric.cluster.nodes:
            node.containerd.import_image(archive, IMAGE)
        archive.unlink()

    def _calibrate(self) -> int:
        """The kernel's milliseconds per batch: ``busy`` of the CPU time a batch takes on the GPU node's CPUs
        (this process runs there), so a bundled pod, held back by its CPU stage, keeps the GPU that busy."""
        python = self.gpu.python
        res = subprocess.run([python, "-I", "-S", gpu_workload.__file__, "calibrate", "--batch", str(self.plan.batch),
                              "--side", str(self.plan.side), "--out-side", str(self.plan.out_side), "--seconds",
                              str(self.plan.calibrate_s)], capture_output=True, text=True, timeout=120, check=True)
        cal = json.loads(res.stdout)
        kernel_ms = max(1, round(cal["batch_cpu_ms"] * self.plan.busy))
        self.figures["calibration"] = {**cal, "busy": self.plan.busy, "kernel_ms": kernel_ms}
        self.say(f"calibrated: a batch of {self.plan.batch} items takes {cal['batch_cpu_ms']:.0f} ms of CPU on the "
                 f"GPU node; the GPU stage's kernel runs {kernel_ms} ms per batch ({self.plan.busy:.0%})")
        return kernel_ms

    def share_mib(self) -> int:
        return self.device.memory_total // self.plan.pods // MIB

    def _sandbox(self, run: PodRun, weft: bool) -> None:
        ctrd = self.fabric.node(ORIGIN).containerd
        annotations = {}
        if weft:
            annotations = {"weft.io/gpu-memory.gpu": f"{self.share_mib()}Mi",
                           "weft.io/gpu-compute.gpu": str(100 // self.plan.pods), "weft.io/ports.gpu": str(PORT)}
        run.config = pods.sandbox_config(run.name, ctrd.pod_log_dir, NAMESPACE, labels={"app": APP},
                                         annotations=annotations, cgroup_parent=ctrd.cgroup_root)
        run.started = time.time()
        run.sandbox_id = self.rt.RunPodSandbox(cri.RunPodSandboxRequest(
            config=run.config, runtime_handler="weft" if weft else ""), timeout=RPC_TIMEOUT).pod_sandbox_id

    def _containers(self, run: PodRun) -> None:
        """The GPU stage first (it listens), then the CPU stage; until both run."""
        plan = self.plan
        alloc = self.share_mib() // 4
        gpu = pods.container_config("gpu", ["python3", "-I", "-S", WORKLOAD_IN_IMAGE, "gpu", "--port", str(PORT),
                                            "--kernel-ms", str(self.kernel_ms), "--alloc-mib", str(alloc),
                                            "--libcuda", self.libcuda], image=IMAGE, envs=self.gpu.client_env,
                                    labels={"app": APP})
        gpu.linux.resources.memory_limit_in_bytes = 4 << 30  # libcuda maps far more than a shell's 64 MiB
        gpu.CDI_devices.add(name=f"nvidia.com/gpu={self.device.index}")
        cpu = pods.container_config("cpu", ["python3", "-I", "-S", WORKLOAD_IN_IMAGE, "cpu", "--port", str(PORT),
                                            "--batch", str(plan.batch), "--side", str(plan.side), "--out-side",
                                            str(plan.out_side)], image=IMAGE, labels={"app": APP})
        res = cpu.linux.resources  # limits: a CPU node admits a rerouted stage by them
        res.cpu_period, res.cpu_quota, res.memory_limit_in_bytes = 100000, int(plan.cpu_cores * 100000), 512 << 20
        for config in (gpu, cpu):
            cid = self.rt.CreateContainer(cri.CreateContainerRequest(
                pod_sandbox_id=run.sandbox_id, config=config, sandbox_config=run.config),
                timeout=RPC_TIMEOUT).container_id
            self.rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=RPC_TIMEOUT)
            setattr(run, f"{config.metadata.name}_id", cid)
        deadline = time.monotonic() + RPC_TIMEOUT
        for name in ("gpu", "cpu"):
            cid = getattr(run, f"{name}_id")
            while True:
                status = self.rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid),
                                                 timeout=RPC_TIMEOUT).status
                if status.state == cri.CONTAINER_RUNNING:
                    run.placements[name] = status.annotations.get("weft.io/placement", "plain")
                    break
                if status.state == cri.CONTAINER_EXITED or time.monotonic() > deadline:
                    tail = Path(status.log_path).read_text(errors="replace")[-1500:] if status.log_path else ""
                    raise RuntimeError(f"{run.name}'s {name} stage did not run: {cri.ContainerState.Name(status.state)}"
                                       f" {status.reason} {status.message}; its log ends {tail!r}")
                time.sleep(0.1)
        run.running = time.time()
        self._locate(run)

    def _locate(self, run: PodRun) -> None:
        """Each stage's node and cgroup (a rerouted one's on its CPU node), read for its CPU as cAdvisor reads it."""
        from shim.crishared.labels import ORIGIN_LABEL, SANDBOX_LABEL

        def cgroup(rt: cri_grpc.RuntimeServiceStub, cid: str) -> str:
            info = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid, verbose=True),
                                      timeout=RPC_TIMEOUT).info
            return str(json.loads(info["info"])["runtimeSpec"]["linux"]["cgroupsPath"])

        for name in ("gpu", "cpu"):
            if not run.placements.get(name, "").startswith("remote:"):
                run.cgroups[name] = (ORIGIN, cgroup(self.direct, getattr(run, f"{name}_id")))
        for host in HOSTS:
            if not any(p == f"remote:{host}" for p in run.placements.values()):
                continue
            with self.fabric.node(host).containerd.channel() as ch:
                rt = cri_grpc.RuntimeServiceStub(ch)
                for c in rt.ListContainers(cri.ListContainersRequest(filter=cri.ContainerFilter(label_selector={
                        ORIGIN_LABEL: ORIGIN, SANDBOX_LABEL: run.sandbox_id})), timeout=RPC_TIMEOUT).containers:
                    run.cgroups[c.metadata.name] = (host, cgroup(rt, c.id))

    def _container_cgroups(self) -> dict[str, tuple[str, str]]:
        return {f"{r.name}/{name}": where for r in list(self.runs) if r.running and not r.removed
                for name, where in list(r.cgroups.items())}

    def _end(self, run: PodRun) -> None:
        """As kubelet ends a pod: each container stopped (SIGTERM, a grace period), its logs read, then removed."""
        for cid in (run.cpu_id, run.gpu_id):
            if cid:
                with contextlib.suppress(grpc.RpcError):
                    self.rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=10), timeout=RPC_TIMEOUT)
        for name in ("gpu", "cpu"):
            cid = getattr(run, f"{name}_id")
            # Each stage's last line says what it did; a rerouted one's log reaches the origin a moment later.
            deadline = time.monotonic() + (0 if name == "gpu" and run.killed else 5)
            while cid:
                with contextlib.suppress(grpc.RpcError):
                    status = self.rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid),
                                                     timeout=RPC_TIMEOUT).status
                    setattr(run, f"{name}_log", client_answers(Path(status.log_path)))
                    if not any(a.get("op") == "end" for a in getattr(run, f"{name}_log")):
                        with contextlib.suppress(OSError):  # why it ended without its last line (stderr too)
                            run.tails[name] = Path(status.log_path).read_text(errors="replace")[-1500:]
                if any(a.get("op") == "end" for a in getattr(run, f"{name}_log")) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        if run.sandbox_id:
            self.rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=run.sandbox_id), timeout=RPC_TIMEOUT)
            self.rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=run.sandbox_id), timeout=RPC_TIMEOUT)
        run.removed = time.time()

    def _remove_all(self) -> None:
        """Whatever a window left (it stopped half way): every pod through the agent, as kubelet would."""
        for run in self.runs:
            if run.sandbox_id and not run.removed:
                with contextlib.suppress(grpc.RpcError, OSError):
                    self._end(run)

    # -- the windows ----------------------------------------------------------------------------------------
    def bundled(self) -> None:
        """One pod after another, each with the whole GPU for its slice of the window."""
        plan = self.plan
        slot = plan.window_s / plan.pods
        self.say(f"bundled: {plan.pods} pods, not opted in, the whole GPU each, one after another, {slot:.0f} s each")
        self.window = "bundled"
        start = time.time()
        for i in range(plan.pods):
            run = PodRun(f"bundled-{i}", "bundled")
            self.runs.append(run)
            self._sandbox(run, weft=False)
            self.holding = [run.name]
            self._containers(run)
            time.sleep(max(0.0, start + slot * (i + 1) - time.time()))
            self._end(run)
            self.holding = []
        self.windows["bundled"] = (start, time.time())
        ran = [r for r in self.runs if r.window == "bundled"]
        done = {r.name: _done(r) for r in ran}
        self.check("bundled.ran", all(done.values()) and all(p == "plain" for r in ran for p in r.placements.values()),
                   f"items done {done}; each pod's stages ran on the GPU node, not opted in")

    def weft(self) -> None:
        """Every pod at once, opted in: the GPU stages on shares of the GPU, the CPU stages on the CPU nodes."""
        plan = self.plan
        self.say(f"weft: {plan.pods} pods opted in, all at once, {self.share_mib()} MiB and "
                 f"{100 // plan.pods} % of the GPU each, CPU stages rerouted, {plan.window_s:.0f} s")
        self.window = "weft"
        start = time.time()
        started = []
        for i in range(plan.pods):
            run = PodRun(f"weft-{i}", "weft")
            self.runs.append(run)
            started.append(run)
            self._sandbox(run, weft=True)
            self._containers(run)
            self.holding = [r.name for r in started]
        leases = {x.container_id: x for x in self.broker.service.leases()}
        for run in started:
            lease = leases.get(run.gpu_id)
            if lease is not None:
                run.lease = {"lease": lease.lease_id, "memory_bytes": lease.memory_bytes,
                             "compute_percent": lease.compute_percent, "shared": lease.shared,
                             "state": lease.state.value, "created_at": lease.created_at}
        placed = {r.name: r.placements for r in started}
        self.check("weft.placed", all(r.lease.get("state") == "bound" and r.lease.get("shared")
                                      and r.placements.get("gpu") == "local"
                                      and r.placements.get("cpu", "").startswith("remote:") for r in started),
                   f"placements {placed}; leases " + "; ".join(
                       f"{r.name}: {r.lease.get('lease')} {r.lease.get('state')} "
                       f"{r.lease.get('memory_bytes', 0) // MIB} MiB {r.lease.get('compute_percent')} %"
                       for r in started))
        if plan.kill_one:
            time.sleep(max(0.0, start + plan.window_s / 2 - time.time()))
            self.kill_gpu_stage(started[0])
        time.sleep(max(0.0, start + plan.window_s - time.time()))
        for run in started:
            self._end(run)
        self.windows["weft"] = (start, time.time())
        done = {r.name: _done(r) for r in started}
        self.check("weft.ran", all(done.values()), f"items done {done}")

    def kill_gpu_stage(self, run: PodRun) -> None:
        """The fault: a pod's GPU stage killed (SIGKILL, as the OOM killer would) while it runs. Its lease must be
        released (the hook's poststop, the watchdog); what the pod then could not do is in its figures."""
        answer = self.direct.ContainerStatus(cri.ContainerStatusRequest(container_id=run.gpu_id, verbose=True),
                                             timeout=RPC_TIMEOUT)
        pid = int(json.loads(answer.info.get("info", "{}")).get("pid") or 0)
        if answer.status.state != cri.CONTAINER_RUNNING or pid <= 0:  # kill(0) would be this process's own group
            raise RuntimeError(f"{run.name}'s GPU stage is not running to be killed: "
                               f"{cri.ContainerState.Name(answer.status.state)} {answer.status.reason}, pid {pid}")
        lease_id = run.lease.get("lease", "")
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        self.say(f"fault: killed {run.name}'s GPU stage (pid {pid}) holding lease {lease_id}")
        released = None
        while time.time() - killed_at < 30:
            if not any(x.lease_id == lease_id for x in self.broker.service.leases()):
                released = time.time()
                break
            time.sleep(0.05)
        self.holding = [name for name in self.holding if name != run.name]
        run.killed = {"at": killed_at, "pid": pid, "lease": lease_id,
                      "lease_released_s": None if released is None else round(released - killed_at, 3)}
        self.check("fault.kill.released", released is not None,
                   f"{run.name}'s GPU stage killed; its lease {lease_id} "
                   + (f"released {released - killed_at:.2f} s later" if released else "still held 30 s later"))

    # -- the end ---------------------------------------------------------------------------------------------
    def nothing_left(self) -> None:
        """No lease, MPS process or container of the run's, on any node."""
        left: list[str] = []
        deadline = time.monotonic() + 30
        while (leases := self.broker.service.leases()) and time.monotonic() < deadline:
            time.sleep(0.1)
        left += [f"lease {x.lease_id} ({x.pod})" for x in leases]
        deadline = time.monotonic() + 10
        while (mps := self.mps_processes()) and time.monotonic() < deadline:
            time.sleep(0.1)
        left += [f"MPS process {pid}" for pid in mps]
        assert self.fabric.cluster is not None
        for node in self.fabric.cluster.nodes:
            with node.containerd.channel() as ch:
                rt = cri_grpc.RuntimeServiceStub(ch)
                left += [f"container {c.metadata.name} on {node.name}"
                         for c in rt.ListContainers(cri.ListContainersRequest(), timeout=30).containers]
                left += [f"sandbox {s.metadata.name} on {node.name}"
                         for s in rt.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=30).items]
        self.check("nothing-left", not left, "; ".join(left) or "no lease, MPS process, container or sandbox left")

    def mps_processes(self) -> list[int]:
        return mps_processes(self.mps_dir, self.broker.mps)

    def _keep_logs(self) -> None:
        self.logs = {}
        for name, agent in self.fabric.agents.items():
            self.logs[f"agent-{name}.log"] = agent.log_text()


def _done(run: PodRun) -> int:
    """Items the pod's GPU stage finished (its last line that says)."""
    return max((int(a.get("done", 0)) for a in run.gpu_log), default=0)


# -- figures ---------------------------------------------------------------------------------------------------
def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def figures(value: GpuValue) -> dict:
    """Each window's figures from its pods and samples, and weft's over bundled's."""
    out: dict[str, Any] = {}
    for window in ("bundled", "weft"):
        if window not in value.windows:
            continue
        start, end = value.windows[window]
        seconds = end - start
        runs = [r for r in value.runs if r.window == window]
        samples = [s for s in value.samples if s["window"] == window]
        per_pod = {}
        for r in runs:
            kernel_s = sum(float(a.get("kernel_s", 0)) for a in r.gpu_log if a.get("op") == "batch")
            held_until = r.killed.get("at", 0) + (r.killed.get("lease_released_s") or 0) if r.killed else r.removed
            # From the lease (weft) or the pod's start (bundled: the device plugin's GPU is the pod's from then).
            life = max(0.0, (held_until or end) - (r.lease.get("created_at") or r.started))
            share = (r.lease["memory_bytes"] / value.device.memory_total) if r.lease else 1.0
            cpu_end = next((a for a in r.cpu_log if a.get("op") == "end"), {})
            per_pod[r.name] = {
                "items": _done(r), "gpu_held_s": round(life * share, 2), "share": round(share, 4),
                "held_wall_s": round(life, 2), "gpu_active_s": round(kernel_s, 3),
                "active_over_held": round(kernel_s / (life * share), 4) if life else None,
                "placements": r.placements, "cpu_made": cpu_end.get("made"), "cpu_lost": cpu_end.get("lost"),
                "cpu_in_flight": cpu_end.get("in_flight"),
                # Made and never sent: held while no GPU stage took them (and the batch being made at the end).
                "cpu_unsent": (cpu_end["made"] - cpu_end["acked"] - cpu_end["lost"] - cpu_end["in_flight"])
                if cpu_end else None}
            if r.killed:
                per_pod[r.name]["killed"] = {**r.killed, "items_before": _done(r),
                                             "seconds_without_gpu_stage": round(end - r.killed["at"], 2)}
        items = sum(p["items"] for p in per_pod.values())
        held = sum(p["gpu_held_s"] for p in per_pod.values())
        active = sum(p["gpu_active_s"] for p in per_pod.values())
        cpu = {}
        if len(samples) >= 2:
            for node in samples[0]["cpu_s"]:
                # A node's cgroup is made with its first pod: none yet is none used.
                a, b = samples[0]["cpu_s"][node] or 0.0, samples[-1]["cpu_s"][node] or 0.0
                span = samples[-1]["t"] - samples[0]["t"]
                cpu[node] = {"cpu_s": round(b - a, 2), "cores": round((b - a) / span, 3)} if span > 0 else None
        sm = [s["sm_active"] for s in samples if s["sm_active"] is not None]
        out[window] = {
            "seconds": round(seconds, 1), "pods": len(runs), "items": items,
            "items_per_gpu_hour": round(items / (seconds / 3600), 1) if seconds else None,
            "items_per_held_gpu_hour": round(items / (held / 3600), 1) if held else None,
            "gpu_util_mean": _mean([s["util_percent"] / 100 for s in samples]),
            "sm_active_mean": _mean(sm) if sm else None,
            "fb_used_mean_mib": round(statistics.fmean(s["fb_used_bytes"] for s in samples) / MIB, 1)
            if samples else None,
            "fb_used_max_mib": round(max(s["fb_used_bytes"] for s in samples) / MIB, 1) if samples else None,
            "gpu_held_s": round(held, 2), "gpu_active_s": round(active, 3),
            "active_over_held": round(active / held, 4) if held else None,
            "cpu": cpu, "samples": len(samples), "per_pod": per_pod}
    if "bundled" in out and "weft" in out:
        ratios = {}
        for key in ("items", "items_per_gpu_hour", "items_per_held_gpu_hour", "gpu_util_mean", "sm_active_mean",
                    "fb_used_mean_mib", "gpu_held_s", "gpu_active_s", "active_over_held"):
            b, w = out["bundled"][key], out["weft"][key]
            ratios[key] = round(w / b, 3) if b and w is not None else None
        gpu_node = [((out[w]["cpu"].get(ORIGIN) or {}).get("cpu_s")) for w in ("bundled", "weft")]
        ratios["gpu_node_cpu_s"] = round(gpu_node[1] / gpu_node[0], 3) if gpu_node[0] and gpu_node[1] is not None \
            else None
        out["weft_over_bundled"] = ratios
    return out


# -- the record: what a cluster's Prometheus would hold of both windows -------------------------------------
def _labels(labels: dict[str, Any]) -> str:
    return ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                    for k, v in labels.items())


# The broker's series the report and a dashboard read (counters as the scrape shows them, with _total).
BROKER_SERIES = ("weft_gpu_lease_bytes", "weft_gpu_device_memory_bytes", "weft_gpu_leases",
                 "weft_gpu_held_seconds_total", "weft_gpu_active_seconds_total", "weft_gpu_lease_held_seconds_total",
                 "weft_gpu_lease_active_seconds_total")


def record(doc: dict) -> str:
    """The samples as timestamped OpenMetrics, each series named as its exporter names it: dcgm-exporter's
    fields with its pod mapping (every pod the device is allocated to, as with shared replicas), the broker's
    lease metrics as it was scraped, kube-state-metrics' pod and node series, and cAdvisor's CPU per container
    (its cgroup, on the node it ran on). ``promtool tsdb create-blocks-from openmetrics`` takes it as it is."""
    from prometheus_client.parser import text_string_to_metric_families

    device = doc["figures"]["device"]
    pods = {p["name"]: p for p in doc["pods"]}
    series: dict[str, dict[str, list[tuple[float, float]]]] = {}

    def add(name: str, labels: dict[str, Any], t: float, value: float) -> None:
        series.setdefault(name, {}).setdefault(_labels(labels), []).append((t, float(value)))

    gpu = {"gpu": device["index"], "UUID": device["uuid"], "device": f"nvidia{device['index']}",
           "modelName": device["name"], "Hostname": ORIGIN}
    fields = (("DCGM_FI_DEV_GPU_UTIL", "util_percent", 1), ("DCGM_FI_DEV_FB_USED", "fb_used_bytes", 1 / MIB),
              ("DCGM_FI_DEV_FB_FREE", "fb_free_bytes", 1 / MIB), ("DCGM_FI_PROF_SM_ACTIVE", "sm_active", 1),
              ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gr_engine_active", 1))
    for sample in doc["samples"]:
        t = sample["t"]
        holders = [pods[name] for name in sample["holders"] if name in pods]
        windows = {p["window"] for p in holders} or {sample["window"]}
        add("kube_node_status_capacity", {"node": ORIGIN, "resource": "nvidia_com_gpu", "unit": "integer"}, t, 1)
        # A device plugin handing out shared replicas while the pods share the GPU (weft's window), whole GPUs before.
        replicas = {"label_nvidia_com_gpu_replicas": str(doc["plan"]["pods"])} if "weft" in windows else {}
        add("kube_node_labels", {"node": ORIGIN, **replicas}, t, 1)
        for name, key, scale in fields:
            if sample.get(key) is None:
                continue
            value = round(sample[key] * scale, 4)
            add(name, {**gpu, "container": "", "namespace": "", "pod": ""}, t, value)
            for p in holders:
                add(name, {**gpu, "container": "gpu", "namespace": NAMESPACE, "pod": p["name"]}, t, value)
        for p in holders:
            pod = {"namespace": NAMESPACE, "pod": p["name"], "uid": p["uid"]}
            add("kube_pod_info", {**pod, "node": ORIGIN, "created_by_kind": "", "created_by_name": ""}, t, 1)
            add("kube_pod_labels", {**pod, "label_app": APP}, t, 1)
            add("kube_pod_status_phase", {**pod, "phase": "Running"}, t, 1)
            add("kube_pod_created", pod, t, round(p["started"], 3))
            add("kube_pod_container_resource_requests", {**pod, "container": "gpu", "node": ORIGIN,
                                                         "resource": "nvidia_com_gpu", "unit": "integer"}, t, 1)
            for container in ("gpu", "cpu"):
                add("kube_pod_container_state_started", {**pod, "container": container}, t, round(p["running"], 3))
                add("kube_pod_container_status_restarts_total", {**pod, "container": container}, t, 0)
        for key, (node, cpu_s) in sample.get("containers", {}).items():
            pod, container = key.split("/")
            if cpu_s is not None:
                add("container_cpu_usage_seconds_total", {"namespace": NAMESPACE, "pod": pod, "container": container,
                                                          "node": node, "cpu": "total"}, t, round(cpu_s, 4))
        for family in text_string_to_metric_families(sample.get("broker_metrics", "")):
            for s in family.samples:
                if s.name in BROKER_SERIES:
                    add(s.name, s.labels, t, s.value)
    return prometheus.render(series, time_digits=3)


def report(out: Path, say: Callable[[str], None] = print) -> int:
    """Fill a Prometheus of its own from ``out/record.om`` (promtool's backfill) and run ``weft report`` on the
    pods, the bundled window before and weft's after: ``out/report.md`` and ``out/report.json``. Returns the
    report's exit code; 2 where Prometheus or promtool is missing (it says which)."""
    doc = json.loads((out / "value.json").read_text())
    missing = [tool for tool in ("prometheus", "promtool") if shutil.which(tool) is None]
    if missing:
        say(f"no {' or '.join(missing)} here: run `python -m bench.gpu_value --report {out}` where Prometheus is "
            "(Debian's prometheus package)")
        return 2
    if "bundled" not in doc["windows"] or "weft" not in doc["windows"]:
        say("the run has no bundled and weft windows to compare")
        return 2
    from shim.localfabric.agent import free_port

    work = Path(tempfile.mkdtemp(prefix="weft-value-prom-"))
    proc = None
    try:
        tsdb = work / "tsdb"
        res = subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(out / "record.om"),
                              str(tsdb)], capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            say(f"promtool could not backfill record.om: {res.stderr.strip()[-1500:]}")
            return 2
        step = float(doc["plan"]["sample_s"])
        (work / "prometheus.yml").write_text(f"global:\n  scrape_interval: {max(1, round(step))}s\n")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with open(work / "prometheus.log", "wb") as log:
            proc = subprocess.Popen(["prometheus", f"--config.file={work / 'prometheus.yml'}",
                                     f"--storage.tsdb.path={tsdb}", f"--web.listen-address=127.0.0.1:{port}",
                                     "--storage.tsdb.retention.time=100y",
                                     # Backfilled series carry no staleness markers: a gone pod lingers no
                                     # longer than a couple of samples.
                                     f"--query.lookback-delta={max(1, round(step * 2))}s"],
                                    stdout=log, stderr=subprocess.STDOUT)
        _wait_ready(url, proc, work / "prometheus.log")
        (b0, b1), (a0, a1) = doc["windows"]["bundled"], doc["windows"]["weft"]
        argv = [sys.executable, "-m", "shim", "report", f"app={APP}", "-n", NAMESPACE, "--prometheus", url,
                "--before", f"{int(b0) + 1}..{int(b1)}", "--after", f"{int(a0) + 1}..{int(a1)}",
                "--now", str(int(a1) + 1), "--lookback", "1d"]
        code = 0
        for flag, name in (("--markdown", "report.md"), ("--json", "report.json")):
            res = subprocess.run([*argv, flag], capture_output=True, text=True, timeout=300)
            (out / name).write_text(res.stdout if res.stdout else res.stderr)
            code = res.returncode
        say(f"weft report (exit {code}): {out / 'report.md'}")
        return code
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def _wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    import urllib.request

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited: {log.read_text(errors='replace')[-2000:]}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.2)
    raise RuntimeError("prometheus did not become ready in 60 s")


# -- output -------------------------------------------------------------------------------------------------
def _fmt(v: Any, unit: str = "", digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}{unit}"
    return f"{v:,}{unit}"


def summary(doc: dict) -> str:
    f = doc["figures"]
    lines = [f"gpu value: {doc['verdict']}"]
    lines += [f"  {c['result']:<4}  {c['name']}: {c['detail']}" for c in doc["checks"]]
    if "bundled" in f and "weft" in f:
        b, w, r = f["bundled"], f["weft"], f.get("weft_over_bundled", {})

        def cpu(x: dict, node: str) -> str:
            c = x["cpu"].get(node)
            return f"{c['cpu_s']:.1f} s ({c['cores']:.2f} cores)" if c else "-"

        rows = [("items done", _fmt(b["items"]), _fmt(w["items"]), _fmt(r.get("items"), "x", 2)),
                ("items per GPU-hour (the one GPU, whole window)", _fmt(b["items_per_gpu_hour"], "", 0),
                 _fmt(w["items_per_gpu_hour"], "", 0), _fmt(r.get("items_per_gpu_hour"), "x", 2)),
                ("items per GPU-hour held by the pods", _fmt(b["items_per_held_gpu_hour"], "", 0),
                 _fmt(w["items_per_held_gpu_hour"], "", 0), _fmt(r.get("items_per_held_gpu_hour"), "x", 2)),
                ("GPU active fraction (NVML utilisation, mean)", _fmt(b["gpu_util_mean"], "", 3),
                 _fmt(w["gpu_util_mean"], "", 3), _fmt(r.get("gpu_util_mean"), "x", 2)),
                ("SM activity (GPM, mean)", _fmt(b["sm_active_mean"], "", 3), _fmt(w["sm_active_mean"], "", 3),
                 _fmt(r.get("sm_active_mean"), "x", 2)),
                ("GPU memory used, mean / max MiB", f"{_fmt(b['fb_used_mean_mib'])} / {_fmt(b['fb_used_max_mib'])}",
                 f"{_fmt(w['fb_used_mean_mib'])} / {_fmt(w['fb_used_max_mib'])}",
                 _fmt(r.get("fb_used_mean_mib"), "x", 2)),
                ("GPU-seconds held / active (all pods)", f"{_fmt(b['gpu_held_s'])} / {_fmt(b['gpu_active_s'])}",
                 f"{_fmt(w['gpu_held_s'])} / {_fmt(w['gpu_active_s'])}", _fmt(r.get("gpu_held_s"), "x", 2)),
                ("GPU active / held", _fmt(b["active_over_held"], "", 3), _fmt(w["active_over_held"], "", 3),
                 _fmt(r.get("active_over_held"), "x", 2)),
                ("GPU node's CPU (its pods)", cpu(b, ORIGIN), cpu(w, ORIGIN), _fmt(r.get("gpu_node_cpu_s"), "x", 2)),
                ("CPU nodes' CPU (their pods)", " + ".join(cpu(b, h) for h in HOSTS),
                 " + ".join(cpu(w, h) for h in HOSTS), "")]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        head = ("figure", "bundled", "weft", "weft / bundled")
        widths = [max(w_, len(h)) for w_, h in zip(widths, head, strict=True)]
        lines += ["", "  ".join(h.ljust(n) for h, n in zip(head, widths, strict=True))]
        lines += ["  ".join(c.ljust(n) for c, n in zip(row, widths, strict=True)).rstrip() for row in rows]
        lines += ["", "per pod: GPU-seconds held / active, items"]
        for window in ("bundled", "weft"):
            for name, p in f[window]["per_pod"].items():
                extra = ""
                if "killed" in p:
                    k = p["killed"]
                    extra = (f"; GPU stage killed, lease released {_fmt(k.get('lease_released_s'), ' s', 2)} later, "
                             f"{k['seconds_without_gpu_stage']:.0f} s without its GPU stage: items lost in flight "
                             f"{p.get('cpu_lost')}, made and held with no GPU stage to take them {p.get('cpu_unsent')}")
                lines.append(f"  {name}: {p['gpu_held_s']:.1f} / {p['gpu_active_s']:.1f} (share {p['share']:.3f}), "
                             f"{p['items']} items{extra}")
    return "\n".join(lines) + "\n"


def write(out: Path, doc: dict, logs: dict[str, str] | None = None) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "value.json").write_text(json.dumps(doc, indent=1) + "\n")
    if doc["samples"] and "device" in doc["figures"]:
        (out / "record.om").write_text(record(doc))
    text = summary(doc)
    (out / "summary.txt").write_text(text)
    for name, body in (logs or {}).items():
        (out / name).write_text(body)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_value", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="where value.json, summary.txt and record.om go")
    p.add_argument("--report", type=Path, metavar="DIR",
                   help="instead of a run: fill a Prometheus from DIR/record.om and run weft report on it")
    p.add_argument("--pods", type=int, default=4, help="N, the pods each way (default 4)")
    p.add_argument("--window", type=float, default=120.0, help="seconds each way (default 120)")
    p.add_argument("--busy", type=float, default=0.2,
                   help="the GPU's share of a bundled pod's time its kernel is sized for (default 0.2)")
    p.add_argument("--kill-one", action="store_true", help="kill one pod's GPU stage half way through weft's window")
    p.add_argument("--nvidia-ctk", default="nvidia-ctk", help="the toolkit's CLI that writes the driver's CDI spec")
    p.add_argument("--cdi-hook", default="nvidia-cdi-hook", help="the toolkit's hook the CDI spec runs")
    p.add_argument("--mps-control", default=shutil.which("nvidia-cuda-mps-control") or "nvidia-cuda-mps-control",
                   help="the driver's MPS control binary")
    args = p.parse_args(argv)
    if args.report is not None:
        return report(args.report, lambda msg: print(f"gpu_value: {msg}", file=sys.stderr, flush=True))
    if args.out is None:
        p.error("--out DIR (or --report DIR) is needed")
    plan = Plan(pods=args.pods, window_s=args.window, busy=args.busy, kill_one=args.kill_one)
    try:
        plan.check()
    except ValueError as exc:
        p.error(str(exc))
    from shim.broker.nvml import NvmlBackend, NvmlError

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # through every clean-up on the way out: nothing of the run is left

    signal.signal(signal.SIGTERM, stop)

    def say(msg: str) -> None:
        print(f"gpu_value: {msg}", file=sys.stderr, flush=True)

    try:
        import pynvml

        backend = NvmlBackend()
    except (ImportError, NvmlError) as exc:
        say(f"no GPU to measure on: {exc}")
        return 2
    try:
        try:
            fallback = own_cdi(backend.devices(), loaded_library("libcuda.so.1"))
        except OSError as exc:
            say(f"no spec of its own to fall back on: {exc}")
            fallback = None
        gpu = ValueGpu(backend=backend, mps_binary=args.mps_control,
                       write_cdi=nvidia_ctk_cdi(args.nvidia_ctk, args.cdi_hook, args.out / "nvidia-ctk.log"),
                       fallback_cdi=fallback, nvml=pynvml)
        args.out.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="weft-value-"))
        value = GpuValue(gpu, work, plan, say=say)
        try:
            doc = value.run()
        except Stopped as exc:
            say(f"stopped before anything was made: {exc}")
            (args.out / "summary.txt").write_text(f"gpu value: not started: {exc}\n")
            return 2
        except Exception as exc:  # noqa: BLE001 - what stopped the run goes into its record
            doc = {**value.document(), "verdict": "not measured"}
            doc["checks"].append({"name": "setup", "result": "fail", "detail": _reason(exc)})
        finally:
            shutil.rmtree(work, ignore_errors=True)
    finally:
        backend.close()
    print(write(args.out, doc, getattr(value, "logs", None)), end="")
    return 0 if doc["verdict"] == "measured" else 1


if __name__ == "__main__":
    sys.exit(main())
