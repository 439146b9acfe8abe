"""CDI device names and what a CDI spec says about GPUs, parsed (no files: ``shim.cri.cdi`` reads them).

kubelet hands a container the CDI devices of its DRA claims in ``ContainerConfig.CDI_devices``, and
nothing else says they are a claim's: no annotation, no claim name. A device plugin's CDI names
identify the GPU themselves (``nvidia.com/gpu=0``, ``=all``, ``=GPU-<uuid>``); a DRA driver's are
opaque and unique per claim (``<vendor>/<class>=<claim UID>-<device>``, as the kubelet plugin
helper advises), and the GPU behind one is only said by the edits of its spec, which name it by
UUID in the container's environment (``NVIDIA_VISIBLE_DEVICES=GPU-...``, or a driver's own
variable). So a CDI device whose name does not identify a GPU but whose spec's edits name one is
taken for a claim's device, and the UUIDs it names are the claim's devices.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

# CDI kinds of GPU vendors whose names identify the device: nvidia.com/gpu=0, amd.com/gpu=all, ...
GPU_CDI = re.compile(r"^[a-z0-9.-]+\.[a-z]+/(gpu|mig)[a-z0-9-]*=.+$")
# A GPU (or MIG instance) as NVML names it.
GPU_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Za-z][0-9A-Za-z/-]*$")


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
    """Qualified device name -> the GPU UUIDs its own edits name, for one parsed spec.

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
        uuids = uuids_in_env(_edits_env(dev.get("containerEdits")))
        if uuids:
            out[f"{kind}={dev['name']}"] = uuids
    return out


def claim_gpus(cdi_devices: Iterable[str], known: Mapping[str, frozenset[str]]) -> dict[str, frozenset[str]]:
    """The container's CDI devices that are a DRA claim's (see the module's docstring), with their GPUs."""
    return {n: known[n] for n in cdi_devices if not names_gpu_itself(n) and known.get(n)}


def _edits_env(edits: Any) -> list[str]:
    if not isinstance(edits, Mapping):
        return []
    env = edits.get("env")
    return [e for e in env if isinstance(e, str)] if isinstance(env, list) else []
