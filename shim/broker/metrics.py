"""The broker's metrics, with dcgm-exporter's label names so dashboards join them with DCGM.

Lease and device gauges are read from the store at scrape time (a custom
collector), so they can never drift from the leases themselves; held and
active GPU-seconds are counters the watchdog advances every tick.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shim.broker.backend import GpuDevice
from shim.state.leases import LeaseRecord

_LEASE_LABELS = ["gpu", "UUID", "pod", "namespace", "container", "lease"]


class _LeaseCollector(Collector):
    def __init__(self, service) -> None:
        self.service = service

    def collect(self) -> Iterator[GaugeMetricFamily]:
        leases = self.service.leases()
        devices = self.service.devices
        index = {d.uuid: str(d.index) for d in devices}
        lease_bytes = GaugeMetricFamily("weft_gpu_lease_bytes", "GPU memory held by each lease, per device.",
                                        labels=_LEASE_LABELS)
        for r in leases:
            for u in r.device_uuids:
                per_device = r.memory_bytes if r.shared else next(d.memory_total for d in devices if d.uuid == u)
                lease_bytes.add_metric([index.get(u, ""), u, r.pod, r.namespace, r.container, r.lease_id],
                                       per_device)
        yield lease_bytes
        memory = GaugeMetricFamily("weft_gpu_device_memory_bytes",
                                   "Total memory of each device a lease may take (a GPU, or a MIG instance).",
                                   labels=["gpu", "UUID"])
        count = GaugeMetricFamily("weft_gpu_leases", "Live leases on each GPU.", labels=["gpu", "UUID"])
        for d in devices:
            if not d.leasable:  # a MIG-enabled GPU: its instances carry its memory, so a sum counts it once
                continue
            memory.add_metric([str(d.index), d.uuid], d.memory_total)
            count.add_metric([str(d.index), d.uuid], sum(d.uuid in r.device_uuids for r in leases))
        yield memory
        yield count
        pooled = GaugeMetricFamily("weft_gpu_mps_pool_idle",
                                   "MPS control daemons started ahead for each device's next shared leases.",
                                   labels=["gpu", "UUID"])
        for uuid, idle in sorted(self.service.mps_pool().items()):
            pooled.add_metric([index.get(uuid, ""), uuid], idle)
        yield pooled


class BrokerMetrics:
    def __init__(self, service, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.registry.register(_LeaseCollector(service))
        self.held = Counter("weft_gpu_held_seconds", "GPU-seconds held by leases (a device with any lease).",
                            ["gpu", "UUID"], registry=self.registry)
        self.active = Counter("weft_gpu_active_seconds", "GPU-seconds the device was busy (utilisation x time).",
                              ["gpu", "UUID"], registry=self.registry)
        labels = ["gpu", "UUID", "pod", "namespace", "container"]
        self.lease_held = Counter("weft_gpu_lease_held_seconds", "GPU-seconds each container's lease held a device.",
                                  labels, registry=self.registry)
        self.lease_active = Counter("weft_gpu_lease_active_seconds",
                                    "GPU-seconds each container kept its device busy (its processes' SM share).",
                                    labels, registry=self.registry)
        self.violations = Counter("weft_gpu_lease_violations", "Containers seen over their GPU lease.",
                                  ["UUID", "pod", "namespace", "container", "action"], registry=self.registry)

    def account(self, leases: list[LeaseRecord], devices: list[GpuDevice], utilization: dict[str, int],
                elapsed: float, lease_busy: dict[str, int] | None = None) -> None:
        """Advance held/active seconds by ``elapsed``; ``lease_busy``: lease -> percent its processes used."""
        index = {d.uuid: str(d.index) for d in devices}
        for r in leases:
            for u in r.device_uuids:
                key = (index.get(u, ""), u, r.pod, r.namespace, r.container)
                self.lease_held.labels(*key).inc(elapsed)
                busy = (lease_busy or {}).get(r.lease_id, 0)
                if busy:
                    self.lease_active.labels(*key).inc(elapsed * min(busy, 100) / 100)
        for d in devices:
            if any(d.uuid in r.device_uuids for r in leases):
                self.held.labels(str(d.index), d.uuid).inc(elapsed)
            if utilization.get(d.uuid):
                self.active.labels(str(d.index), d.uuid).inc(elapsed * utilization[d.uuid] / 100)
