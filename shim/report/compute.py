"""From the series of one window to its figures: GPU-seconds held and active, memory, CPU, restarts, starts, cost.

Range queries return one point per step, so an integral is the sum of the
points times the step (the value a point carries held for the step before
it). Counting points also says how much data a window has, which is what the
verdict's minimum is stated in. Points are keyed by their time in whole
milliseconds, as Prometheus answers them, so joins and window edges are exact.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from shim.report.model import Grid, Prices, Series, Window, ms
from shim.report.source import Signal

INSTANCE_TYPE_LABEL = "label_node_kubernetes_io_instance_type"
REPLICAS_LABEL = "label_nvidia_com_gpu_replicas"  # GPU feature discovery's nvidia.com/gpu.replicas


@dataclass(frozen=True)
class Costs:
    currency: str
    held: float  # GPU cost of what was held
    active: float  # ... of the part that was busy
    idle: float  # ... of the part held but idle
    cpu_gpu_node: float
    cpu_hosts: float


@dataclass(frozen=True)
class Figures:
    """One window's measurements; None where the data to measure it was missing."""

    window: Window
    step: float
    pods: int
    held_gpu_s: float
    held_samples: int  # steps with a GPU held
    held_from: tuple[str, ...]  # "weft leases", "device plugin"
    active_gpu_s: float | None
    active_samples: int
    memory_held_bytes: float | None  # mean while a GPU was held
    memory_used_bytes: float | None
    cpu_gpu_node_s: float  # CPU-seconds on GPU nodes
    cpu_hosts_s: float  # ... on CPU-only hosts
    restarts: int
    pod_hours: float
    p95_start_s: float | None
    starts: int
    shared_fraction: float  # of held GPU-seconds, the part on leases smaller than a device
    costs: Costs | None
    notes: tuple[str, ...]
    timeline: tuple[tuple[float, float, float | None], ...]  # (t, GPUs held, GPUs active)

    @property
    def ratio(self) -> float | None:
        if self.active_gpu_s is None or self.held_gpu_s <= 0:
            return None
        return self.active_gpu_s / self.held_gpu_s

    @property
    def restarts_per_pod_hour(self) -> float | None:
        return self.restarts / self.pod_hours if self.pod_hours > 0 else None


def by_label(series: Iterable[Series], label: str) -> dict[str, dict[int, float]]:
    """Points summed per value of ``label``, keyed by their time in whole milliseconds."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for s in series:
        for t, v in s.points:
            if math.isfinite(v):
                out[s.get(label)][ms(t)] = out[s.get(label)].get(ms(t), 0.0) + v
    return out


def _total(series: Iterable[Series]) -> dict[int, float]:
    out: dict[int, float] = defaultdict(float)
    for s in series:
        for t, v in s.points:
            if math.isfinite(v):
                out[ms(t)] += v
    return dict(out)


def _per_container(series: Iterable[Series]) -> dict[tuple[str, str], dict[int, float]]:
    return {(s.get("pod"), s.get("container")): {ms(t): v for t, v in s.points} for s in series}


def counter_increase(points: Sequence[tuple[float, float]], appeared: bool) -> float:
    """Increase of a counter over its points, across resets; from zero if the series appeared in the window."""
    total = points[0][1] if appeared and points else 0.0
    for (_, a), (_, b) in itertools.pairwise(points):
        total += b - a if b >= a else b
    return total


def p95(values: Sequence[float]) -> float | None:
    """Nearest-rank 95th percentile (a value that occurred, never an interpolation)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def replica_share(node_labels: Iterable[Series]) -> dict[str, float]:
    """Of a device, what one unit of the device plugin's GPU resource is on each node that shares its GPUs.

    GPU feature discovery labels a node with the replicas its device plugin
    makes of each GPU (time-slicing or MPS); a node without the label hands
    out whole GPUs.
    """
    out = {}
    for s in node_labels:
        try:
            replicas = float(s.get(REPLICAS_LABEL))
        except ValueError:
            continue
        if replicas >= 1:
            out[s.get("node")] = 1 / replicas
    return out


def _names(pods: Iterable[str], most: int = 3) -> str:
    names = sorted(pods)
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def figures(window: Window, step: float, pods: Sequence[str], data: Mapping[Signal, Sequence[Series]],
            active: Signal | None, prices: Prices) -> Figures:
    grid = Grid.of(window, step)
    notes: list[str] = []
    lease = by_label(data.get(Signal.LEASE_SHARE, ()), "pod")
    lease_bytes = by_label(data.get(Signal.LEASE_BYTES, ()), "pod")
    plugin = by_label(data.get(Signal.PLUGIN_GPUS, ()), "pod")
    device_mem = by_label(data.get(Signal.DEVICE_MEMORY, ()), "pod")
    node_of = {s.get("pod"): s.get("node") for s in data.get(Signal.POD_NODE, ())}
    share_of = replica_share(data.get(Signal.NODE_LABELS, ()))
    times = sorted({t for m in (lease, plugin) for per in m.values() for t in per})

    held_t: dict[int, float] = {}
    held_pod: dict[str, float] = defaultdict(float)
    mem_held_t: dict[int, float] = {}
    no_memory: set[str] = set()  # pods holding device-plugin GPUs at a step where DCGM had no memory for them
    used_from: set[str] = set()
    shared_s = 0.0
    for t in times:
        total, mem, mem_known = 0.0, 0.0, True
        for pod in set(lease) | set(plugin):
            if t in lease.get(pod, {}):
                v = lease[pod][t]
                used_from.add("weft leases")
                if v < 1.0:
                    shared_s += v * step
                mem += lease_bytes.get(pod, {}).get(t, 0.0)
            else:
                # Between two leases (a container restarting) and for pods weft
                # does not lease for: what the device plugin handed out, as a
                # share of a device where it hands out replicas.
                share = share_of.get(node_of.get(pod, ""), 1.0)
                v = plugin.get(pod, {}).get(t, 0.0) * share
                if v > 0:
                    used_from.add("device plugin")
                    if share < 1.0:
                        shared_s += v * step
                    if t in device_mem.get(pod, {}):
                        mem += device_mem[pod][t] * share
                    else:
                        mem_known = False
                        no_memory.add(pod)
            total += v
            held_pod[pod] += v * step
        if total > 0:
            held_t[t] = total
            if mem_known:
                mem_held_t[t] = mem
    held_s = sum(held_t.values()) * step
    memory_held = sum(mem_held_t.values()) / len(mem_held_t) if mem_held_t else None
    if no_memory:
        where = (f"dcgm-exporter had no memory sample (DCGM_FI_DEV_FB_USED, DCGM_FI_DEV_FB_FREE) for "
                 f"{_names(no_memory)}, which held device-plugin GPUs then")
        notes.append(f"GPU memory held is the mean over {len(mem_held_t)} of {len(held_t)} steps with a GPU held: "
                     f"at the others {where}" if mem_held_t else f"GPU memory held is unknown: {where}")

    active_t = _total(data.get(active, ())) if active else {}
    active_s = sum(active_t.values()) * step if active_t else None
    used_t = _total(data.get(Signal.FB_USED, ()))
    used = [used_t[t] for t in held_t if t in used_t]
    memory_used = sum(used) / len(used) if used else None

    gpu_nodes = {s.get("node") for s in data.get(Signal.GPU_NODES, ()) if any(v > 0 for _, v in s.points)}
    if not gpu_nodes:
        # Without node capacity series, the nodes the pods were scheduled on are the GPU nodes.
        gpu_nodes = set(node_of.values())
    cpu_node: dict[str, float] = {n: sum(per.values()) * step for n, per in by_label(data.get(Signal.CPU, ()),
                                                                                       "node").items()}
    if "" in cpu_node:
        notes.append("some CPU series carry no node label; their CPU is counted on the GPU node")
    cpu_gpu = sum(v for n, v in cpu_node.items() if n in gpu_nodes or n == "")
    cpu_hosts = sum(v for n, v in cpu_node.items() if n not in gpu_nodes and n != "")

    restarts = 0.0
    for s in data.get(Signal.RESTARTS, ()):
        if s.points:
            # A series there at the window's first point was counting before it.
            restarts += counter_increase(s.points, appeared=ms(s.points[0][0]) > grid.first_ms)
    pod_points = by_label(data.get(Signal.POD_NODE, ()), "pod")
    pod_hours = sum(len(per) for per in pod_points.values()) * step / 3600
    latencies, untimed = start_latencies(window, data)
    if untimed:
        notes.append(f"{untimed} container restart(s) in the window are not timed: "
                     "kube_pod_container_status_last_terminated_timestamp (when the run before ended) is missing")

    type_of = {s.get("node"): s.get(INSTANCE_TYPE_LABEL) for s in data.get(Signal.NODE_LABELS, ())}
    costs, cost_note = _costs(held_pod, node_of, type_of, cpu_node, gpu_nodes, held_s, active_s, prices)
    if cost_note:
        notes.append(cost_note)
    timeline = tuple((t / 1000, held_t.get(t, 0.0), active_t.get(t)) for t in sorted(set(times) | set(active_t)))
    return Figures(
        window=window, step=step, pods=len(set(pod_points) & set(pods)), held_gpu_s=held_s, held_samples=len(held_t),
        held_from=tuple(sorted(used_from, reverse=True)), active_gpu_s=active_s, active_samples=len(active_t),
        memory_held_bytes=memory_held, memory_used_bytes=memory_used, cpu_gpu_node_s=cpu_gpu, cpu_hosts_s=cpu_hosts,
        restarts=round(restarts), pod_hours=pod_hours, p95_start_s=p95(latencies), starts=len(latencies),
        shared_fraction=shared_s / held_s if held_s else 0.0, costs=costs, notes=tuple(notes), timeline=timeline)


def start_latencies(window: Window, data: Mapping[Signal, Sequence[Series]]) -> tuple[list[float], int]:
    """How long each container start in the window took, and how many restarts could not be timed.

    Every value ``kube_pod_container_state_started`` takes is one start. A
    container's first start is timed from its pod's creation; a restart from
    the end of the run it replaces (so it includes kubelet's crash-loop
    back-off), read at the same point.
    """
    created = by_label(data.get(Signal.CREATED, ()), "pod")
    restarts = _per_container(data.get(Signal.RESTARTS, ()))
    ended = _per_container(data.get(Signal.LAST_TERMINATED, ()))
    latencies: list[float] = []
    untimed = 0
    for s in data.get(Signal.STARTED, ()):
        key = (s.get("pod"), s.get("container"))
        seen: set[float] = set()
        for t, started in s.points:
            if started in seen:
                continue
            seen.add(started)
            at = ms(t)
            born = created.get(key[0], {}).get(at)
            if born is None or not window.start <= started <= window.end:
                continue
            before = ended.get(key, {}).get(at)
            if restarts.get(key, {}).get(at, 0.0) == 0:
                if started >= born:
                    latencies.append(started - born)
            elif before is not None and born <= before <= started:
                latencies.append(started - before)
            else:
                untimed += 1
    return latencies, untimed


def _costs(held_pod: Mapping[str, float], node_of: Mapping[str, str], type_of: Mapping[str, str],
           cpu_node: Mapping[str, float], gpu_nodes: set[str], held_s: float, active_s: float | None,
           prices: Prices) -> tuple[Costs | None, str]:
    if not prices.by_type:
        return None, "no prices configured: add [report.prices.\"NODE TYPE\"] with gpu_hour and vcpu_hour"
    held_cost = 0.0
    for pod, seconds in held_pod.items():
        if seconds <= 0:
            continue
        node = node_of.get(pod, "")
        price = prices.for_type(type_of.get(node, ""))
        if price is None:
            return None, _no_price(node, type_of.get(node, ""), prices)
        held_cost += seconds / 3600 * price.gpu_hour
    cpu: dict[bool, float] = {True: 0.0, False: 0.0}
    for node, seconds in cpu_node.items():
        price = prices.for_type(type_of.get(node, ""))
        if price is None:
            return None, _no_price(node, type_of.get(node, ""), prices)
        # A CPU series without a node label is counted on the GPU node (above), so priced as one.
        cpu[node == "" or node in gpu_nodes] += seconds / 3600 * price.vcpu_hour
    # Busy GPU-seconds are priced at the held-weighted mean GPU price of the window.
    active = held_cost * (active_s / held_s) if active_s is not None and held_s > 0 else 0.0
    active = min(active, held_cost)
    return Costs(prices.currency, held_cost, active, held_cost - active, cpu[True], cpu[False]), ""


def _no_price(node: str, node_type: str, prices: Prices) -> str:
    if node_type:
        return (f"no price for node type {node_type!r} (node {node or '?'}): add [report.prices.\"{node_type}\"] "
                "with gpu_hour and vcpu_hour to the config; costs are left out")
    return (f"node {node or '?'} has no instance-type label in kube_node_labels and no report.default_node_type is "
            "set (or --node-type); costs are left out")
