"""What the pod spec says about one container that its CRI request does not (pure).

kubelet creates a pod's containers one at a time, and a CreateContainer
request carries neither the rest of the pod nor the container's requests.
Where the agent has the API, its cache of the node's pods answers what
placement needs:

- which emptyDir volumes this container mounts and no other container of the
  pod does (init containers included): those can follow it to a host, which
  gives it a fresh one of the same ``sizeLimit``; one it shares stays here,
  and so does the container;
- whether it is an init container (they stay: they run before the pod's
  other containers, on this node, and may fill volumes for them);
- its requests, by which a host admits a container that declares no limits;
- the pod's PriorityClass, which its reservation on the host carries.

Without the API (static test nodes) none of this is known, and placement's
own rules stand: every emptyDir counts as shared, and a container without
limits stays.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shim.core.quantity import AnnotationError, parse_cpu, parse_memory
from shim.core.reroute import Resources


@dataclass(frozen=True)
class SpecFacts:
    init: bool
    requests: Resources | None  # None: the spec declares no CPU or memory request
    private_empty_dirs: dict[str, int]  # volume name -> sizeLimit bytes (0: none), only this container mounts it
    shared_empty_dirs: tuple[str, ...]  # mounted by another container of the pod too
    priority_class: str


def _quantity(parse, field: str, value: Any) -> float | int | None:
    try:
        return parse(field, str(value))
    except AnnotationError:
        return None


def _mounts(c: Mapping[str, Any]) -> set[str]:
    return {m.get("name", "") for m in c.get("volumeMounts") or []}


def spec_facts(pod: Mapping[str, Any], container: str) -> SpecFacts | None:
    """The facts of ``container`` in ``pod`` (the API's JSON); None when the pod has no such container."""
    spec = pod.get("spec") or {}
    containers = list(spec.get("containers") or [])
    inits = list(spec.get("initContainers") or [])
    mine = next((c for c in containers + inits if c.get("name") == container), None)
    if mine is None:
        return None
    empty = {v.get("name", ""): v["emptyDir"] for v in spec.get("volumes") or [] if "emptyDir" in v}
    others = set().union(*(_mounts(c) for c in containers + inits if c is not mine))
    private, shared = {}, []
    for name in sorted(_mounts(mine) & set(empty)):
        if name in others:
            shared.append(name)
        else:
            limit = (empty[name] or {}).get("sizeLimit")
            private[name] = int(_quantity(parse_memory, "sizeLimit", limit) or 0) if limit else 0
    req = (mine.get("resources") or {}).get("requests") or {}
    cpu = _quantity(parse_cpu, "requests.cpu", req["cpu"]) if "cpu" in req else None
    memory = _quantity(parse_memory, "requests.memory", req["memory"]) if "memory" in req else None
    requests = Resources(float(cpu or 0.0), int(memory or 0)) if (cpu or memory) else None
    return SpecFacts(init=mine in inits and mine not in containers, requests=requests, private_empty_dirs=private,
                     shared_empty_dirs=tuple(shared), priority_class=spec.get("priorityClassName") or "")
