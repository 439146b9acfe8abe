"""The values a report is made of: the workload, its two windows, time series, prices.

All frozen dataclasses, so the pure layers (:mod:`compute`, :mod:`verdict`,
:mod:`render`) can be tested by building them by hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# Controllers a workload may be named by, as ``kind/NAME``. Deployments own
# their pods through ReplicaSets (one per pod template, so opting in makes a
# new one); the others own their pods directly.
CONTROLLERS = {
    "deployment": "Deployment",
    "statefulset": "StatefulSet",
    "daemonset": "DaemonSet",
    "job": "Job",
    "replicaset": "ReplicaSet",
}


@dataclass(frozen=True)
class Matcher:
    """One term of a label selector: ``label=value`` or ``label!=value``."""

    label: str
    op: str  # "=" or "!="
    value: str

    def __str__(self) -> str:
        return f"{self.label}{self.op}{self.value}"


@dataclass(frozen=True)
class Workload:
    """A namespace plus either a controller (``deployment/NAME``) or a pod label selector."""

    namespace: str
    kind: str = ""  # a key of CONTROLLERS, or "" for a selector
    name: str = ""
    selector: tuple[Matcher, ...] = ()

    def __str__(self) -> str:
        if self.kind:
            return f"{self.namespace}/{self.kind}/{self.name}"
        return f"{self.namespace} pods with {','.join(map(str, self.selector))}"


@dataclass(frozen=True)
class Window:
    name: str  # "before" or "after"
    start: float  # Unix seconds
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


def ms(t: float) -> int:
    """A time or a duration in whole milliseconds, the resolution Prometheus keeps and answers in."""
    return round(t * 1000)


@dataclass(frozen=True)
class Grid:
    """The instants a range query over a window answers at, in whole milliseconds.

    A point stands for the step before it, so the first is one step after the
    window's start. Sending these exact instants and comparing what comes back
    with them (never with a float worked out apart) is what makes "this series
    was there from the window's first point" true whatever the fraction of a
    second the window starts at.
    """

    first_ms: int
    end_ms: int
    step_ms: int

    @classmethod
    def of(cls, window: Window, step: float) -> Grid:
        start, end, step_ms = ms(window.start), ms(window.end), max(1, ms(step))
        return cls(min(start + step_ms, end), end, step_ms)

    def __contains__(self, t: float) -> bool:
        return self.first_ms <= ms(t) <= self.end_ms


@dataclass(frozen=True)
class Series:
    """One series of a Prometheus answer: its labels and (Unix time, value) points in time order."""

    labels: Mapping[str, str]
    points: tuple[tuple[float, float], ...]

    def get(self, label: str) -> str:
        return self.labels.get(label, "")


@dataclass(frozen=True)
class Price:
    gpu_hour: float
    vcpu_hour: float


@dataclass(frozen=True)
class Prices:
    """Price per GPU-hour and per vCPU-hour for each node type; ``default_type`` for nodes of unknown type."""

    by_type: Mapping[str, Price] = field(default_factory=dict)
    default_type: str = ""
    currency: str = "$"

    def for_type(self, node_type: str) -> Price | None:
        # A node of a known type without a price gets none: a cost from
        # another type's price would be invented.
        return self.by_type.get(node_type or self.default_type)
