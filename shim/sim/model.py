"""The values the simulator works on: a pod's stages, its GPU behaviour over time, the cluster's shape.

Kept apart from the engine so that the trace readers, the synthetic workload
and the tests build workloads out of the same small frozen values, and the
engine never has to know where a pod came from. A pod here is only what the
model needs: when it arrives, how long it runs, its CPU-stage containers, its
GPU-stage container and that container's duty cycle and GPU memory over time
(:class:`GpuProfile`), plus the pod annotations weft reads.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from shim.core.reroute import Resources

GIB = 2**30
MIB = 2**20


class Mode(enum.Enum):
    BUNDLED = "bundled"
    WEFT = "weft"  # CPU stage declares small requests and full limits (docs/design.md)
    WEFT_FULL = "weft-full-requests"  # CPU stage requests stay at full size: the scheduler books the whole pod
    # As WEFT, and each hosted CPU stage has a reservation pod on its host with the requests it was admitted by,
    # so the host's scheduler counts it and never binds a plain pod onto that CPU (docs/design.md).
    WEFT_RESERVED = "weft-reserved"
    # KAI scheduler's GPU fractions: the pod stays bundled (the scheduler books it whole on the GPU node), its GPU
    # stage shares a GPU by its declared share, packed as weft packs, and nothing enforces the share's memory.
    KAI = "kai-fractions"

    @property
    def enforced(self) -> bool:
        """Whether a GPU stage's memory is held to its lease (weft's broker), not only to the device it is on."""
        return self in (Mode.WEFT, Mode.WEFT_FULL, Mode.WEFT_RESERVED)


# What a team declares as the CPU stage's requests when it wants the
# scheduler's books to match the split (docs/design.md): a token, not zero,
# because a request of 0 is "BestEffort" and evicted first.
SPLIT_REQUEST = Resources(0.1, 256 * MIB)


class Integrals(NamedTuple):
    busy_s: float  # duty-cycle-weighted seconds (GPU busy time of one GPU)
    zero_s: float  # seconds whose sample is exactly 0 % duty
    memory_byte_s: float  # GPU memory used, integrated over time


class GpuProfile:
    """A GPU stage's duty cycle (fraction 0..1) and GPU memory (bytes), constant within a step, replayed cyclically.

    Prefix sums make the integral over any interval O(1), so a pod that lives
    31 days costs the same as one that lives a minute.
    """

    __slots__ = ("_busy", "_memory_sum", "_zero", "duty", "max_memory", "memory", "memory_growths", "n", "name",
                 "peak_bytes", "period", "step_s")

    def __init__(
        self, name: str, step_s: float, duty: Sequence[float], memory: Sequence[int], *, peak_bytes: int | None = None
    ) -> None:
        if step_s <= 0:
            raise ValueError(f"profile {name}: step must be more than zero, got {step_s}")
        if not duty or len(duty) != len(memory):
            raise ValueError(f"profile {name}: needs as many memory samples as duty samples, at least one")
        if any(not 0.0 <= d <= 1.0 for d in duty):
            raise ValueError(f"profile {name}: duty cycle must be a fraction from 0 to 1")
        self.name, self.step_s = name, float(step_s)
        self.duty, self.memory = tuple(float(d) for d in duty), tuple(int(m) for m in memory)
        self.n = len(self.duty)
        self.period = self.n * self.step_s
        # A summary-only pod knows its peak but replays its mean: the peak
        # is kept apart so that the lease can still be sized by it.
        self.peak_bytes = max(self.memory) if peak_bytes is None else max(peak_bytes, max(self.memory))
        # What the replay really holds at most (a summary-only pod replays its mean, below its peak), and the
        # samples whose memory is more than the one before (cyclically): the only instants it allocates more.
        self.max_memory = max(self.memory)
        self.memory_growths = tuple(k for k in range(self.n) if self.memory[k] > self.memory[k - 1])
        self._busy, self._zero, self._memory_sum = [0.0], [0.0], [0.0]
        for d, m in zip(self.duty, self.memory, strict=True):
            self._busy.append(self._busy[-1] + d * self.step_s)
            self._zero.append(self._zero[-1] + (self.step_s if d == 0.0 else 0.0))
            self._memory_sum.append(self._memory_sum[-1] + m * self.step_s)

    @classmethod
    def constant(cls, name: str, duty: float, memory_bytes: int) -> GpuProfile:
        return cls(name, 60.0, (duty,), (memory_bytes,))

    def __repr__(self) -> str:
        return f"GpuProfile({self.name!r}, {self.n} x {self.step_s:g} s, duty {self.mean_duty:.3f})"

    @property
    def mean_duty(self) -> float:
        return self._busy[-1] / self.period

    @property
    def zero_fraction(self) -> float:
        return self._zero[-1] / self.period

    @property
    def mean_memory(self) -> float:
        return self._memory_sum[-1] / self.period

    def memory_quantile(self, q: float) -> int:
        """The q-quantile of the memory samples (nearest rank, so a value the pod really used)."""
        ordered = sorted(self.memory)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    def share_above(self, limit_bytes: int) -> float:
        """Share of samples whose memory is over ``limit_bytes``: how often a lease that size would be exceeded."""
        return sum(1 for m in self.memory if m > limit_bytes) / self.n

    def _position(self, x: float) -> tuple[float, int, float]:
        cycles, rest = divmod(x, self.period)
        k = min(self.n - 1, int(rest // self.step_s))
        return cycles, k, rest - k * self.step_s

    def busy_until(self, x: float) -> float:
        """Busy seconds from series time 0 to ``x`` (``x`` >= 0), wrapping around the series."""
        cycles, k, frac = self._position(x)
        return cycles * self._busy[-1] + self._busy[k] + frac * self.duty[k]

    def integrals(self, phase_s: float, seconds: float) -> Integrals:
        """What a stage does in its first ``seconds``, its series starting at ``phase_s`` when the stage starts."""
        a = self._cumulative(phase_s)
        b = self._cumulative(phase_s + seconds)
        return Integrals(b[0] - a[0], b[1] - a[1], b[2] - a[2])

    def _cumulative(self, x: float) -> tuple[float, float, float]:
        cycles, k, frac = self._position(x)
        return (
            cycles * self._busy[-1] + self._busy[k] + frac * self.duty[k],
            cycles * self._zero[-1] + self._zero[k] + (frac if self.duty[k] == 0.0 else 0.0),
            cycles * self._memory_sum[-1] + self._memory_sum[k] + frac * self.memory[k],
        )

    def duty_at(self, x: float) -> float:
        return self.duty[self._position(x)[1]]

    def locate(self, x: float) -> tuple[int, float]:
        """The sample in force at series time ``x`` and how long it has been (seconds since it began)."""
        _, k, since = self._position(x)
        return k, since


@dataclass(frozen=True)
class CpuContainer:
    """A CPU-stage container: what it needs (its limits; bundled pods request the same)."""

    name: str
    vcpu: float
    memory_bytes: int

    @property
    def need(self) -> Resources:
        return Resources(self.vcpu, self.memory_bytes)


@dataclass(frozen=True)
class GpuStage:
    """The GPU-stage container: host CPU and memory it requests, whole GPUs it asks the device plugin for,
    and what it does on the GPU (``profile`` replayed from ``phase_s`` into the series)."""

    name: str
    vcpu: float
    memory_bytes: int
    profile: GpuProfile
    gpus: int = 1
    phase_s: float = 0.0

    @property
    def host(self) -> Resources:
        return Resources(self.vcpu, self.memory_bytes)


@dataclass(frozen=True)
class PodSpec:
    name: str
    arrival_s: float
    run_s: float
    cpu: tuple[CpuContainer, ...] = ()
    gpu: GpuStage | None = None
    annotations: Mapping[str, str] = field(default_factory=dict)
    app: str = ""

    def __post_init__(self) -> None:
        if self.arrival_s < 0 or self.run_s <= 0:
            raise ValueError(f"pod {self.name}: arrival must be >= 0 and run time > 0 ({self.arrival_s}, {self.run_s})")
        if self.gpu is None and not self.cpu:
            raise ValueError(f"pod {self.name}: has no containers")

    @property
    def total_cpu(self) -> Resources:
        cpu = sum(c.vcpu for c in self.cpu) + (self.gpu.vcpu if self.gpu else 0.0)
        memory = sum(c.memory_bytes for c in self.cpu) + (self.gpu.memory_bytes if self.gpu else 0)
        return Resources(cpu, memory)


@dataclass(frozen=True)
class ClusterSpec:
    gpu_nodes: int
    gpus_per_node: int
    gpu_memory_bytes: int
    gpu_node: Resources  # vCPU and host memory of each GPU node
    cpu_nodes: int
    cpu_node: Resources

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.gpu_memory_bytes <= 0:
            raise ValueError("a GPU node needs at least one GPU with some memory")
        if self.gpu_nodes < 0 or self.cpu_nodes < 0:
            raise ValueError("node counts cannot be negative")

    @property
    def gpus(self) -> int:
        return self.gpu_nodes * self.gpus_per_node
