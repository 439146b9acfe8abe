"""Whether a CPU container may leave this node, and for which peer.

Four decisions, each pure so that the agent, the peer's Admit handler, the
fleet simulator and ``weft explain`` run the same rules:

* :func:`check_safety`: a container that leans on this node (privilege, host
  namespaces, host paths, devices, a volume shared with a container that stays
  here) cannot be moved without changing what it sees; nor can one without
  limits, because a peer admits by limits.
* :func:`free_capacity` and :func:`admit`: the peer's side. It hosts only what
  fits its *real* free capacity, so its own pods never lose what the scheduler
  promised them (docs/design.md).
* :func:`choose_peers`: the origin's ranking of peers from their last Hello,
  using :func:`admit` itself so both sides agree on what fits.
* :func:`decide`: the origin's overall answer for one CPU container.

Running locally is always a valid fallback (the scheduler reserved the whole
pod here), so none of these raise for policy reasons: a refusal is a decision
with a reason, and the reason's value is what crictl annotations and
``weft explain`` show.
"""

from __future__ import annotations

import enum
import hashlib
import posixpath
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import NamedTuple

from shim.core.quantity import format_bytes

KUBELET_PODS_DIR = "/var/lib/kubelet/pods"

# Cores arrive as floats that went through subtraction (4.0 - 3.7 is
# 0.2999999999999998), so an exact fit would be refused without some slack. A
# nanocore is far below the millicore that Kubernetes can express.
_CPU_SLACK = 1e-9


@dataclass(frozen=True)
class Resources:
    cpu_cores: float
    memory_bytes: int

    def minus(self, other: Resources) -> Resources:
        """The plain difference, negative where ``other`` is larger: callers clamp where that matters."""
        return Resources(self.cpu_cores - other.cpu_cores, self.memory_bytes - other.memory_bytes)

    def fits_in(self, room: Resources) -> bool:
        return self.cpu_cores <= room.cpu_cores + _CPU_SLACK and self.memory_bytes <= room.memory_bytes

    def __str__(self) -> str:
        return f"{_cores(self.cpu_cores)} CPU, {format_bytes(self.memory_bytes)}"


ZERO = Resources(0.0, 0)


def _cores(cpu: float) -> str:
    return f"{round(cpu, 3):g}"


# -- safety ----------------------------------------------------------------------


@dataclass(frozen=True)
class ContainerFacts:
    """What the safety rules read from a CreateContainer request and its sandbox."""

    privileged: bool = False
    host_network: bool = False
    host_pid: bool = False
    host_ipc: bool = False
    # Data that lives on this node and cannot follow the container: hostPath
    # volumes, and node-attached volumes (see classify_mounts).
    host_path_mounts: tuple[str, ...] = ()
    # Pod volumes this container shares with a container that stays here:
    # neither side would see the other's writes once one of them moved.
    writable_shared_mounts: tuple[str, ...] = ()
    # ConfigMap/Secret/projected/downward-API volumes, copied to the peer.
    readonly_copyable_mounts: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    limits: Resources | None = None  # None: the container declares no limits
    # What breaks the baseline Pod Security Standard (shim.core.baseline), empty when nothing does.
    beyond_baseline: str = ""


class SafetyReason(enum.Enum):
    SAFE = "safe"
    PRIVILEGED = "privileged"
    HOST_NETWORK = "host-network"
    HOST_PID = "host-pid"
    HOST_IPC = "host-ipc"
    HOST_PATH = "host-path-mount"
    SHARED_WRITABLE_VOLUME = "shared-writable-volume"
    DEVICES = "host-devices"
    # Capabilities, SELinux options, sysctls or namespaces a baseline pod may not have: a host would refuse it.
    NOT_BASELINE = "not-baseline"
    NO_LIMITS = "no-limits"  # a peer admits by limits, so without them it cannot admit safely


@dataclass(frozen=True)
class SafetyDecision:
    reason: SafetyReason
    detail: str  # names the offending flag or paths

    @property
    def safe(self) -> bool:
        return self.reason is SafetyReason.SAFE


def check_safety(facts: ContainerFacts) -> SafetyDecision:
    """The first rule the container breaks, in the order of :class:`SafetyReason`; SAFE if none."""
    flags = (
        (facts.privileged, SafetyReason.PRIVILEGED, "securityContext.privileged: true"),
        (facts.host_network, SafetyReason.HOST_NETWORK, "hostNetwork: true"),
        (facts.host_pid, SafetyReason.HOST_PID, "hostPID: true"),
        (facts.host_ipc, SafetyReason.HOST_IPC, "hostIPC: true"),
    )
    for on, reason, detail in flags:
        if on:
            return SafetyDecision(reason, detail)
    paths = (
        (facts.host_path_mounts, SafetyReason.HOST_PATH, "mounts data that stays on this node"),
        (facts.writable_shared_mounts, SafetyReason.SHARED_WRITABLE_VOLUME,
         "shares a volume with a container that stays on this node"),
        (facts.devices, SafetyReason.DEVICES, "uses host devices"),
    )
    for found, reason, what in paths:
        if found:
            return SafetyDecision(reason, f"{what}: {', '.join(found)}")
    if facts.beyond_baseline:
        return SafetyDecision(SafetyReason.NOT_BASELINE, facts.beyond_baseline)
    missing = _missing_limits(facts.limits)
    if missing:
        return SafetyDecision(SafetyReason.NO_LIMITS, f"no {missing} limit; a peer admits containers by their limits")
    return SafetyDecision(SafetyReason.SAFE, "no privilege, host namespace, host path, shared volume or device")


def _missing_limits(limits: Resources | None) -> str:
    # CRI spells "unlimited" as 0 (cpu_quota, memory_limit_in_bytes); a zero
    # would fit on every peer and then run unbounded there.
    if limits is None or (limits.cpu_cores <= 0 and limits.memory_bytes <= 0):
        return "CPU or memory"
    if limits.cpu_cores <= 0:
        return "CPU"
    if limits.memory_bytes <= 0:
        return "memory"
    return ""


_COPYABLE_VOLUMES = frozenset(
    {"kubernetes.io~configmap", "kubernetes.io~secret", "kubernetes.io~projected", "kubernetes.io~downward-api"}
)
_EMPTY_DIR = "kubernetes.io~empty-dir"


class MountSort(NamedTuple):
    host_path_mounts: tuple[str, ...]
    readonly_copyable: tuple[str, ...]
    pod_volumes: tuple[str, ...]  # emptyDirs: the caller checks which a local container also mounts


def classify_mounts(
    mounts: Iterable[tuple[str, str, bool]],
    kubelet_pods_dir: str = KUBELET_PODS_DIR,
    *,
    pod_uid: str | None = None,
) -> MountSort:
    """Sort CRI mounts, given as ``(host_path, container_path, readonly)``, by what rerouting can do with them.

    kubelet lays a pod's files out as::

        <pods dir>/<pod uid>/
            etc-hosts                                 kubelet's /etc/hosts: ignored, the peer writes its own
            containers/<container>/<id>               the termination-log file: ignored, likewise
            volumes/kubernetes.io~configmap/<vol>     \\
            volumes/kubernetes.io~secret/<vol>         | read-only: copied to the peer
            volumes/kubernetes.io~projected/<vol>      | (writable: stays on this node)
            volumes/kubernetes.io~downward-api/<vol>  /
            volumes/kubernetes.io~empty-dir/<vol>     a pod volume: the peer makes an empty one
            volumes/<other plugin>/<vol>              PVC, CSI, local volume: attached to this node
            volume-subpaths/<vol>/<container>/<n>     a subPath bind: the plugin is not in the path
        anything else                                 a hostPath volume

    Whatever cannot follow the container (hostPath, attached storage, subPath
    binds whose source is unknown) is a host path mount. An emptyDir is a pod
    volume even when mounted read-only here: an init or sidecar container
    that stays local may be what fills it. Paths are normalised first, so
    ``..`` cannot make a host path look like a pod's volume; with
    ``pod_uid``, another pod's directory is a host path too.
    """
    pods = PurePosixPath(posixpath.normpath(kubelet_pods_dir))
    host: list[str] = []
    copyable: list[str] = []
    volumes: list[str] = []
    for host_path, _container_path, readonly in mounts:
        path = PurePosixPath(posixpath.normpath(host_path)) if host_path else PurePosixPath()
        try:
            parts = path.relative_to(pods).parts
        except ValueError:
            host.append(str(path))
            continue
        kind = _pod_file_kind(parts, readonly, pod_uid)
        if kind is _Kind.COPYABLE:
            copyable.append(str(path))
        elif kind is _Kind.VOLUME:
            volumes.append(str(path))
        elif kind is _Kind.HOST:
            host.append(str(path))
    return MountSort(tuple(host), tuple(copyable), tuple(volumes))


class _Kind(enum.Enum):
    HOST = "host"
    COPYABLE = "copyable"
    VOLUME = "volume"
    KUBELET = "kubelet"


def _pod_file_kind(parts: Sequence[str], readonly: bool, pod_uid: str | None) -> _Kind:
    if len(parts) < 2 or (pod_uid is not None and parts[0] != pod_uid):
        return _Kind.HOST
    rest = parts[1:]
    if rest == ("etc-hosts",) or (len(rest) == 3 and rest[0] == "containers"):
        return _Kind.KUBELET
    if len(rest) >= 3 and rest[0] == "volumes":
        plugin = rest[1]
        if plugin in _COPYABLE_VOLUMES and readonly:
            return _Kind.COPYABLE
        if plugin == _EMPTY_DIR:
            return _Kind.VOLUME
    return _Kind.HOST


# -- capacity and admission (the peer) -------------------------------------------


def free_capacity(
    allocatable: Resources,
    own_requests: Resources,
    hosted_limits: Resources,
    measured_used: Resources,
    *,
    reserve: Resources = ZERO,
) -> Resources:
    """What a peer can host now: the smaller of what its books and what measurement leave, never negative.

    The books (allocatable minus its own pods' requests and the limits of
    what it already hosts) keep promises that are not being used at the
    moment: an idle pod will want its requests back. Measurement catches use
    the books do not show: pods bursting over their requests, daemons outside
    any pod. ``reserve`` is kept free on both sides.
    """
    books = allocatable.minus(own_requests).minus(hosted_limits).minus(reserve)
    measured = allocatable.minus(measured_used).minus(reserve)
    return Resources(
        max(0.0, min(books.cpu_cores, measured.cpu_cores)),
        max(0, min(books.memory_bytes, measured.memory_bytes)),
    )


class AdmitReason(enum.Enum):
    ADMITTED = "admitted"
    INSUFFICIENT_CPU = "insufficient-cpu"
    INSUFFICIENT_MEMORY = "insufficient-memory"
    UNHEALTHY = "unhealthy"
    NOT_A_CPU_HOST = "not-a-cpu-host"
    # The peer does not trust the origin's safety check: a zero limit is
    # "unlimited" in CRI and would fit anywhere.
    NO_LIMITS = "no-limits"
    # ``weft drain`` on the peer: it keeps what it hosts and takes nothing new.
    DRAINING = "draining"


@dataclass(frozen=True)
class AdmitDecision:
    reason: AdmitReason
    detail: str
    free_after: Resources  # the peer's free capacity once this container is counted; unchanged when refused

    @property
    def admitted(self) -> bool:
        return self.reason is AdmitReason.ADMITTED


def admit(limits: Resources, free: Resources, *, healthy: bool = True, cpu_host: bool = True,
          draining: bool = False, cordoned: bool = False) -> AdmitDecision:
    """Would this peer host a container with these limits now?

    ``draining``: ``weft drain``; ``cordoned``: its Node is unschedulable (``kubectl cordon``, ``kubectl
    drain``). Either way it takes nothing new, with the reason ``draining``.

    The limits are checked before the host (a request no peer could take says
    so), and the host's role before its health (a node that never hosts should
    not be reported as merely unwell). CPU is reported before memory when both
    are short; the detail names both.
    """
    missing = _missing_limits(limits)
    if missing:
        return AdmitDecision(AdmitReason.NO_LIMITS, f"no {missing} limit in the request", free)
    if not cpu_host:
        return AdmitDecision(AdmitReason.NOT_A_CPU_HOST, "this node's role does not include cpu", free)
    if not healthy:
        return AdmitDecision(AdmitReason.UNHEALTHY, "this node reports itself unhealthy", free)
    if draining:
        return AdmitDecision(AdmitReason.DRAINING, "this node is draining (weft drain): it takes no new containers",
                             free)
    if cordoned:
        return AdmitDecision(AdmitReason.DRAINING, "this node is cordoned (its Node is unschedulable): it takes no "
                             "new containers", free)
    cpu_short = limits.cpu_cores > free.cpu_cores + _CPU_SLACK
    memory_short = limits.memory_bytes > free.memory_bytes
    if cpu_short or memory_short:
        short = []
        if cpu_short:
            short.append(f"{_cores(limits.cpu_cores)} CPU asked, {_cores(free.cpu_cores)} free")
        if memory_short:
            short.append(f"{format_bytes(limits.memory_bytes)} memory asked, {format_bytes(free.memory_bytes)} free")
        reason = AdmitReason.INSUFFICIENT_CPU if cpu_short else AdmitReason.INSUFFICIENT_MEMORY
        return AdmitDecision(reason, "; ".join(short), free)
    after = free.minus(limits)
    # Within the CPU slack the difference can dip just below zero.
    after = Resources(max(0.0, after.cpu_cores), after.memory_bytes)
    return AdmitDecision(AdmitReason.ADMITTED, f"fits: asks {limits}; leaves {after}", after)


# -- choosing a peer (the origin) ------------------------------------------------


@dataclass(frozen=True)
class PeerView:
    """A peer as its last Hello described it."""

    node: str
    cpu_host: bool
    healthy: bool
    free: Resources
    sampled_age_s: float
    draining: bool = False


class PeerRejection(enum.Enum):
    """Why the origin will not try a peer: its view is stale, or the peer would refuse at Admit."""

    STALE = "stale"
    UNHEALTHY = AdmitReason.UNHEALTHY.value
    NOT_A_CPU_HOST = AdmitReason.NOT_A_CPU_HOST.value
    INSUFFICIENT_CPU = AdmitReason.INSUFFICIENT_CPU.value
    INSUFFICIENT_MEMORY = AdmitReason.INSUFFICIENT_MEMORY.value
    NO_LIMITS = AdmitReason.NO_LIMITS.value
    DRAINING = AdmitReason.DRAINING.value


@dataclass(frozen=True)
class PeerRanking:
    candidates: tuple[str, ...]  # in the order to try
    rejected: tuple[tuple[str, str], ...]  # (node, PeerRejection value), by node name


def draw(salt: str, node: str) -> int:
    """A number from ``salt`` and ``node`` alone: the same placement draws the same, another draws afresh."""
    return int.from_bytes(hashlib.blake2b(f"{salt}\0{node}".encode(), digest_size=8).digest(), "big")


def choose_peers(limits: Resources, peers: Iterable[PeerView], *, max_age_s: float = 30.0,
                 spread: str = "") -> PeerRanking:
    """The peers that would admit ``limits``, most room left first.

    Most free CPU after placement first, because CPU is what the rerouted
    container competes for on a host; then most free memory after; then the
    node name, so the same views in any order give the same ranking. A view
    older than ``max_age_s`` is not trusted for anything, health included.
    Admit still has the last word: the peer may have filled up since.

    With ``spread`` (the placement's own key, and the origin's name): the
    better of two fitting peers drawn by it goes first, then the rest by room
    with ties by the draw. Origins with the same views (a fleet placing at
    once) then do not all ask the same roomiest host first, fill it, and move
    on together to the next (two random choices, as load balancers do).
    """
    fits: list[tuple[float, int, str]] = []
    rejected: list[tuple[str, str]] = []
    for peer in peers:
        if peer.sampled_age_s > max_age_s:
            rejected.append((peer.node, PeerRejection.STALE.value))
            continue
        decision = admit(limits, peer.free, healthy=peer.healthy, cpu_host=peer.cpu_host, draining=peer.draining)
        if decision.admitted:
            after = decision.free_after
            fits.append((-after.cpu_cores, -after.memory_bytes, peer.node))
        else:
            rejected.append((peer.node, PeerRejection(decision.reason.value).value))
    rejected.sort()
    if not spread:
        fits.sort()
        return PeerRanking(tuple(node for _, _, node in fits), tuple(rejected))
    ranked = sorted(fits, key=lambda f: (f[0], f[1], draw(spread, f[2])))
    if len(ranked) > 2:
        two = sorted(range(len(ranked)), key=lambda i: draw(spread + "\0two", ranked[i][2]))[:2]
        first = min(two)  # the roomier of the two
        ranked.insert(0, ranked.pop(first))
    return PeerRanking(tuple(node for _, _, node in ranked), tuple(rejected))


# -- the origin's decision -------------------------------------------------------


class RerouteReason(enum.Enum):
    REROUTED = "rerouted"
    NO_PEERS = "no-peers"  # no fresh, healthy CPU host is known
    NO_PEER_FITS = "no-peer-fits"  # live CPU hosts exist, none has room
    UNSAFE = "unsafe"  # the detail starts with the SafetyReason value
    PINNED_LOCAL = "pinned-local"


@dataclass(frozen=True)
class RerouteDecision:
    reason: RerouteReason
    candidates: tuple[str, ...]  # peers to try in order when REROUTED, then run locally; empty otherwise
    detail: str


# Peers rejected for these are not live CPU hosts; any other rejection came
# from a live host's Admit rules, i.e. the container did not fit.
# A draining host counts as not live: it takes nothing new, however much room it has.
_NOT_LIVE = frozenset({PeerRejection.STALE.value, PeerRejection.UNHEALTHY.value, PeerRejection.NOT_A_CPU_HOST.value,
                       PeerRejection.DRAINING.value})


def decide(
    facts: ContainerFacts,
    limits: Resources,
    peers: Iterable[PeerView],
    *,
    pinned_local: bool = False,
    max_age_s: float = 30.0,
    spread: str = "",
) -> RerouteDecision:
    """Where a CPU container runs: the peers to try in order, or here with the reason.

    ``limits`` are what the peers are asked to admit, normally
    ``facts.limits``. Every outcome other than REROUTED means "run locally",
    and so does REROUTED once every candidate has refused at Admit.
    """
    if pinned_local:
        return RerouteDecision(RerouteReason.PINNED_LOCAL, (), "pinned to this node; not considered for rerouting")
    safety = check_safety(facts)
    if not safety.safe:
        return RerouteDecision(RerouteReason.UNSAFE, (), f"{safety.reason.value}: {safety.detail}")
    ranking = choose_peers(limits, peers, max_age_s=max_age_s, spread=spread)
    if ranking.candidates:
        return RerouteDecision(
            RerouteReason.REROUTED, ranking.candidates, f"{limits} fits on: {', '.join(ranking.candidates)}"
        )
    seen = ", ".join(f"{node} {why}" for node, why in ranking.rejected)
    if any(why not in _NOT_LIVE for _, why in ranking.rejected):
        return RerouteDecision(RerouteReason.NO_PEER_FITS, (), f"{limits} fits on no peer: {seen}")
    return RerouteDecision(RerouteReason.NO_PEERS, (), f"no live CPU host: {seen}" if seen else "no peers known")
