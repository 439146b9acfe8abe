"""``weft simulate mesh``: the mesh's control plane across a fleet, in simulated time, in one process.

Every origin runs the agent's own rules from ``shim.core``: its Hello rounds
(``tracking.plan_round``, the probe rotation, ``choose_candidates`` every
round), the on-demand refresh (``refresh_order`` in batches, its budget and its
no-room hold), placement's ranking (``reroute.choose_peers``) and its Admit
loop, on views that age as its Hellos say. Every host answers Hello with its
room, and Admit and RunShadow by ``reroute.admit`` on its true room, counting a
shadow from its RunShadow on, as the host agent does. What the simulation adds are the
clocks: message delays drawn from a stated distribution, the time a shadow
takes from RunShadow to running, and when placements arrive.

Left out, on purpose: TLS and connection set-up (the agents keep connections
open), measured CPU use on hosts (a host's room is its allocatable less its
own pods' requests, as ``free_capacity`` computes when use is below them), and
everything after a shadow runs.

A scenario may also give its fleet exactly, as a real one is set up: each
host's fill, and each placement's moment and origin. ``bench/sim_validation.py``
runs the same bursts on the local fabric's real agents and here, side by side.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from shim.core import tracking
from shim.core.reroute import PeerView, Resources, admit, choose_peers
from shim.core.reroute.resources import CPU_SLACK
from shim.core.stats import percentile
from shim.core.tracking import (
    ANY_ROOM,
    BUSINESS_S,
    NO_ROOM_HOLD_S,
    REFRESH_BATCH,
    REFRESH_BUDGET_S,
    TRACKED_PEERS,
    Known,
    TrackReason,
)

GIB = 1 << 30
HELLO_TIMEOUT_S = 2.0  # the mesh client's, for Hello and Admit alike
MAX_AGE_S = 30.0  # placement's trust in a view (peer_max_age_s at the default Hello interval)
RESERVE = Resources(0.5, 512 << 20)  # what a host keeps for itself (CapacityProbe's default)
# Wire sizes of the mesh's messages with typical values (shim/_pb, serialized once): Hello request and
# answer carry a PeerState each way; Admit asks limits and answers a decision.
HELLO_BYTES = 2 * 130
ADMIT_BYTES = 60 + 40
RUN_SHADOW_BYTES = 1500 + 200  # a container config and an answer


@dataclass(frozen=True)
class Delays:
    """One-way message delay: ``base_s`` plus a lognormal of median ``median_s`` (spread ``sigma``)."""

    base_s: float = 0.0002
    median_s: float = 0.0005
    sigma: float = 0.8

    def draw(self, rng: random.Random) -> float:
        return self.base_s + rng.lognormvariate(math.log(self.median_s), self.sigma)

    def __str__(self) -> str:
        return f"{self.base_s * 1e3:g} ms + lognormal(median {self.median_s * 1e3:g} ms, sigma {self.sigma:g})"


@dataclass(frozen=True)
class Scenario:
    name: str
    hosts: int = 5000
    origins: int = 1000
    fill: float = 0.85  # the hosts' own pods' share of allocatable, on average
    fill_spread: float = 0.05  # each host's fill within fill +- this, uniformly
    host_cpu: float = 64.0
    host_memory: int = 256 * GIB
    stage: Resources = field(default_factory=lambda: Resources(1.0, 2 * GIB))
    placements: int = 2000  # a burst: at uniform times within window_s
    window_s: float = 10.0
    rate_per_s: float = 0.0  # steady churn instead of a burst: arrivals per second over window_s
    lifetime_s: float = 60.0  # churn: how long a stage runs (exponential)
    leave: float = 0.0  # this share of hosts goes away at leave_at_s and comes back at join_at_s (window time)
    leave_at_s: float = 10.0
    join_at_s: float = 25.0
    slow_hosts: int = 0  # hosts that answer every call this late
    slow_s: float = 1.5
    liars: int = 0  # hosts that claim this much more CPU in their Hellos than they have
    lie_cpu: float = 1000.0
    partition: float = 0.0  # this share of hosts unreachable from the window's start on
    warmup_s: float = 30.0
    hello_interval: float = 2.0
    create_s: float = 0.3  # RunShadow: a container made on the host (it holds its room from the start)
    delays: Delays = field(default_factory=Delays)
    # A fleet given exactly, as a real one is set up (``bench/sim_validation.py``): each host's fill in host
    # order (instead of fill +- fill_spread drawn), and each placement's (seconds into the window, origin's
    # index) (instead of ``placements`` at random times from random origins).
    fills: tuple[float, ...] = ()
    arrivals: tuple[tuple[float, int], ...] = ()
    # The key a placement's two choices are drawn by (``choose_peers(spread=...)``) names the seed too, as a real
    # pod's is new every run (its UID): each seed draws its own pairs. False: the origin and the placement's
    # number alone, the same pairs in every seed.
    keys_by_seed: bool = False

    def __post_init__(self) -> None:
        if self.fills and len(self.fills) != self.hosts:
            raise ValueError(f"scenario {self.name}: {len(self.fills)} fills for {self.hosts} hosts")
        if any(not 0.0 <= f <= 1.0 for f in self.fills):
            raise ValueError(f"scenario {self.name}: a fill outside 0..1 in {self.fills}")
        if any(at < 0 or not 0 <= i < self.origins for at, i in self.arrivals):
            raise ValueError(f"scenario {self.name}: an arrival before the window or from no origin of "
                             f"{self.origins}")


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("burst-50", fill=0.5),
    Scenario("burst-85"),
    Scenario("churn", placements=0, rate_per_s=100.0, window_s=60.0),
    Scenario("leave-join", placements=0, rate_per_s=100.0, window_s=60.0, leave=0.1),
    Scenario("slow-host", slow_hosts=50),
    Scenario("liar", liars=1),
    Scenario("partition", partition=0.5),
)}


# -- the hosts --------------------------------------------------------------------


class Host:
    def __init__(self, name: str, cap: Resources, own: Resources) -> None:
        self.name, self.cap, self.own = name, cap, own
        self.hosted_cpu, self.hosted_memory = 0.0, 0  # the shadows it made
        self.up, self.slow_s, self.lie_cpu = True, 0.0, 0.0
        self.hosted = 0  # shadows placed here in the scenario's window
        self.over = 0.0  # the most CPU it was ever committed beyond its room

    def free(self) -> Resources:
        cpu = self.cap.cpu_cores - self.own.cpu_cores - self.hosted_cpu
        memory = self.cap.memory_bytes - self.own.memory_bytes - self.hosted_memory
        self.over = max(self.over, -cpu)
        return Resources(max(0.0, cpu), max(0, memory))

    def said_free(self) -> Resources:
        """What its Hello claims."""
        f = self.free()
        return Resources(f.cpu_cores + self.lie_cpu, f.memory_bytes) if self.lie_cpu else f

    def run(self, limits: Resources) -> None:
        self.hosted_cpu += limits.cpu_cores
        self.hosted_memory += limits.memory_bytes
        self.free()

    def end(self, limits: Resources) -> None:
        self.hosted_cpu -= limits.cpu_cores
        self.hosted_memory -= limits.memory_bytes


# -- the origins ------------------------------------------------------------------


@dataclass
class Record:
    free: Resources
    seen_at: float
    healthy: bool = True


class Origin:
    """One GPU node's mesh view and placement, as ``shim.mesh.node.MeshNode`` keeps them."""

    def __init__(self, name: str, known: list[Known]) -> None:
        self.name, self.known = name, known
        self.records: dict[str, Record] = {}
        self.candidates: set[str] = set()
        self.tracked: dict[str, TrackReason] = {}
        self.cursor = ""
        self.round = 0
        self.used: dict[str, float] = {}
        self.last_need: Resources | None = None
        self.no_room: tuple[float, Resources] | None = None

    def business(self, now: float) -> set[str]:
        return {n for n, t in self.used.items() if now - t <= BUSINESS_S}

    def views(self, nodes: Iterable[str], now: float) -> list[PeerView]:
        out = []
        for n in nodes:
            rec = self.records.get(n)
            if rec is not None:
                out.append(PeerView(n, True, rec.healthy, rec.free, now - rec.seen_at))
        return sorted(out, key=lambda v: v.node)


# -- the run ----------------------------------------------------------------------

Process = Generator[float, None, None]


@dataclass
class Tally:
    admits: list[int] = field(default_factory=list)  # per placement
    latency_s: list[float] = field(default_factory=list)  # per remote placement
    remote: int = 0
    local: int = 0
    local_with_room: int = 0
    messages: dict[str, int] = field(default_factory=lambda: {"hello": 0, "admit": 0, "run_shadow": 0})
    timeouts: int = 0
    liar_admits: int = 0
    liar_last_admit_s: float = 0.0  # window time of the last Admit sent to a liar


class Fleet:
    def __init__(self, s: Scenario, seed: int = 1) -> None:
        self.s, self.seed, self.rng = s, seed, random.Random(seed)
        self.now = 0.0
        self._queue: list[tuple[float, int, Process]] = []
        self._seq = 0
        width = len(str(s.hosts))
        self.hosts = {}
        for i in range(s.hosts):
            fill = s.fills[i] if s.fills else min(1.0, max(0.0, s.fill + self.rng.uniform(-s.fill_spread,
                                                                                            s.fill_spread)))
            cap = Resources(s.host_cpu - RESERVE.cpu_cores, s.host_memory - RESERVE.memory_bytes)
            own = Resources(s.host_cpu * fill, int(s.host_memory * fill))
            name = f"cpu-{i:0{width}d}"
            self.hosts[name] = Host(name, cap, own)
        names = list(self.hosts)
        for name in self.rng.sample(names, s.slow_hosts):
            self.hosts[name].slow_s = s.slow_s
        self.liars = set(self.rng.sample(names, s.liars))
        for name in self.liars:
            self.hosts[name].lie_cpu = s.lie_cpu
        known = [Known(n, True) for n in sorted(names)]
        self.origins = [Origin(f"gpu-{i:0{len(str(s.origins))}d}", known) for i in range(s.origins)]
        self.tally = Tally()
        self.window_start = s.warmup_s
        self._placed = 0

    # -- the event loop -----------------------------------------------------------
    def spawn(self, proc: Process, at: float) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (at, self._seq, proc))

    def run_until(self, end: float) -> None:
        while self._queue and self._queue[0][0] <= end:
            at, _, proc = heapq.heappop(self._queue)
            self.now = at
            try:
                wait = next(proc)
            except StopIteration:
                continue
            self.spawn(proc, at + wait)
        self.now = end

    def _rtt(self, host: Host) -> float | None:
        """A call's round trip to ``host``; None when it does not answer (the caller waits its timeout)."""
        if not host.up:
            return None
        return self.s.delays.draw(self.rng) + self.s.delays.draw(self.rng) + host.slow_s

    # -- Hello ---------------------------------------------------------------------
    def _count(self, what: str) -> None:
        """A message sent, counted from the scenario's window on (the warm-up's Hellos are not its traffic)."""
        if self.now >= self.window_start:
            self.tally.messages[what] += 1

    def _hello(self, o: Origin, nodes: Iterable[str]) -> Process:
        """Hellos to ``nodes`` at once (16 at a time, as the agent's pool); what they tell is known once the
        batch is answered (a host that does not answer: at the timeout)."""
        sent = self.now
        took, answers, silent = 0.0, [], []
        for n in nodes:
            host = self.hosts[n]
            self._count("hello")
            rtt = self._rtt(host)
            if rtt is None or rtt > HELLO_TIMEOUT_S:
                took = max(took, HELLO_TIMEOUT_S)
                if self.now >= self.window_start:
                    self.tally.timeouts += 1
                silent.append(n)
                continue
            took = max(took, rtt)
            answers.append((n, host.said_free(), sent + rtt / 2))
        yield took
        for n, free, at in answers:
            o.records[n] = Record(free, at)
        for n in silent:
            rec = o.records.get(n)
            if rec is not None:
                rec.healthy = False

    def hello_loop(self, o: Origin) -> Process:
        every = tracking.candidate_every(self.s.hello_interval)
        o.cursor = tracking.start_cursor(o.known, o.name)
        while True:
            plan = tracking.plan_round(o.known, o.candidates, o.business(self.now), placing=True,
                                       limit=TRACKED_PEERS, cursor=o.cursor, candidates_due=o.round % every == 0)
            o.round += 1
            o.cursor = plan.cursor
            o.tracked = dict(plan.hello)
            nodes = list(plan.nodes)
            for i in range(0, len(nodes), REFRESH_BATCH):
                yield from self._hello(o, nodes[i:i + REFRESH_BATCH])
            probed = {n for n, why in plan.hello if why is TrackReason.PROBE}
            o.candidates = set(tracking.choose_candidates(o.views(o.candidates | probed, self.now),
                                                          limit=TRACKED_PEERS, max_age_s=MAX_AGE_S))
            yield self.s.hello_interval

    # -- placement -----------------------------------------------------------------
    def _refresh(self, o: Origin, need: Resources) -> Generator[float, None, None]:
        views = o.views(o.candidates | o.business(self.now), self.now)
        if tracking.fits(need, views, max_age_s=MAX_AGE_S):
            return
        held = o.no_room
        if held is not None and self.now - held[0] < NO_ROOM_HOLD_S and held[1].fits_in(need):
            return
        order = tracking.refresh_order(o.known, o.candidates | set(o.tracked), start=o.cursor)
        started, found = self.now, []
        for i in range(0, len(order), REFRESH_BATCH):
            batch = list(order[i:i + REFRESH_BATCH])
            yield from self._hello(o, batch)
            o.cursor = batch[-1]
            found = [v.node for v in o.views(batch, self.now) if tracking.fits(need, [v], max_age_s=MAX_AGE_S)]
            if found:
                o.candidates = set(tracking.choose_candidates(o.views(o.candidates | set(found), self.now),
                                                              limit=TRACKED_PEERS, max_age_s=MAX_AGE_S)) | set(found)
                o.tracked.update({n: TrackReason.REFRESH for n in found})
            if found or self.now - started > REFRESH_BUDGET_S:
                break
        o.no_room = None if found else (self.now, need)

    def place(self, o: Origin, limits: Resources, on_placed: Callable[[Host, Resources], None]) -> Process:
        t0 = self.now
        want = o.last_need or ANY_ROOM
        views = o.views(o.candidates | set(o.tracked), self.now)
        if not tracking.fits(want, views, max_age_s=MAX_AGE_S):
            yield from self._refresh(o, want)
            views = o.views(o.candidates | set(o.tracked), self.now)
        self._placed += 1
        key = f"{self.seed}/{self._placed}" if self.s.keys_by_seed else str(self._placed)
        spread = "" if tracking.small_fleet(o.known, TRACKED_PEERS) else f"{o.name}/{key}"
        ranking = choose_peers(limits, views, max_age_s=MAX_AGE_S, spread=spread)
        admits = 0
        for n in ranking.candidates:
            host = self.hosts[n]
            admits += 1
            self._count("admit")
            if n in self.liars:
                self.tally.liar_admits += 1
                self.tally.liar_last_admit_s = self.now - self.window_start
            o.last_need = limits
            rtt = self._rtt(host)
            if rtt is None or rtt > HELLO_TIMEOUT_S:
                self.tally.timeouts += 1
                yield HELLO_TIMEOUT_S
                rec = o.records.get(n)
                if rec is not None:  # the peer did not answer: unhealthy until a Hello reaches it (mesh.unreachable)
                    rec.healthy = False
                continue
            yield rtt / 2
            decision = admit(limits, host.free())
            yield rtt / 2
            if not decision.admitted:
                rec = o.records.get(n)
                if rec is not None and not tracking.small_fleet(o.known, TRACKED_PEERS):
                    o.records[n] = Record(decision.free_after, self.now)  # a refusal tells the host's room
                continue
            self._count("run_shadow")
            yield rtt / 2
            # RunShadow admits again under the lock every creation holds, and the shadow it makes counts at once.
            if not admit(limits, host.free()).admitted:
                yield rtt / 2
                continue
            host.run(limits)
            yield self.s.create_s + rtt / 2
            o.used[n] = self.now
            host.hosted += 1
            self.tally.admits.append(admits)
            self.tally.remote += 1
            self.tally.latency_s.append(self.now - t0)
            on_placed(host, limits)
            return
        self.tally.admits.append(admits)
        self.tally.local += 1
        if any(admit(limits, h.free()).admitted for h in self.hosts.values() if h.up):
            self.tally.local_with_room += 1

    def _ender(self, host: Host, limits: Resources, after: float) -> Process:
        yield after
        host.end(limits)

    def _outage(self, hosts: list[Host], at: float, back: float | None) -> Process:
        yield at
        for h in hosts:
            h.up = False
        if back is not None:
            yield back - at
            for h in hosts:
                h.up = True

    # -- a scenario ----------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        s = self.s
        for o in self.origins:  # agents started at different moments
            self.spawn(self.hello_loop(o), self.rng.uniform(0, s.hello_interval))
        start = self.window_start
        churn = s.rate_per_s > 0

        def placed(host: Host, limits: Resources) -> None:
            if churn:
                self.spawn(self._ender(host, limits, self.rng.expovariate(1 / s.lifetime_s)), self.now)

        if s.arrivals:
            for at, i in s.arrivals:
                self.spawn(self.place(self.origins[i], s.stage, placed), start + at)
        else:
            arrivals = ([start + self.rng.uniform(0, s.window_s) for _ in range(s.placements)] if not churn else
                        _poisson(self.rng, s.rate_per_s, start, start + s.window_s))
            for at in arrivals:
                self.spawn(self.place(self.rng.choice(self.origins), s.stage, placed), at)
        names = list(self.hosts)
        if s.partition:
            cut = [self.hosts[n] for n in self.rng.sample(names, int(len(names) * s.partition))]
            self.spawn(self._outage(cut, start, None), 0.0)
        if s.leave:
            gone = [self.hosts[n] for n in self.rng.sample(names, int(len(names) * s.leave))]
            self.spawn(self._outage(gone, start + s.leave_at_s, start + s.join_at_s), 0.0)
        last = max((at for at, _ in s.arrivals), default=0.0)
        end = start + max(s.window_s, last) + 30.0  # the last arrivals' placements finish
        self.run_until(end)
        return self.figures(end - start)

    def hosted(self) -> dict[str, int]:
        """The stages each host took in the window, by host name (hosts that took none left out)."""
        return {name: h.hosted for name, h in self.hosts.items() if h.hosted}

    def slots_left(self) -> int:
        """How many more stages of the scenario's size the hosts that are up have room for now."""
        stage, slots = self.s.stage, 0
        for h in self.hosts.values():
            free = h.free()
            if h.up and stage.cpu_cores > 0 and stage.memory_bytes > 0:
                slots += max(0, min(int((free.cpu_cores + CPU_SLACK) // stage.cpu_cores),
                                    free.memory_bytes // stage.memory_bytes))
        return slots

    def figures(self, seconds: float) -> dict[str, Any]:
        t = self.tally
        hosted = [h.hosted for h in self.hosts.values() if h.hosted]
        total = sum(hosted)
        mean = total / len(hosted) if hosted else 0.0
        nodes = len(self.hosts) + len(self.origins)
        msgs = sum(t.messages.values())
        wire = (t.messages["hello"] * HELLO_BYTES + t.messages["admit"] * ADMIT_BYTES
                + t.messages["run_shadow"] * RUN_SHADOW_BYTES)
        return {
            "placements": len(t.admits), "remote": t.remote, "local": t.local,
            "local_while_room": t.local_with_room,
            "admits_per_placement_mean": round(sum(t.admits) / len(t.admits), 3) if t.admits else 0.0,
            "admits_per_placement_p99": percentile(t.admits, 99, observed=True) or 0.0,
            "hosts_used": len(hosted),
            "hosted_max_over_mean": round(max(hosted) / mean, 2) if hosted else 0.0,
            "fullest_host_share": round(max(hosted) / total, 4) if hosted else 0.0,
            "hosts_overcommitted": sum(1 for h in self.hosts.values() if h.over > 1e-9),
            "overcommit_max_cpu": round(max(h.over for h in self.hosts.values()), 2),
            "messages_per_node_s": round(msgs / nodes / seconds, 3),
            "bytes_per_node_s": round(wire / nodes / seconds, 1),
            "timeouts": t.timeouts,
            "placement_p50_ms": round((percentile(t.latency_s, 50, observed=True) or 0.0) * 1e3, 1),
            "placement_p99_ms": round((percentile(t.latency_s, 99, observed=True) or 0.0) * 1e3, 1),
            "liar_admits": t.liar_admits,
            "liar_last_admit_s": round(t.liar_last_admit_s, 1),
        }


def _poisson(rng: random.Random, rate: float, start: float, end: float) -> list[float]:
    out, t = [], start
    while (t := t + rng.expovariate(rate)) < end:
        out.append(t)
    return out


def simulate(names: Iterable[str], *, hosts: int | None = None, origins: int | None = None,
             seed: int = 1) -> dict[str, dict[str, Any]]:
    """Each named scenario once (``hosts`` and ``origins`` scale it down, placements in proportion)."""
    out = {}
    for name in names:
        s = SCENARIOS[name]
        if hosts is not None or origins is not None:
            k = (origins or s.origins) / s.origins
            s = replace(s, hosts=hosts or s.hosts, origins=origins or s.origins,
                        placements=round(s.placements * k), rate_per_s=s.rate_per_s * k,
                        slow_hosts=min(s.slow_hosts, (hosts or s.hosts) // 100))
        out[name] = Fleet(s, seed).run()
    return out


_COLUMNS = (("admits_per_placement_mean", "admits/pl"), ("admits_per_placement_p99", "p99"),
            ("local_while_room", "local w/ room"), ("hosts_used", "hosts used"),
            ("hosted_max_over_mean", "max/mean"), ("fullest_host_share", "fullest"),
            ("hosts_overcommitted", "overcommitted"), ("messages_per_node_s", "msg/node/s"),
            ("bytes_per_node_s", "B/node/s"), ("placement_p50_ms", "p50 ms"), ("placement_p99_ms", "p99 ms"),
            ("timeouts", "timeouts"), ("liar_admits", "liar admits"))


def table(figures: dict[str, dict[str, Any]]) -> str:
    """The scenarios side by side, one row each."""
    head = f"{'scenario':12}" + "".join(f"{title:>15}" for _, title in _COLUMNS)
    rows = [head]
    for name, f in figures.items():
        rows.append(f"{name:12}" + "".join(f"{f[key]:>15g}" for key, _ in _COLUMNS))
    return "\n".join(rows)
