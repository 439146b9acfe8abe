"""CDI device names and what a CDI spec says about GPUs, parsed (no files: ``shim.cri.cdi`` reads them).

kubelet hands a container the CDI devices of its DRA claims in ``ContainerConfig.CDI_devices``, and
nothing else says they are a claim's: no annotation, no claim name. A device plugin's CDI names
identify the GPU themselves (``nvidia.com/gpu=0``, ``=all``, ``=GPU-<uuid>``); a DRA driver's do
not (``<vendor>/<class>=<claim UID>-<device>`` for a claim's own spec, as the kubelet plugin helper
advises, or a name from the driver's node-wide spec such as NVIDIA's ``k8s.gpu.nvidia.com/device=gpu-0``),
and the GPU behind one is only said by the edits of its spec: a UUID in the container's environment
(``NVIDIA_VISIBLE_DEVICES=GPU-...``, or a driver's own variable), or the GPU's device node
(``/dev/nvidia<N>``, as NVIDIA's driver writes them). So a CDI device whose name does not identify a
GPU but whose spec's own edits do is taken for a claim's device, and what its edits name (UUIDs, and
device nodes, which ``resolve`` turns into UUIDs by the broker's indices) are the claim's GPUs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

# CDI kinds of GPU vendors whose names identify the device: nvidia.com/gpu=0, amd.com/gpu=all, ...
GPU_CDI = re.compile(r"^[a-z0-9.-]+\.[a-z]+/(gpu|mig)[a-z0-9-]*=.+$")
# A GPU (or MIG instance) as NVML names it.
GPU_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Za-z][0-9A-Za-z/-]*$")
# A whole GPU's device node, by its index (the control nodes, nvidiactl and nvidia-uvm, name no GPU).
GPU_NODE = re.compile(r"^/dev/nvidia(\d+)$")


def names_gpu_itself(name: str) -> bool:
    """Whether the name alone says which GPU: a GPU vendor's kind and an index, a UUID or ``all``."""
    if not GPU_CDI.match(name):
        return False
    ident = name.split("=", 1)[1]
    return ident.isdigit() or ident == "all" or bool(GPU_UUID.match(ident))


def uuids_in_env(env: Iterable[str]) -> frozenset[str]:
    """The GPU UUIDs named by ``KEY=VALUE`` entries (a value may list several, comma-separated)."""
    found = set()
    for entry in env:
        _, _, value = str(entry).partition("=")
        found.update(v.strip() for v in value.split(",") if GPU_UUID.match(v.strip()))
    return frozenset(found)


def spec_gpus(spec: Mapping[str, Any]) -> dict[str, frozenset[str]]:
    """Qualified device name -> the GPUs its own edits name (UUIDs, and ``/dev/nvidia<N>`` paths), for one spec.

    Devices that name no GPU are left out (the spec-wide edits apply to every device, so they cannot
    tell one from another); a malformed spec gives nothing rather than an error, as a runtime skips a
    spec it cannot use.
    """
    kind = spec.get("kind")
    devices = spec.get("devices")
    if not isinstance(kind, str) or not isinstance(devices, list):
        return {}
    out: dict[str, frozenset[str]] = {}
    for dev in devices:
        if not isinstance(dev, Mapping) or not isinstance(dev.get("name"), str):
            continue
        edits = dev.get("containerEdits")
        named = uuids_in_env(_edits_env(edits)) | _gpu_nodes(edits)
        if named:
            out[f"{kind}={dev['name']}"] = named
    return out


def claim_gpus(cdi_devices: Iterable[str], known: Mapping[str, frozenset[str]]) -> dict[str, frozenset[str]]:
    """The container's CDI devices that are a DRA claim's (see the module's docstring), with their GPUs."""
    return {n: known[n] for n in cdi_devices if not names_gpu_itself(n) and known.get(n)}


def resolve(named: Iterable[str], uuid_of_index: Mapping[int, str]) -> frozenset[str]:
    """What a claim's device names, as UUIDs: a device node by this node's index; one of no GPU here stays as
    it is, so that the broker refuses it by name rather than lease another GPU."""
    out = set()
    for ident in named:
        m = GPU_NODE.match(ident)
        out.add(uuid_of_index.get(int(m.group(1)), ident) if m else ident)
    return frozenset(out)


def _gpu_nodes(edits: Any) -> frozenset[str]:
    nodes = edits.get("deviceNodes") if isinstance(edits, Mapping) else None
    if not isinstance(nodes, list):
        return frozenset()
    return frozenset(n["path"] for n in nodes
                     if isinstance(n, Mapping) and isinstance(n.get("path"), str) and GPU_NODE.match(n["path"]))


def _edits_env(edits: Any) -> list[str]:
    if not isinstance(edits, Mapping):
        return []
    env = edits.get("env")
    return [e for e in env if isinstance(e, str)] if isinstance(env, list) else []
