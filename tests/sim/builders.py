"""Small builders for hand-made workloads, shared by the simulator's tests.

Each test spells out its pods and cluster in a line or two, so the expected
answer can be worked out by hand from what the test shows.
"""

from __future__ import annotations

from shim.core.reroute import Resources
from shim.sim.model import GIB, ClusterSpec, CpuContainer, GpuProfile, GpuStage, PodSpec

GPU_NODE = Resources(64.0, 512 * GIB)
CPU_NODE = Resources(32.0, 256 * GIB)


def cluster(gpu_nodes: int = 1, gpus: int = 1, cpu_nodes: int = 1, *, gpu_node: Resources = GPU_NODE,
            cpu_node: Resources = CPU_NODE, gpu_gib: int = 80) -> ClusterSpec:
    return ClusterSpec(gpu_nodes, gpus, gpu_gib * GIB, gpu_node, cpu_nodes, cpu_node)


def gpu_pod(name: str, *, arrival: float = 0.0, run: float = 3600.0, duty: float = 0.25, gib: int = 20,
            cpu: float = 4.0, cpu_gib: int = 8, host_cpu: float = 2.0, annotations: dict | None = None,
            profile: GpuProfile | None = None, lease: bool = True) -> PodSpec:
    """A pod with one CPU-stage container ``cpu`` and one GPU-stage container ``gpu`` holding ``gib`` of GPU memory."""
    notes = {"weft.io/gpu-memory.gpu": f"{gib}Gi"} if lease else {}
    notes.update(annotations or {})
    stage = GpuStage("gpu", host_cpu, 4 * GIB, profile or GpuProfile.constant(name, duty, gib * GIB))
    cpu_stage = (CpuContainer("cpu", cpu, cpu_gib * GIB),) if cpu else ()
    return PodSpec(name, arrival, run, cpu_stage, stage, notes)


def cpu_pod(name: str, *, arrival: float = 0.0, run: float = 3600.0, cpu: float = 8.0, gib: int = 16) -> PodSpec:
    return PodSpec(name, arrival, run, (CpuContainer("main", cpu, gib * GIB),))
