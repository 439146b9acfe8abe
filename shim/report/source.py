"""What the report asks of Prometheus, as a small protocol, and an in-package fake for tests.

:class:`Signal` names each thing the report needs per window; the Prometheus
implementation (:mod:`shim.report.prom`) turns each into one PromQL query,
and :class:`FakeSource` answers from series given to it, so the arithmetic
and the rule are tested without a server (as httpx's MockTransport does for
HTTP).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from shim.report.model import Grid, Series, Window, Workload


class Signal(enum.Enum):
    # GPUs held, per pod: weft's lease map (share of each device) and, for
    # pods weft does not lease for, the device plugin's allocation while running.
    LEASE_SHARE = "lease_share"
    LEASE_BYTES = "lease_bytes"
    PLUGIN_GPUS = "plugin_gpus"
    DEVICE_MEMORY = "device_memory"  # bytes of the GPUs dcgm-exporter attributes to each pod
    # GPUs busy, for the workload as a whole (each device counted once).
    GR_ENGINE_ACTIVE = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
    GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
    FB_USED = "fb_used"  # bytes
    CPU = "cpu"  # CPU cores in use, per node
    RESTARTS = "restarts"  # counters, per pod and container
    STARTED = "started"  # Unix time each container started, per pod and container
    LAST_TERMINATED = "last_terminated"  # Unix time the container's previous run ended, per pod and container
    CREATED = "created"  # Unix time each pod was created
    POD_NODE = "pod_node"  # 1 per pod, labelled with its node
    GPU_NODES = "gpu_nodes"  # GPUs the device plugin advertises, per node
    NODE_LABELS = "node_labels"  # 1 per node, labelled with its instance type and GPU replicas


class Source(Protocol):
    address: str

    def pods(self, workload: Workload, start: float, end: float) -> list[str]:
        """Names of the workload's pods that existed at any time in [start, end]."""
        ...

    def opt_in(self, namespace: str, pods: Sequence[str], start: float, end: float) -> float | None:
        """The first time weft recorded any of ``pods`` as opted in, within [start, end]."""
        ...

    def scrape_interval(self, namespace: str, pods: Sequence[str], at: float) -> float | None:
        """The spacing of raw samples of the pods' series just before ``at``, or None if none."""
        ...

    def series(self, signal: Signal, namespace: str, pods: Sequence[str], window: Window,
               step: float) -> list[Series]:
        """``signal`` over ``window`` at ``step``, as Prometheus' range query gives it."""
        ...


@dataclass
class FakeSource:
    """A :class:`Source` that answers from canned data; every call is recorded in ``calls``."""

    workload_pods: Sequence[str] = ()
    opt_in_at: float | None = None
    interval: float | None = 30.0
    data: Mapping[Signal, Sequence[Series]] = field(default_factory=dict)
    address: str = "fake://prometheus"
    fail: Exception | None = None
    calls: list[tuple] = field(default_factory=list)

    def _maybe_fail(self) -> None:
        if self.fail is not None:
            raise self.fail

    def pods(self, workload: Workload, start: float, end: float) -> list[str]:
        self.calls.append(("pods", workload, start, end))
        self._maybe_fail()
        return list(self.workload_pods)

    def opt_in(self, namespace: str, pods: Sequence[str], start: float, end: float) -> float | None:
        self.calls.append(("opt_in", namespace, tuple(pods), start, end))
        self._maybe_fail()
        if self.opt_in_at is None or not start <= self.opt_in_at <= end:
            return None
        return self.opt_in_at

    def scrape_interval(self, namespace: str, pods: Sequence[str], at: float) -> float | None:
        self.calls.append(("scrape_interval", namespace, tuple(pods), at))
        self._maybe_fail()
        return self.interval

    def series(self, signal: Signal, namespace: str, pods: Sequence[str], window: Window,
               step: float) -> list[Series]:
        self.calls.append(("series", signal, window.name))
        self._maybe_fail()
        out = []
        grid = Grid.of(window, step)
        for s in self.data.get(signal, ()):
            if s.get("pod") and s.get("pod") not in pods:
                continue
            points = tuple((t, v) for t, v in s.points if t in grid)
            if points:
                out.append(Series(s.labels, points))
        return out
