"""Which GPU a lease goes on: the broker's packing decision as a pure function.

The broker packs GPU shares by memory because memory is what cannot be
oversubscribed: MPS caps each client's device memory, so two shares whose
memory adds up to more than the device would make one of them fail at
allocation time. Compute is capped per client too (MPS active thread
percentage), so the shares on one device also stay within 100%.

Best fit (the fitting device with the least memory left after placing) keeps
big holes open for big asks and consolidates shares onto as few devices as
possible, which leaves whole devices free for the pods that need them. Ties
go to the lowest index so that the same state always gives the same answer:
the broker, its tests and the fleet simulator (which replays this very
function) must agree.

:func:`ffd_device_count` and :func:`lower_bound` are offline yardsticks for
``bench/packing.py``: how many devices a packer that knew every ask in advance
would use, and how many no packer could do without.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shim.core.quantity import format_bytes

FULL_COMPUTE = 100


@dataclass(frozen=True)
class DeviceCapacity:
    uuid: str
    index: int
    memory_bytes: int


@dataclass(frozen=True)
class Held:
    """An existing lease's share of one device."""

    device_uuid: str
    memory_bytes: int
    compute_percent: int
    exclusive: bool


@dataclass(frozen=True)
class Ask:
    """What one container wants.

    ``memory_bytes`` None asks for ``count`` whole devices, held exclusively;
    otherwise it is a share (MPS) of one device. ``allowed`` is the packing
    domain: the devices the pod was allocated by the device plugin, or None
    where any device on the node may be used.
    """

    memory_bytes: int | None
    compute_percent: int = FULL_COMPUTE
    count: int = 1
    allowed: frozenset[str] | None = None

    def __post_init__(self) -> None:
        # Checked at construction, so a bad ask fails where it is built (the
        # annotation parser, a test) rather than somewhere inside pack().
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ValueError(f"Ask.memory_bytes must be more than zero, got {self.memory_bytes}")
        if not 1 <= self.compute_percent <= FULL_COMPUTE:
            raise ValueError(f"Ask.compute_percent must be from 1 to 100, got {self.compute_percent}")
        if self.count < 1:
            raise ValueError(f"Ask.count must be at least 1, got {self.count}")
        if self.memory_bytes is not None and self.count != 1:
            raise ValueError(f"Ask.count must be 1 for a shared ask (one device), got {self.count}")

    @property
    def shared(self) -> bool:
        return self.memory_bytes is not None


class PackReason(enum.Enum):
    BEST_FIT = "best-fit"
    WHOLE_DEVICE = "whole-device"
    NO_DEVICE_FITS = "no-device-fits"
    NOT_ENOUGH_FREE_DEVICES = "not-enough-free-devices"
    NO_DEVICES = "no-devices"
    # The pod's allocation names only devices this node does not have: a
    # device plugin and broker that disagree, not a full node.
    NO_ALLOWED_DEVICES = "no-allowed-devices"


_PLACED = frozenset({PackReason.BEST_FIT, PackReason.WHOLE_DEVICE})


@dataclass(frozen=True)
class PackDecision:
    devices: tuple[str, ...]  # chosen UUIDs, empty when refused
    shared: bool  # a memory/compute share (MPS) rather than whole devices
    reason: PackReason
    detail: str  # one sentence for logs, crictl and `weft explain`

    @property
    def ok(self) -> bool:
        return self.reason in _PLACED


# Not frozen: a scratch record built per device on every call, where a frozen
# dataclass's slower __init__ was most of pack()'s cost in bench/packing.py.
@dataclass(slots=True)
class _Usage:
    device: DeviceCapacity
    memory_free: int
    compute_free: int
    leases: int
    exclusive: bool

    @property
    def label(self) -> str:
        return f"{self.device.uuid} (index {self.device.index})"


def pack(ask: Ask, devices: Sequence[DeviceCapacity], held: Sequence[Held]) -> PackDecision:
    """Choose the device(s) for ``ask`` given what ``held`` already occupies; never raises for a full node.

    Leases on devices not in ``devices`` are ignored: a device that vanished
    holds nothing that could collide with a new lease.
    """
    _validate_devices(devices)
    if not devices:
        return PackDecision((), ask.shared, PackReason.NO_DEVICES, "this node has no GPU devices")
    candidates = [d for d in devices if ask.allowed is None or d.uuid in ask.allowed]
    if not candidates:
        wanted = ", ".join(sorted(ask.allowed or ()))
        return PackDecision(
            (), ask.shared, PackReason.NO_ALLOWED_DEVICES,
            f"none of the pod's allocated devices ({wanted or 'none'}) is on this node",
        )
    # Sorted once so that both the choice and the wording of the detail
    # depend on the state only, never on the order the caller listed it in.
    usage = sorted(_usage(candidates, held), key=lambda u: (u.device.index, u.device.uuid))
    if ask.shared:
        return _pack_shared(ask, usage)
    return _pack_whole(ask, usage)


def _validate_devices(devices: Sequence[DeviceCapacity]) -> None:
    seen: set[str] = set()
    for d in devices:
        if d.memory_bytes <= 0:
            raise ValueError(f"device {d.uuid} has memory_bytes {d.memory_bytes}; must be more than zero")
        if d.uuid in seen:
            raise ValueError(f"device {d.uuid} is listed twice")
        seen.add(d.uuid)


def _usage(devices: Iterable[DeviceCapacity], held: Sequence[Held]) -> list[_Usage]:
    memory = {d.uuid: 0 for d in devices}
    compute = dict.fromkeys(memory, 0)
    leases = dict.fromkeys(memory, 0)
    exclusive: set[str] = set()
    for h in held:
        if h.device_uuid not in memory:
            continue
        memory[h.device_uuid] += h.memory_bytes
        compute[h.device_uuid] += h.compute_percent
        leases[h.device_uuid] += 1
        if h.exclusive:
            exclusive.add(h.device_uuid)
    return [
        _Usage(d, d.memory_bytes - memory[d.uuid], FULL_COMPUTE - compute[d.uuid], leases[d.uuid], d.uuid in exclusive)
        for d in devices
    ]


def _pack_shared(ask: Ask, usage: list[_Usage]) -> PackDecision:
    assert ask.memory_bytes is not None
    need = ask.memory_bytes
    best: _Usage | None = None
    for u in usage:
        fits = not u.exclusive and u.memory_free >= need and u.compute_free >= ask.compute_percent
        # Strictly less: on a tie the earlier (lower index) device stays.
        if fits and (best is None or u.memory_free < best.memory_free):
            best = u
    if best is not None:
        after_memory = best.memory_free - need
        after_compute = best.compute_free - ask.compute_percent
        return PackDecision(
            (best.device.uuid,), True, PackReason.BEST_FIT,
            f"best fit on {best.label}: {format_bytes(after_memory)} of {format_bytes(best.device.memory_bytes)} "
            f"free after, {after_compute}% compute free after",
        )
    return PackDecision((), True, PackReason.NO_DEVICE_FITS, _why_no_fit(ask, usage))


def _why_no_fit(ask: Ask, usage: list[_Usage]) -> str:
    assert ask.memory_bytes is not None
    want = f"{format_bytes(ask.memory_bytes)} at {ask.compute_percent}% compute"
    open_ = [u for u in usage if not u.exclusive]
    parts = [f"no device fits {want} ({len(usage)} candidate{'s' if len(usage) != 1 else ''})"]
    if open_:
        # The nearest misses, one per dimension: they say whether memory,
        # compute or both ran out, which is what a person acts on.
        most_memory = max(open_, key=lambda u: (u.memory_free, -u.device.index))
        most_compute = max(open_, key=lambda u: (u.compute_free, -u.device.index))
        parts.append(
            f"most free memory {format_bytes(most_memory.memory_free)} on {most_memory.label} "
            f"with {most_memory.compute_free}% compute free"
        )
        if most_compute is not most_memory:
            parts.append(
                f"most free compute {most_compute.compute_free}% on {most_compute.label} "
                f"with {format_bytes(most_compute.memory_free)} free"
            )
    whole = len(usage) - len(open_)
    if whole:
        parts.append(f"{whole} held whole")
    return "; ".join(parts)


def _pack_whole(ask: Ask, usage: list[_Usage]) -> PackDecision:
    free = [u for u in usage if u.leases == 0]
    if len(free) >= ask.count:
        chosen = tuple(u.device.uuid for u in free[: ask.count])
        noun = "whole device" if ask.count == 1 else "whole devices"
        return PackDecision(chosen, False, PackReason.WHOLE_DEVICE, f"{noun} {', '.join(chosen)}")
    free_names = ", ".join(u.device.uuid for u in free) or "none"
    return PackDecision(
        (), False, PackReason.NOT_ENOUGH_FREE_DEVICES,
        f"{ask.count} whole device{'s' if ask.count != 1 else ''} wanted, {len(free)} of {len(usage)} "
        f"candidates free ({free_names}); the rest hold leases",
    )


def _check_item(memory: int, compute: int, capacity_bytes: int) -> None:
    if capacity_bytes <= 0:
        raise ValueError(f"capacity_bytes must be more than zero, got {capacity_bytes}")
    if not 0 < memory <= capacity_bytes:
        raise ValueError(f"item memory {memory} is not within 1..{capacity_bytes}")
    if not 0 < compute <= FULL_COMPUTE:
        raise ValueError(f"item compute {compute} is not within 1..100")


def ffd_device_count(sizes: Sequence[tuple[int, int]], capacity_bytes: int) -> int:
    """Devices first-fit-decreasing uses for ``(memory, compute)`` items on identical devices.

    Items are sorted by their larger share of a device (memory against
    ``capacity_bytes``, compute against 100%), so an item that is big in
    either dimension is placed early; sorting by memory alone would leave
    compute-heavy, memory-light items to the end, where they fit worst, and
    make the yardstick needlessly weak. A whole device is ``(capacity, 100)``.
    """
    for memory, compute in sizes:
        _check_item(memory, compute, capacity_bytes)
    # Integer keys (scaled by capacity * 100) keep the order exact and
    # deterministic; the smaller share breaks ties.
    def share(item: tuple[int, int]) -> tuple[int, int]:
        memory, compute = item[0] * FULL_COMPUTE, item[1] * capacity_bytes
        return max(memory, compute), min(memory, compute)

    order = sorted(sizes, key=share, reverse=True)
    memory_free: list[int] = []
    compute_free: list[int] = []
    for memory, compute in order:
        for i in range(len(memory_free)):
            if memory_free[i] >= memory and compute_free[i] >= compute:
                memory_free[i] -= memory
                compute_free[i] -= compute
                break
        else:
            memory_free.append(capacity_bytes - memory)
            compute_free.append(FULL_COMPUTE - compute)
    return len(memory_free)


def lower_bound(sizes: Sequence[tuple[int, int]], capacity_bytes: int) -> int:
    """Devices no packing can do without: total memory, or total compute, over one device's worth."""
    for memory, compute in sizes:
        _check_item(memory, compute, capacity_bytes)
    total_memory = sum(m for m, _ in sizes)
    total_compute = sum(c for _, c in sizes)
    # Integer ceilings: float division would round a sum just over a device
    # down to exactly one device's worth for large byte counts.
    return max(-(-total_memory // capacity_bytes), -(-total_compute // FULL_COMPUTE))
