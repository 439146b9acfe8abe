"""The discrete-event core: pods arrive, wait, start and finish on a cluster, in one mode.

Events sit in a heap keyed by (time, kind, sequence): at one instant every
finish is handled before any arrival, so capacity freed at t is there for a
pod arriving at t. A pod that does not fit waits in arrival order; whenever
something finishes, the waiting pods are tried again, oldest first, and any
that fits starts (no head-of-line blocking, as kube-scheduler retries
unschedulable pods). Within one pass, a pod shaped exactly like one that
just failed is skipped, since nothing was freed in between; that keeps a long
queue cheap without changing any outcome.

Every decision is delegated to ``shim.core`` (see :mod:`.plan` for which
call makes which one); the engine only keeps the books those functions read
(each GPU node's devices and leases as :class:`~shim.core.packing.Held`,
each CPU node's own pods and hosted containers) and writes an event log that
the tests replay to check invariants, such as that no device ever holds more
memory than it has.

It also follows the GPU memory each stage really holds over time (its
profile's series), on the devices where that can matter: where the most the
stages on a device ever hold adds up to more than the device, or, where the
broker enforces leases (weft's modes), where a stage's series goes above its
lease. There, each change of a stage's memory is an event, and an
allocation that does not fit fails the stage that made it (out of memory):
above its own lease where leases are enforced, else beyond what the device
has left, whoever overran. A failed stage's container is restarted in place
by kubelet after its back-off, keeping its pod, node and share; the pod's
lifetime is unchanged. Elsewhere nothing can fail, and nothing is followed.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from shim.core.packing import DeviceCapacity, Held, PackDecision, pack
from shim.core.reroute import (
    ContainerFacts,
    PeerView,
    RerouteDecision,
    RerouteReason,
    Resources,
    decide,
    free_capacity,
)
from shim.sim.model import ClusterSpec, GpuProfile, Mode, PodSpec
from shim.sim.plan import Plan, plan_pod

# At one instant: finishes, then memory changes, then restarts, then arrivals.
_FINISH, _MEMORY, _RESTART, _ARRIVE = 0, 1, 2, 3
# kubelet's back-off before it restarts a container that exited: 10 s, doubling, at most 300 s, reset once the
# container has run 10 minutes (kubernetes.io, "Pod Lifecycle", container restarts).
BACKOFF_FIRST_S, BACKOFF_MAX_S, BACKOFF_RESET_S = 10.0, 300.0, 600.0
OVER_LEASE, DEVICE_FULL = "over-lease", "device-full"
# Fresh views: the simulator reads its own books, so nothing is ever stale.
_FRESH_S = 0.0
_CPU_SLACK = 1e-9  # as shim.core.reroute: cores that went through subtraction
_OVER_TOLERANCE = 1e-6  # vCPU over a CPU node's capacity that is only rounding in the books


class LogEvent(NamedTuple):
    t: float
    event: str  # pod.started, pod.finished, pod.unplaceable, lease.acquired, lease.released, container.placed,
    #             reservation.bound, reservation.deleted (hosted stages' reservation pods, in weft-reserved);
    #             out-of-memory failures are in Run.failures, and the spans a stage was down in PodRun.down
    pod: str
    container: str
    node: str
    device: str
    memory_bytes: int
    compute_percent: int
    reason: str


class Lease(NamedTuple):
    device: str  # "<node>/<uuid>"
    pod: int
    start: float
    end: float
    memory_bytes: int
    compute_percent: int


def backoff_s(failures_in_row: int) -> float:
    """kubelet's wait before it restarts a container that has exited ``failures_in_row`` times in a row."""
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** min(failures_in_row, 16))


class Failure(NamedTuple):
    """A GPU stage that ran out of memory (an allocation of its did not fit), and each restart of it right after
    that failed again at once, the same way (a crash loop is one record, not thousands)."""

    t: float  # the first failure
    pod: int
    device: str  # "<node>/<uuid>"
    memory_bytes: int  # what the stage tried to hold on that device, at the first failure
    lease_bytes: int  # its declared share there (a whole device: the device)
    cause: str  # OVER_LEASE: above its own lease, which the broker enforces; DEVICE_FULL: the device had no room
    count: int = 1  # failures in a row: the first and each restart that failed again at once

    @property
    def within_share(self) -> bool:
        """The stage asked no more than its own share: it failed because others took more than theirs."""
        return self.memory_bytes <= self.lease_bytes


class _Stage:
    """A running GPU stage whose memory is followed: where it holds leases, whether its container is up."""

    __slots__ = ("down_since", "failures_in_row", "index", "last_failure", "leases", "origin", "profile",
                 "restart_at", "up", "up_since")

    def __init__(self, index: int, origin: float, profile: GpuProfile, t: float) -> None:
        self.index, self.origin, self.profile = index, origin, profile  # series time x is t - origin
        self.leases: list[tuple[_GpuNode, int, int]] = []  # (node, device position, lease id)
        self.up, self.up_since, self.down_since, self.restart_at, self.failures_in_row = True, t, 0.0, 0.0, 0
        self.last_failure: int | None = None  # its latest record in Run.failures

    def now(self, t: float) -> tuple[int, tuple[float, int] | None]:
        """At ``t``: the memory it holds, and when it next grows (to which sample)."""
        k, since = self.profile.locate(t - self.origin)
        return self.profile.memory[k], self.after(t - since, k)

    def level(self, t: float) -> int:
        return self.profile.memory[self.profile.locate(t - self.origin)[0]]

    def after(self, begun: float, k: int) -> tuple[float, int] | None:
        """When the memory next grows after sample ``k`` (which began at ``begun``), and the sample it grows to."""
        profile = self.profile
        growths = profile.memory_growths
        if not growths:
            return None
        j = bisect_right(growths, k)
        after = growths[j] if j < len(growths) else growths[0] + profile.n
        return begun + (after - k) * profile.step_s, after % profile.n


class _GpuNode:
    __slots__ = ("books_cpu", "books_memory", "cap", "devices", "extra_cpu", "extra_memory", "index", "leases",
                 "level", "name", "next_change", "position", "residents", "risky", "used_compute", "used_count",
                 "used_exclusive", "used_memory", "version")

    def __init__(self, index: int, cluster: ClusterSpec) -> None:
        self.index, self.name, self.cap = index, f"gpu-{index:03d}", cluster.gpu_node
        self.devices = tuple(
            DeviceCapacity(f"GPU-{index:03d}-{d}", d, cluster.gpu_memory_bytes) for d in range(cluster.gpus_per_node)
        )
        self.position = {dev.uuid: i for i, dev in enumerate(self.devices)}
        self.books_cpu, self.books_memory = 0.0, 0  # what the scheduler has bound here
        self.extra_cpu, self.extra_memory = 0.0, 0  # CPU stages that fell back here beyond their booked requests
        self.leases: dict[int, Held] = {}
        # An index over the leases, so a node is offered to pack() only when
        # one of its devices has room; pack() itself still makes the choice.
        n = len(self.devices)
        self.used_memory, self.used_compute, self.used_count = [0] * n, [0] * n, [0] * n
        self.used_exclusive = [False] * n
        # GPU memory really held, per device: the stages leased there, and, on a device where an allocation can
        # fail (risky), for each lease the most it can hold now (what it held at its last growth: between growths
        # memory only falls) and its next growth (time, sample); version voids stale events.
        self.residents: list[dict[int, _Stage]] = [{} for _ in range(n)]
        self.risky = [False] * n
        self.level: list[dict[int, int]] = [{} for _ in range(n)]
        self.next_change: list[dict[int, tuple[float, int]]] = [{} for _ in range(n)]
        self.version = [0] * n

    def books_fit(self, request: Resources) -> bool:
        # Resources.fits_in's rule, unrolled: this runs for every node on every try, and a Resources per call
        # was most of the engine's time.
        return (request.cpu_cores <= self.cap.cpu_cores - self.books_cpu + _CPU_SLACK
                and request.memory_bytes <= self.cap.memory_bytes - self.books_memory)

    def may_hold(self, plan: Plan) -> bool:
        ask = plan.ask
        if ask is None:
            return True
        if not ask.shared:
            return sum(1 for c in self.used_count if c == 0) >= ask.count
        assert ask.memory_bytes is not None
        return any(
            not self.used_exclusive[i]
            and dev.memory_bytes - self.used_memory[i] >= ask.memory_bytes
            and 100 - self.used_compute[i] >= ask.compute_percent
            for i, dev in enumerate(self.devices)
        )


class _CpuNode:
    __slots__ = (
        "cap",
        "hosted_cpu",
        "hosted_memory",
        "index",
        "name",
        "own_cpu",
        "own_memory",
        "reserved_cpu",
        "reserved_memory",
        "reserves",
        "view",
    )

    def __init__(self, index: int, cluster: ClusterSpec, reserves: bool = False) -> None:
        self.index, self.name, self.cap = index, f"cpu-{index:03d}", cluster.cpu_node
        self.own_cpu, self.own_memory = 0.0, 0  # plain pods the scheduler bound here
        self.hosted_cpu, self.hosted_memory = 0.0, 0  # rerouted CPU stages, by their limits
        # Reservation pods: each hosted stage's requests as admitted, bound here, so the scheduler counts them.
        # Only where hosted stages are reserved (Mode.WEFT_RESERVED); otherwise the scheduler does not see them.
        self.reserves = reserves
        self.reserved_cpu, self.reserved_memory = 0.0, 0
        self.view: PeerView | None = None  # rebuilt after every change

    def books_fit(self, request: Resources) -> bool:
        """What the scheduler sees: the node's plain pods and its reservation pods, never a hidden shadow."""
        return (request.cpu_cores <= self.cap.cpu_cores - self.own_cpu - self.reserved_cpu + _CPU_SLACK
                and request.memory_bytes <= self.cap.memory_bytes - self.own_memory - self.reserved_memory)

    def over_cpu(self) -> float:
        """vCPU used beyond capacity: hosted stages the scheduler bound plain pods on top of.

        Rounding below ``_OVER_TOLERANCE`` (what the fit checks' own slack lets through) is not overcommit, so a
        node whose books hold every stage reads exactly 0.
        """
        excess = self.own_cpu + self.hosted_cpu - self.cap.cpu_cores
        return excess if excess > _OVER_TOLERANCE else 0.0

    def peer_view(self) -> PeerView:
        if self.view is None:
            own = Resources(self.own_cpu, self.own_memory)
            hosted = Resources(self.hosted_cpu, self.hosted_memory)
            used = Resources(self.own_cpu + self.hosted_cpu, self.own_memory + self.hosted_memory)
            self.view = PeerView(self.name, True, True, free_capacity(self.cap, own, hosted, used), _FRESH_S)
        return self.view


@dataclass
class PodRun:
    """What happened to one pod."""

    start: float | None = None
    end: float | None = None
    node: str = ""
    gpu_node: _GpuNode | None = None
    unplaceable: str = ""  # why no node of this cluster could ever take it
    leases: list[tuple[_GpuNode, int]] = field(default_factory=list)
    hosted: list[tuple[_CpuNode, Resources]] = field(default_factory=list)
    # weft-reserved: each hosted stage's reservation pod (host, container, requests as admitted)
    reservations: list[tuple[_CpuNode, str, Resources]] = field(default_factory=list)
    fallback: list[Resources] = field(default_factory=list)  # beyond the booked request, on the GPU node
    placements: list[tuple[str, str, str]] = field(default_factory=list)  # (container, where, reason)
    down: list[tuple[float, float]] = field(default_factory=list)  # GPU stage out of memory until kubelet restarts it


@dataclass
class Run:
    mode: Mode
    cluster: ClusterSpec  # the node counts actually used (grown pools report how far they grew)
    pods: Sequence[PodSpec]
    plans: list[Plan]
    outcomes: list[PodRun]
    log: list[LogEvent]
    leases: list[Lease]
    held_steps: list[tuple[float, int]]  # (time, GPUs held from then on)
    cpu_node_steps: list[tuple[float, float]]  # (time, vCPU requested on CPU nodes from then on)
    gpu_node_overcommit_cpu_s: float
    cpu_node_overcommit_cpu_s: float
    rerouted: int
    fell_back: int
    failures: list[Failure] = field(default_factory=list)


class _Simulation:
    def __init__(self, pods: Sequence[PodSpec], cluster: ClusterSpec, mode: Mode, grow_gpu: bool,
                 grow_cpu: bool) -> None:
        self.pods, self.cluster, self.mode = pods, cluster, mode
        self.grow_gpu, self.grow_cpu = grow_gpu, grow_cpu
        self.plans = [plan_pod(p, mode, cluster.gpu_memory_bytes) for p in pods]
        self.outcomes = [PodRun() for _ in pods]
        self.gpu_nodes = [_GpuNode(i, cluster) for i in range(cluster.gpu_nodes)]
        self.reserves = mode is Mode.WEFT_RESERVED
        self.cpu_nodes = [_CpuNode(i, cluster, self.reserves) for i in range(cluster.cpu_nodes)]
        self.cpu_by_name = {n.name: n for n in self.cpu_nodes}
        self.log: list[LogEvent] = []
        self.leases: list[Lease] = []
        self.lease_start: dict[tuple[int, int], tuple[int, float]] = {}  # (node, lease id) -> (pod, start)
        self.next_lease = 0
        self.held = 0
        self.held_steps: list[tuple[float, int]] = [(0.0, 0)]
        self.cpu_requested = 0.0
        self.cpu_node_steps: list[tuple[float, float]] = [(0.0, 0.0)]
        self.overcommit = {"gpu": 0.0, "cpu": 0.0}
        self.overcommit_rate = {"gpu": 0.0, "cpu": 0.0}  # vCPU over capacity right now, fleet-wide
        self.last_t = 0.0
        self.rerouted = self.fell_back = 0
        self.heap: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.stages: dict[int, _Stage] = {}
        self.failures: list[Failure] = []
        self.entries: dict[tuple[int, int], tuple[int, ...]] = {}

    # -- the loop -----------------------------------------------------------------------------------------------

    def run(self) -> Run:
        heap = self.heap
        heap[:] = [(p.arrival_s, _ARRIVE, i, i) for i, p in enumerate(self.pods)]
        heapq.heapify(heap)
        self.seq = len(self.pods)
        waiting: list[int] = []
        while heap:
            t, kind, _, what = heapq.heappop(heap)
            if kind == _MEMORY:
                node_index, pos, version = what
                node = self.gpu_nodes[node_index]
                # (Memory and restarts change none of the rates _advance integrates, so it waits for the next event.)
                if node.version[pos] == version:  # else voided by a later change on the device
                    self._memory_changes(node, pos, t)
                continue
            i = what
            assert isinstance(i, int)
            if kind == _RESTART:
                stage = self.stages.get(i)
                if stage is not None and not stage.up and stage.restart_at == t:
                    self._restart(stage, t)
                continue
            self._advance(t)
            if kind == _FINISH:
                self._finish(i, t)
                # Everything finishing at this instant first, then one pass.
                while heap and heap[0][0] == t and heap[0][1] == _FINISH:
                    self._finish(heapq.heappop(heap)[3], t)
                started = self._drain(waiting, t)
            else:
                started = [i] if self._arrive(i, t) else []
                if not started and not self.outcomes[i].unplaceable:
                    waiting.append(i)
            for j in started:
                self._push(t + self.pods[j].run_s, _FINISH, j)
        self.failures.sort(key=lambda f: (f.t, f.pod))  # where leases are enforced, each stage's came at its start
        return Run(
            self.mode, self._final_cluster(), self.pods, self.plans, self.outcomes, self.log, self.leases,
            self.held_steps, self.cpu_node_steps, self.overcommit["gpu"], self.overcommit["cpu"],
            self.rerouted, self.fell_back, self.failures,
        )

    def _push(self, t: float, kind: int, what: object) -> None:
        heapq.heappush(self.heap, (t, kind, self.seq, what))
        self.seq += 1

    def _final_cluster(self) -> ClusterSpec:
        c = self.cluster
        return ClusterSpec(len(self.gpu_nodes), c.gpus_per_node, c.gpu_memory_bytes, c.gpu_node,
                           len(self.cpu_nodes), c.cpu_node)

    def _advance(self, t: float) -> None:
        dt = t - self.last_t
        for kind in ("gpu", "cpu"):
            self.overcommit[kind] += self.overcommit_rate[kind] * dt
        self.last_t = t

    def _arrive(self, i: int, t: float) -> bool:
        plan = self.plans[i]
        if plan.error:
            return self._unplaceable(i, t, plan.error)
        if plan.needs_gpu_node and not (self.gpu_nodes or self.grow_gpu):
            return self._unplaceable(i, t, "the cluster has no GPU node")
        if not plan.needs_gpu_node and not (self.cpu_nodes or self.grow_cpu):
            return self._unplaceable(i, t, "the cluster has no CPU node (GPU nodes are tainted)")
        if not self._could_ever_fit(plan):
            return self._unplaceable(i, t, "larger than an empty node of this cluster")
        return self._try_start(i, t)

    def _unplaceable(self, i: int, t: float, why: str) -> bool:
        self.outcomes[i].unplaceable = why
        self.log.append(LogEvent(t, "pod.unplaceable", self.pods[i].name, "", "", "", 0, 0, why))
        return False

    def _could_ever_fit(self, plan: Plan) -> bool:
        c = self.cluster
        if plan.needs_gpu_node:
            whole = plan.ask is not None and not plan.ask.shared and plan.ask.count > c.gpus_per_node
            return plan.node_request.fits_in(c.gpu_node) and not whole
        return plan.node_request.fits_in(c.cpu_node)

    def _drain(self, waiting: list[int], t: float) -> list[int]:
        started: list[int] = []
        failed: set[tuple] = set()
        still: list[int] = []
        for i in waiting:
            shape = self.plans[i].shape
            if shape not in failed and self._try_start(i, t):
                started.append(i)
            else:
                failed.add(shape)
                still.append(i)
        waiting[:] = still
        return started

    # -- placing ------------------------------------------------------------------------------------------------

    def _try_start(self, i: int, t: float) -> bool:
        plan = self.plans[i]
        if plan.needs_gpu_node:
            node = self._gpu_node_for(plan)
            if node is None:
                return False
            self._start_on_gpu_node(i, node, t)
        else:
            cpu_node = next((n for n in self.cpu_nodes if n.books_fit(plan.node_request)), None)
            if cpu_node is None and self.grow_cpu:
                cpu_node = self._add_cpu_node()
            if cpu_node is None:
                return False
            self._set_cpu(cpu_node, own=plan.node_request, sign=1)
            out = self.outcomes[i]
            out.node = cpu_node.name
            out.placements = [(name, cpu_node.name, reason) for name, reason in plan.stays]
        self._started(i, t)
        return True

    def _started(self, i: int, t: float) -> None:
        out = self.outcomes[i]
        out.start = t
        self.log.append(LogEvent(t, "pod.started", self.pods[i].name, "", out.node, "", 0, 0, ""))
        for container, where, reason in out.placements:
            self.log.append(LogEvent(t, "container.placed", self.pods[i].name, container, where, "", 0, 0, reason))

    def _gpu_node_for(self, plan: Plan) -> _GpuNode | None:
        for node in self.gpu_nodes:
            if node.books_fit(plan.node_request) and node.may_hold(plan):
                return node
        if self.grow_gpu:
            node = _GpuNode(len(self.gpu_nodes), self.cluster)
            self.gpu_nodes.append(node)
            return node
        return None

    def _start_on_gpu_node(self, i: int, node: _GpuNode, t: float) -> None:
        plan, out, pod = self.plans[i], self.outcomes[i], self.pods[i]
        out.node, out.gpu_node = node.name, node
        self._set_gpu_books(node, books=plan.node_request, sign=1)
        if plan.ask is not None:
            decision = pack(plan.ask, node.devices, list(node.leases.values()))
            if not decision.ok:
                # The index said a device had room; pack() disagreeing is a bug in the index, not a full node.
                raise RuntimeError(f"pack refused {pod.name} on {node.name}: {decision.detail}")
            self._lease(i, node, plan, decision, t)
            self._stage_started(i, node, t)
        out.placements = [(name, node.name, reason) for name, reason in plan.stays]
        for name, limits, request in plan.reroutes:
            self._place_cpu_stage(i, node, name, limits, request)

    def _lease(self, i: int, node: _GpuNode, plan: Plan, decision: PackDecision, t: float) -> None:
        ask = plan.ask
        assert ask is not None
        for uuid in decision.devices:
            pos = node.position[uuid]
            memory = ask.memory_bytes if ask.shared else node.devices[pos].memory_bytes
            compute = ask.compute_percent if ask.shared else 100
            assert memory is not None
            lease_id = self.next_lease
            self.next_lease += 1
            node.leases[lease_id] = Held(uuid, memory, compute, exclusive=not ask.shared)
            if node.used_count[pos] == 0:
                self._set_held(t, +1)
            node.used_memory[pos] += memory
            node.used_compute[pos] += compute
            node.used_count[pos] += 1
            node.used_exclusive[pos] = not ask.shared
            self.outcomes[i].leases.append((node, lease_id))
            self.lease_start[(node.index, lease_id)] = (i, t)
            self.log.append(LogEvent(t, "lease.acquired", self.pods[i].name, plan.gpu_container, node.name, uuid,
                                     memory, compute, decision.reason.value))

    def _place_cpu_stage(self, i: int, node: _GpuNode, name: str, limits: Resources, request: Resources) -> None:
        out = self.outcomes[i]
        choice = self._decide(limits)
        if choice.reason is not RerouteReason.REROUTED and self.grow_cpu and limits.fits_in(self.cluster.cpu_node):
            self._add_cpu_node()
            choice = self._decide(limits)
        if choice.reason is RerouteReason.REROUTED:
            peer = self.cpu_by_name[choice.candidates[0]]
            self._set_cpu(peer, hosted=limits, sign=1)
            out.hosted.append((peer, limits))
            out.placements.append((name, peer.name, choice.reason.value))
            if peer.reserves:
                out.reservations.append((peer, name, limits))
                self.log.append(LogEvent(self.last_t, "reservation.bound", self.pods[i].name, name, peer.name, "",
                                         limits.memory_bytes, 0, f"{limits.cpu_cores:g} vCPU"))
            self.rerouted += 1
            return
        # Running locally is always the agent's fallback; beyond the request the scheduler booked, it
        # is use the GPU node's books do not show.
        extra = Resources(max(0.0, limits.cpu_cores - request.cpu_cores),
                          max(0, limits.memory_bytes - request.memory_bytes))
        self._set_gpu_books(node, extra=extra, sign=1)
        out.fallback.append(extra)
        out.placements.append((name, node.name, choice.reason.value))
        self.fell_back += 1

    def _decide(self, limits: Resources) -> RerouteDecision:
        """``reroute.decide`` over every CPU node's view, as the agent would ask it.

        Every view is fresh, healthy and a CPU host, so the only peers decide()
        rejects are those the limits do not fit; handing it just the ones that
        fit (all of them only when none does, for the exact reason) gives the
        same decision without formatting a refusal for each of hundreds of
        peers on every placement.
        """
        views = [n.peer_view() for n in self.cpu_nodes]
        fitting = [v for v in views if limits.fits_in(v.free)]
        return decide(ContainerFacts(limits=limits), limits, fitting or views)

    def _add_cpu_node(self) -> _CpuNode:
        node = _CpuNode(len(self.cpu_nodes), self.cluster, self.reserves)
        self.cpu_nodes.append(node)
        self.cpu_by_name[node.name] = node
        return node

    # -- finishing ----------------------------------------------------------------------------------------------

    def _finish(self, i: int, t: float) -> None:
        plan, out, pod = self.plans[i], self.outcomes[i], self.pods[i]
        out.end = t
        self._stage_finished(i, t)
        for node, lease_id in out.leases:
            held = node.leases.pop(lease_id)
            pos = node.position[held.device_uuid]
            node.used_memory[pos] -= held.memory_bytes
            node.used_compute[pos] -= held.compute_percent
            node.used_count[pos] -= 1
            if node.used_count[pos] == 0:
                node.used_exclusive[pos] = False
                self._set_held(t, -1)
            _, start = self.lease_start.pop((node.index, lease_id))
            device = f"{node.name}/{held.device_uuid}"
            self.leases.append(Lease(device, i, start, t, held.memory_bytes, held.compute_percent))
            self.log.append(LogEvent(t, "lease.released", pod.name, plan.gpu_container, node.name,
                                     held.device_uuid, held.memory_bytes, held.compute_percent, ""))
        for peer, limits in out.hosted:
            self._set_cpu(peer, hosted=limits, sign=-1)
        for peer, name, limits in out.reservations:
            self.log.append(LogEvent(t, "reservation.deleted", pod.name, name, peer.name, "", limits.memory_bytes,
                                     0, f"{limits.cpu_cores:g} vCPU"))
        if out.gpu_node is not None:
            self._set_gpu_books(out.gpu_node, books=plan.node_request, sign=-1)
            for extra in out.fallback:
                self._set_gpu_books(out.gpu_node, extra=extra, sign=-1)
        else:
            self._set_cpu(self.cpu_by_name[out.node], own=plan.node_request, sign=-1)
        self.log.append(LogEvent(t, "pod.finished", pod.name, "", out.node, "", 0, 0, ""))

    # -- GPU memory over time ---------------------------------------------------------------------------------------

    def _stage_started(self, i: int, node: _GpuNode, t: float) -> None:
        gpu = self.pods[i].gpu
        assert gpu is not None
        if self.mode.enforced:
            self._enforced(i, node, t)
            return
        stage = _Stage(i, t - gpu.phase_s, gpu.profile, t)
        self.stages[i] = stage
        for _, lease_id in self.outcomes[i].leases:
            pos = node.position[node.leases[lease_id].device_uuid]
            stage.leases.append((node, pos, lease_id))
            node.residents[pos][lease_id] = stage
        for _, pos, _ in stage.leases:
            self._recheck(node, pos, t, new=stage)
        self._allocate(stage, t)

    def _stage_finished(self, i: int, t: float) -> None:
        stage = self.stages.pop(i, None)
        if stage is None:
            return
        if not stage.up:
            self._down(i, stage.down_since, t)
        for node, pos, lease_id in stage.leases:
            del node.residents[pos][lease_id]
            node.level[pos].pop(lease_id, None)
            node.next_change[pos].pop(lease_id, None)
            if node.risky[pos]:
                self._recheck(node, pos, t)
                self._schedule(node, pos)

    def _enforced(self, i: int, node: _GpuNode, t: float) -> None:
        """A stage held to its lease fails by its own series alone (the leases on a device add up to no more than
        it has, and each stage holds no more than its own): its failures and the spans it is down over its pod's
        life follow from its series, its lease and kubelet's back-off, with no event and no neighbour."""
        pod, out = self.pods[i], self.outcomes[i]
        gpu = pod.gpu
        assert gpu is not None
        profile, memory = gpu.profile, gpu.profile.memory
        held = node.leases[out.leases[0][1]]  # a share is on one device; whole devices are each the device's size
        lease = held.memory_bytes
        if profile.max_memory <= lease:
            return
        key = (id(profile), lease)
        entries = self.entries.get(key)
        if entries is None:  # the samples at which the series goes above the lease
            entries = self.entries[key] = tuple(k for k in range(profile.n)
                                                if memory[k] > lease and memory[k - 1] <= lease)

        def above_from(r: float) -> tuple[float, int]:
            """Where the series is within the lease at ``r``: when it next goes above, and to which sample."""
            if not entries:
                return end, 0
            k, since = profile.locate(r - origin)
            j = bisect_right(entries, k)
            after = entries[j] if j < len(entries) else entries[0] + profile.n
            return r - since + (after - k) * profile.step_s, after % profile.n

        origin, end, device = t - gpu.phase_s, t + pod.run_s, f"{node.name}/{held.device_uuid}"
        up_since, in_row = t, 0
        first = profile.locate(gpu.phase_s)[0]
        fail, k = (t, first) if memory[first] > lease else above_from(t)
        while fail < end:
            r, count = fail, 0
            while True:  # fails, and again at each restart while its series is above its lease
                count += 1
                if r - up_since >= BACKOFF_RESET_S:
                    in_row = 0
                r, in_row = r + backoff_s(in_row), in_row + 1
                up_since = r
                if r >= end or memory[profile.locate(r - origin)[0]] <= lease:
                    break
            self.failures.append(Failure(fail, i, device, memory[k], lease, OVER_LEASE, count))
            out.down.append((fail, min(r, end)))
            if r >= end:
                break
            fail, k = above_from(r)

    def _risky(self, node: _GpuNode, pos: int) -> bool:
        """Whether an allocation on this device can ever fail with the stages on it now."""
        residents = node.residents[pos]
        return sum(s.profile.max_memory for s in residents.values()) > node.devices[pos].memory_bytes

    def _recheck(self, node: _GpuNode, pos: int, t: float, new: _Stage | None = None) -> None:
        """Follow the device's memory from ``t`` where an allocation can fail on it, and stop where none can."""
        risky = self._risky(node, pos)
        if risky and not node.risky[pos]:
            for lease_id, stage in node.residents[pos].items():
                if stage is not new and stage.up:
                    level, growth = stage.now(t)
                    node.level[pos][lease_id] = level
                    if growth is not None:
                        node.next_change[pos][lease_id] = growth
        elif not risky and node.risky[pos]:
            node.level[pos].clear()
            node.next_change[pos].clear()
        node.risky[pos] = risky

    def _overflow(self, node: _GpuNode, pos: int, lease_id: int, level: int, t: float,
                  pending: Sequence[int] = ()) -> str:
        """Why taking ``level`` with this lease at ``t`` fails on the device, or "" where it fits. ``pending``: the
        leases whose stages grow at ``t`` too but allocate after this one."""
        levels, room = node.level[pos], node.devices[pos].memory_bytes - level
        if sum(levels.values()) - levels.get(lease_id, 0) <= room:
            return ""
        # The others' bounds say it may not fit: what they hold now (which is also their bound until they grow),
        # or, for those yet to allocate at this instant, what they held just before.
        residents, growths = node.residents[pos], node.next_change[pos]
        for other in levels:
            if other != lease_id:
                stage = residents[other]
                levels[other] = (stage.profile.memory[growths[other][1] - 1] if other in pending
                                 else stage.level(t))
        return DEVICE_FULL if sum(levels.values()) - levels.get(lease_id, 0) > room else ""

    def _allocate(self, stage: _Stage, t: float) -> None:
        """The stage's container starts at ``t``: it allocates what its series holds then, on each of its devices."""
        for node, pos, lease_id in stage.leases:
            if not node.risky[pos]:
                continue
            level, growth = stage.now(t)
            cause = self._overflow(node, pos, lease_id, level, t)
            if cause:
                self._fail(stage, node, pos, lease_id, level, t, cause)
                return
            node.level[pos][lease_id] = level
            if growth is not None:
                node.next_change[pos][lease_id] = growth
        for node, pos, _ in stage.leases:
            if node.risky[pos]:
                self._schedule(node, pos)

    def _memory_changes(self, node: _GpuNode, pos: int, t: float) -> None:
        """The stages on a device whose memory grows at ``t`` allocate, in lease order (what fell at ``t`` is free)."""
        growths, levels, residents = node.next_change[pos], node.level[pos], node.residents[pos]
        due = [lease_id for lease_id, (when, _) in growths.items() if when == t]
        if len(due) > 1:
            due.sort()
        for n, lease_id in enumerate(due):
            stage = residents[lease_id]
            if not stage.up:  # failed on another of its devices at this instant
                continue
            k = growths[lease_id][1]
            level = stage.profile.memory[k]
            cause = self._overflow(node, pos, lease_id, level, t, due[n + 1:])
            following = stage.after(t, k)
            assert following is not None  # it grew, so its series has growths
            growths[lease_id] = following
            if cause:
                self._fail(stage, node, pos, lease_id, level, t, cause)
            else:
                levels[lease_id] = level
        self._schedule(node, pos)

    def _fail(self, stage: _Stage, node: _GpuNode, pos: int, lease_id: int, level: int, t: float,
              cause: str) -> None:
        """The stage's allocation failed: its container exits, freeing its memory; kubelet restarts it later."""
        i, held = stage.index, node.leases[lease_id]
        last = self.failures[stage.last_failure] if stage.last_failure is not None else None
        if (last is not None and t == stage.up_since and last.cause == cause
                and last.within_share == (level <= held.memory_bytes)):  # it failed again as it restarted
            self.failures[stage.last_failure] = last._replace(count=last.count + 1)
        else:
            stage.last_failure = len(self.failures)
            self.failures.append(Failure(t, i, f"{node.name}/{held.device_uuid}", level, held.memory_bytes, cause))
        if t - stage.up_since >= BACKOFF_RESET_S:
            stage.failures_in_row = 0
        delay = backoff_s(stage.failures_in_row)
        stage.failures_in_row += 1
        stage.up, stage.down_since, stage.restart_at = False, t, t + delay
        for other, p, other_lease in stage.leases:
            other.level[p].pop(other_lease, None)
            other.next_change[p].pop(other_lease, None)
            if other.risky[p]:
                self._schedule(other, p)
        self._push(stage.restart_at, _RESTART, i)

    def _restart(self, stage: _Stage, t: float) -> None:
        i = stage.index
        self._down(i, stage.down_since, t)
        stage.up, stage.up_since = True, t
        self._allocate(stage, t)

    def _down(self, i: int, since: float, until: float) -> None:
        """The GPU stage was down from ``since`` to ``until``: one span from a failure to the restart that held."""
        down = self.outcomes[i].down
        if down and down[-1][1] == since:  # it failed again as it restarted
            down[-1] = (down[-1][0], until)
        else:
            down.append((since, until))

    def _schedule(self, node: _GpuNode, pos: int) -> None:
        """The device's next memory change, as one event; any event scheduled for it before is void."""
        node.version[pos] += 1
        changes = node.next_change[pos]
        if changes:
            self._push(min(changes.values())[0], _MEMORY, (node.index, pos, node.version[pos]))

    # -- books that the metrics read ----------------------------------------------------------------------------

    def _set_held(self, t: float, delta: int) -> None:
        self.held += delta
        _step(self.held_steps, t, self.held)

    def _set_cpu(self, node: _CpuNode, *, own: Resources | None = None, hosted: Resources | None = None,
                 sign: int) -> None:
        before = node.over_cpu()
        if own is not None:
            node.own_cpu += sign * own.cpu_cores
            node.own_memory += sign * own.memory_bytes
            self.cpu_requested += sign * own.cpu_cores
        if hosted is not None:
            node.hosted_cpu += sign * hosted.cpu_cores
            node.hosted_memory += sign * hosted.memory_bytes
            self.cpu_requested += sign * hosted.cpu_cores
            if node.reserves:  # its reservation pod is bound and deleted with it
                node.reserved_cpu += sign * hosted.cpu_cores
                node.reserved_memory += sign * hosted.memory_bytes
        node.view = None
        after = node.over_cpu()
        if node.reserves and after:
            # The scheduler counts every reservation and the host admits by its real free capacity, so nothing
            # can be bound on top of a reserved stage; an excess here is a bug in the books, not a result.
            raise RuntimeError(f"{node.name} is {after:g} vCPU over capacity with every hosted stage reserved")
        self.overcommit_rate["cpu"] += after - before
        _step(self.cpu_node_steps, self.last_t, self.cpu_requested)

    def _set_gpu_books(self, node: _GpuNode, *, books: Resources | None = None, extra: Resources | None = None,
                       sign: int) -> None:
        before = max(0.0, node.books_cpu + node.extra_cpu - node.cap.cpu_cores)
        if books is not None:
            node.books_cpu += sign * books.cpu_cores
            node.books_memory += sign * books.memory_bytes
        if extra is not None:
            node.extra_cpu += sign * extra.cpu_cores
            node.extra_memory += sign * extra.memory_bytes
        self.overcommit_rate["gpu"] += max(0.0, node.books_cpu + node.extra_cpu - node.cap.cpu_cores) - before


V = TypeVar("V", int, float)


def _step(steps: list[tuple[float, V]], t: float, value: V) -> None:
    """A step function's value from ``t`` on: the last step replaced where it is at ``t`` already (several
    changes in one instant make one step)."""
    if steps[-1][0] == t:
        steps[-1] = (t, value)
    else:
        steps.append((t, value))


def simulate(
    pods: Sequence[PodSpec], cluster: ClusterSpec, mode: Mode, *, grow_gpu: bool = False, grow_cpu: bool = False
) -> Run:
    """Run ``pods`` on ``cluster`` in ``mode``.

    With ``grow_gpu``/``grow_cpu`` a GPU or CPU node is added whenever nothing
    fits, which is how the cluster is sized when no node counts are given:
    the grown run's :attr:`Run.cluster` says how many nodes it took.
    """
    return _Simulation(pods, cluster, mode, grow_gpu, grow_cpu).run()
