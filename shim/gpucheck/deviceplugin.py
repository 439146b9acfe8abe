"""What the node's GPU device plugin (or DRA driver) advertises, and whether weft can pack pods onto one GPU.

Where the device plugin hands out whole GPUs, weft packs only within the GPUs
each pod was given (the packing domain): several containers of one pod may
share a GPU, several pods may not. Packing pods needs the plugin to advertise
shared replicas (its time-slicing or MPS sharing configuration) or a DRA
driver whose claims pods share; weft then packs by memory and enforces each
lease. This reads it where a node keeps it, without the API server:
kubelet's device-manager checkpoint (the device IDs each plugin registered;
a replica's ID is ``<GPU UUID>::<n>``, a MIG instance's ``MIG-<uuid>``) and
kubelet's plugin registry (DRA drivers). It reads files only.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from shim.gpucheck.report import Check, ok, warn

CHECKPOINT = "device-plugins/kubelet_internal_checkpoint"
_GPU_RESOURCE_PREFIXES = ("nvidia.com/",)
_DRA_GPU_DRIVERS = ("gpu.nvidia.com", "compute-domain.nvidia.com")


@dataclass(frozen=True)
class Advertised:
    resource: str  # nvidia.com/gpu
    gpus: int  # physical GPUs (or MIG instances) behind it
    ids: int  # device IDs kubelet was given for them
    mig: bool = False  # its devices are MIG instances (IDs MIG-<uuid>), as a MIG strategy advertises them

    @property
    def replicas(self) -> int:
        return self.ids // self.gpus if self.gpus else 0


def read_checkpoint(kubelet_dir: Path) -> list[Advertised] | None:
    """The GPU resources in kubelet's device-manager checkpoint; None where there is none to read."""
    try:
        doc = json.loads((kubelet_dir / CHECKPOINT).read_text())
    except (OSError, ValueError):
        return None
    registered = ((doc.get("Data") or {}).get("RegisteredDevices") or {}) if isinstance(doc, dict) else {}
    out = []
    for resource, ids in sorted(registered.items()):
        if not resource.startswith(_GPU_RESOURCE_PREFIXES) or not isinstance(ids, list):
            continue
        physical = defaultdict(int)
        for device_id in ids:
            physical[str(device_id).split("::", 1)[0]] += 1
        out.append(Advertised(resource, len(physical), len(ids),
                              mig=bool(physical) and all(u.startswith("MIG-") for u in physical)))
    return out


def dra_drivers(kubelet_dir: Path) -> list[str]:
    """GPU DRA drivers registered with kubelet (their registration sockets, or their plugin directories)."""
    names = set()
    for sock in (kubelet_dir / "plugins_registry").glob("*.sock"):
        names.add(sock.name.removesuffix(".sock").removesuffix("-reg"))
    for d in (kubelet_dir / "plugins").glob("*"):
        if d.is_dir():
            names.add(d.name)
    return sorted(n for n in names if n in _DRA_GPU_DRIVERS or n.endswith(".nvidia.com"))


def checks(kubelet_dir: Path, gpus_on_node: int, instances_on_node: int = 0) -> list[Check]:
    if not kubelet_dir.is_dir():
        return [warn("device-plugin", f"no kubelet state at {kubelet_dir}: not a Kubernetes node (or kubelet keeps "
                                      "it elsewhere), so what a device plugin advertises cannot be read. weft packs "
                                      "several pods per GPU only where the plugin advertises shared replicas")]
    advertised = read_checkpoint(kubelet_dir)
    drivers = dra_drivers(kubelet_dir)
    parts, shared = [], False
    for a in advertised or []:
        unit = "MIG instance(s)" if a.mig else "GPU(s)"
        one = "MIG instance" if a.mig else "GPU"
        if a.replicas > 1:
            shared = True
            parts.append(f"{a.resource}: {a.gpus} {unit} advertised as {a.ids} ({a.replicas} replicas each, "
                         f"time-slicing or MPS sharing): weft can put up to {a.replicas} pods on one {one}, packed by "
                         f"memory, each lease enforced")
        else:
            parts.append(f"{a.resource}: {a.gpus} whole {unit}: weft packs only within the {one}s each pod was "
                         "given")
        # A MIG strategy splits instances over one resource per profile, so no one resource need name them all.
        if a.mig and a.gpus > instances_on_node:
            parts.append(f"{a.resource} names {a.gpus} MIG instance(s) but NVML shows {instances_on_node}")
        elif not a.mig and gpus_on_node and a.gpus != gpus_on_node:
            parts.append(f"{a.resource} names {a.gpus} GPU(s) but NVML shows {gpus_on_node}")
    for name in drivers:
        shared = True
        parts.append(f"DRA driver {name} is registered: pods that share a ResourceClaim share its GPUs, and weft "
                     f"packs and enforces within them")
    if not parts:
        where = "no readable device-manager checkpoint" if advertised is None else "no GPU resource registered"
        return [warn("device-plugin", f"{where} in {kubelet_dir} and no GPU DRA driver: kubelet hands out no GPUs "
                                      "here. Change: deploy the NVIDIA device plugin (with sharing replicas if pods "
                                      "are to share GPUs)")]
    if shared:
        return [ok("device-plugin", "; ".join(parts))]
    return [warn("device-plugin", "; ".join(parts) + ". Change: to pack several pods onto one GPU, give the NVIDIA "
                                  "device plugin a sharing config (sharing.timeSlicing.resources: name nvidia.com/gpu, "
                                  "replicas N); weft then packs by memory and enforces each pod's lease")]
