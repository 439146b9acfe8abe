"""The broker's packing decision: best fit by memory, whole devices apart, the pod's domain respected.

Table cases pin the behaviour a person can read off; the property tests drive
random states and ask sequences against a small, obviously correct model of a
device's usage written here, separately from the module's own bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shim.core.packing import (
    Ask,
    DeviceCapacity,
    Held,
    PackDecision,
    PackReason,
    ffd_device_count,
    lower_bound,
    pack,
)

GI = 2**30
A = DeviceCapacity("GPU-a", 0, 80 * GI)
B = DeviceCapacity("GPU-b", 1, 80 * GI)
C = DeviceCapacity("GPU-c", 2, 40 * GI)


def share(device: DeviceCapacity, gib: int, compute: int = 10) -> Held:
    return Held(device.uuid, gib * GI, compute, exclusive=False)


def whole(device: DeviceCapacity) -> Held:
    return Held(device.uuid, device.memory_bytes, 100, exclusive=True)


# -- table: shared asks ----------------------------------------------------------
@pytest.mark.parametrize(
    ("ask", "devices", "held", "chosen"),
    [
        pytest.param(Ask(20 * GI, 10), [A, B], [share(B, 50)], "GPU-b", id="consolidates-onto-the-fuller-device"),
        pytest.param(Ask(20 * GI, 10), [A, B, C], [], "GPU-c", id="smallest-device-that-fits-keeps-big-ones-open"),
        pytest.param(Ask(50 * GI, 10), [A, B, C], [], "GPU-a", id="skips-a-device-too-small"),
        pytest.param(Ask(20 * GI, 10), [A, B], [], "GPU-a", id="tie-goes-to-lowest-index"),
        pytest.param(Ask(20 * GI, 10), [B, A], [], "GPU-a", id="tie-ignores-the-order-devices-are-listed"),
        pytest.param(
            Ask(20 * GI, 10), [DeviceCapacity("GPU-z", 0, 80 * GI), DeviceCapacity("GPU-a", 1, 80 * GI)], [], "GPU-z",
            id="tie-goes-by-index-not-by-uuid",
        ),
        pytest.param(Ask(30 * GI, 10), [A, B], [share(A, 50)], "GPU-a", id="exact-fit-fills-the-device"),
        pytest.param(
            Ask(10 * GI, 60), [A, B], [share(A, 50, compute=50)], "GPU-b", id="memory-fits-but-compute-does-not",
        ),
        pytest.param(
            Ask(10 * GI, 50), [A, B], [share(A, 50, compute=50)], "GPU-a", id="exactly-the-remaining-compute-fits",
        ),
        pytest.param(
            Ask(1 * GI, 1), [A, B], [Held("GPU-a", 70 * GI, 1, exclusive=True), share(B, 10)], "GPU-b",
            id="exclusive-device-never-shared-however-empty",
        ),
        pytest.param(
            Ask(10 * GI, 10, allowed=frozenset({"GPU-a"})), [A, B], [share(B, 60)], "GPU-a",
            id="tighter-device-outside-the-pods-domain-is-not-used",
        ),
        pytest.param(
            Ask(10 * GI, 10), [A, B], [share(A, 20), Held("GPU-gone", 79 * GI, 90, False)], "GPU-a",
            id="lease-on-a-vanished-device-is-ignored",
        ),
        pytest.param(
            Ask(1 * GI, 10), [A, B], [share(A, 81)], "GPU-b", id="overcommitted-device-takes-nothing-more",
        ),
    ],
)
def test_shared_ask_placed(ask: Ask, devices: list[DeviceCapacity], held: list[Held], chosen: str) -> None:
    decision = pack(ask, devices, held)
    assert decision == PackDecision((chosen,), True, PackReason.BEST_FIT, decision.detail)
    assert decision.ok and chosen in decision.detail


@pytest.mark.parametrize(
    ("ask", "devices", "held", "reason", "words"),
    [
        pytest.param(
            Ask(40 * GI, 10), [A, B], [share(A, 50), share(B, 70)], PackReason.NO_DEVICE_FITS,
            "most free memory 30Gi on GPU-a (index 0)", id="no-device-has-the-memory",
        ),
        pytest.param(
            Ask(10 * GI, 60), [A, B], [share(A, 10, 50), share(B, 10, 70)], PackReason.NO_DEVICE_FITS,
            "with 50% compute free", id="no-device-has-the-compute",
        ),
        pytest.param(
            Ask(40 * GI, 60), [A, B], [share(A, 10, 50), share(B, 50, 10)], PackReason.NO_DEVICE_FITS,
            "most free compute 90% on GPU-b (index 1) with 30Gi free", id="memory-here-compute-there",
        ),
        pytest.param(
            Ask(1 * GI, 1), [A, B], [whole(A), whole(B)], PackReason.NO_DEVICE_FITS, "2 held whole",
            id="every-device-held-whole",
        ),
        pytest.param(
            Ask(81 * GI, 10), [A, B], [], PackReason.NO_DEVICE_FITS, "no device fits 81Gi at 10% compute",
            id="larger-than-any-device",
        ),
        pytest.param(
            Ask(10 * GI, 10, allowed=frozenset({"GPU-a"})), [A, B], [share(A, 75)], PackReason.NO_DEVICE_FITS,
            "(1 candidate)", id="free-device-outside-the-domain-is-not-borrowed",
        ),
        pytest.param(
            Ask(10 * GI, 10, allowed=frozenset({"GPU-x"})), [A, B], [], PackReason.NO_ALLOWED_DEVICES, "GPU-x",
            id="domain-names-devices-this-node-lacks",
        ),
        pytest.param(
            Ask(10 * GI, 10, allowed=frozenset()), [A, B], [], PackReason.NO_ALLOWED_DEVICES, "(none)",
            id="empty-domain",
        ),
        pytest.param(Ask(10 * GI, 10), [], [], PackReason.NO_DEVICES, "no GPU devices", id="node-without-gpus"),
    ],
)
def test_shared_ask_refused(
    ask: Ask, devices: list[DeviceCapacity], held: list[Held], reason: PackReason, words: str
) -> None:
    assert_refused(ask, devices, held, reason, words, shared=True)


def assert_refused(ask: Ask, devices: list[DeviceCapacity], held: list[Held], reason: PackReason, words: str, *,
                   shared: bool) -> None:
    """``pack`` places nothing, for ``reason``, and its detail says ``words``."""
    decision = pack(ask, devices, held)
    assert (decision.devices, decision.shared, decision.reason, decision.ok) == ((), shared, reason, False)
    assert words in decision.detail


def test_best_fit_detail_says_what_is_left() -> None:
    decision = pack(Ask(20 * GI, 30), [A, B], [share(B, 40, 20)])
    assert decision.detail == "best fit on GPU-b (index 1): 20Gi of 80Gi free after, 50% compute free after"


# -- table: whole devices ----------------------------------------------------------
@pytest.mark.parametrize(
    ("ask", "devices", "held", "chosen"),
    [
        pytest.param(Ask(None), [A, B, C], [], ("GPU-a",), id="lowest-index-first"),
        pytest.param(Ask(None), [C, B, A], [], ("GPU-a",), id="lowest-index-whatever-the-listing-order"),
        pytest.param(Ask(None), [A, B, C], [share(A, 1)], ("GPU-b",), id="a-device-with-any-share-is-not-whole"),
        pytest.param(
            Ask(None), [A, B], [Held("GPU-a", 0, 0, exclusive=False)], ("GPU-b",),
            id="even-an-empty-lease-occupies-the-device",
        ),
        pytest.param(Ask(None, count=2), [A, B, C], [whole(B)], ("GPU-a", "GPU-c"), id="several-skipping-held-ones"),
        pytest.param(
            Ask(None, allowed=frozenset({"GPU-b", "GPU-c"})), [A, B, C], [], ("GPU-b",),
            id="only-within-the-pods-domain",
        ),
        pytest.param(Ask(None, count=3), [A, B, C], [], ("GPU-a", "GPU-b", "GPU-c"), id="every-device"),
    ],
)
def test_whole_ask_placed(
    ask: Ask, devices: list[DeviceCapacity], held: list[Held], chosen: tuple[str, ...]
) -> None:
    decision = pack(ask, devices, held)
    assert (decision.devices, decision.shared, decision.reason, decision.ok) == (
        chosen, False, PackReason.WHOLE_DEVICE, True,
    )


@pytest.mark.parametrize(
    ("ask", "devices", "held", "reason", "words"),
    [
        pytest.param(
            Ask(None, count=2), [A, B], [share(A, 1)], PackReason.NOT_ENOUGH_FREE_DEVICES,
            "2 whole devices wanted, 1 of 2 candidates free (GPU-b)", id="one-short",
        ),
        pytest.param(
            Ask(None), [A, B], [share(A, 1), whole(B)], PackReason.NOT_ENOUGH_FREE_DEVICES,
            "0 of 2 candidates free (none)", id="every-device-in-use",
        ),
        pytest.param(
            Ask(None, allowed=frozenset({"GPU-a"})), [A, B], [share(A, 1)], PackReason.NOT_ENOUGH_FREE_DEVICES,
            "0 of 1 candidates free", id="free-device-outside-the-domain-is-not-borrowed",
        ),
        pytest.param(Ask(None, count=4), [A, B, C], [], PackReason.NOT_ENOUGH_FREE_DEVICES, "3 candidates",
                     id="more-than-the-node-has"),
        pytest.param(Ask(None), [], [], PackReason.NO_DEVICES, "no GPU devices", id="node-without-gpus"),
    ],
)
def test_whole_ask_refused(
    ask: Ask, devices: list[DeviceCapacity], held: list[Held], reason: PackReason, words: str
) -> None:
    assert_refused(ask, devices, held, reason, words, shared=False)


# -- table: bad input --------------------------------------------------------------
@pytest.mark.parametrize(
    ("build", "words"),
    [
        pytest.param(lambda: Ask(0), "memory_bytes must be more than zero", id="zero-memory"),
        pytest.param(lambda: Ask(-GI), "memory_bytes must be more than zero", id="negative-memory"),
        pytest.param(lambda: Ask(GI, 0), "compute_percent must be from 1 to 100", id="zero-compute"),
        pytest.param(lambda: Ask(GI, 101), "compute_percent must be from 1 to 100", id="compute-over-100"),
        pytest.param(lambda: Ask(None, count=0), "count must be at least 1", id="zero-whole-devices"),
        pytest.param(lambda: Ask(GI, 10, count=2), "count must be 1 for a shared ask", id="shared-over-two-devices"),
        pytest.param(lambda: pack(Ask(GI), [A, A], []), "GPU-a is listed twice", id="duplicate-device"),
        pytest.param(
            lambda: pack(Ask(GI), [DeviceCapacity("GPU-0", 0, 0)], []), "must be more than zero",
            id="device-without-memory",
        ),
        pytest.param(lambda: ffd_device_count([(81 * GI, 10)], 80 * GI), "not within", id="ffd-item-too-big"),
        pytest.param(lambda: ffd_device_count([(GI, 0)], 80 * GI), "not within 1..100", id="ffd-zero-compute"),
        pytest.param(lambda: lower_bound([(GI, 101)], 80 * GI), "not within 1..100", id="bound-compute-over-100"),
        pytest.param(lambda: lower_bound([(GI, 10)], 0), "capacity_bytes", id="bound-zero-capacity"),
    ],
)
def test_bad_input_raises_value_error(build: object, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(".", r"\.")):
        build()  # type: ignore[operator]


# -- table: offline yardsticks -------------------------------------------------------
@pytest.mark.parametrize(
    ("sizes", "ffd", "bound"),
    [
        pytest.param([], 0, 0, id="nothing-needs-no-device"),
        pytest.param([(40 * GI, 50)] * 4, 2, 2, id="halves-pair-up"),
        pytest.param([(GI, 50)] * 4, 2, 2, id="compute-binds-when-memory-is-small"),
        pytest.param([(70 * GI, 10), (10 * GI, 90)], 1, 1, id="complementary-shares-share-a-device"),
        pytest.param([(41 * GI, 10)] * 3, 3, 2, id="just-over-half-cannot-pair"),
        pytest.param([(80 * GI, 100)] * 3, 3, 3, id="whole-devices-one-each"),
        pytest.param([(80 * GI, 1), (1, 1)], 2, 2, id="one-byte-more-than-a-device-needs-two"),
        pytest.param(
            [(30 * GI, 10), (30 * GI, 10), (50 * GI, 10), (50 * GI, 10)], 2, 2,
            id="decreasing-order-pairs-each-big-item-with-a-small-one",
        ),
        pytest.param(
            [(5 * GI, 90), (70 * GI, 10), (70 * GI, 10), (5 * GI, 90)], 2, 2,
            id="compute-heavy-items-count-as-big",
        ),
    ],
)
def test_offline_yardsticks(sizes: list[tuple[int, int]], ffd: int, bound: int) -> None:
    assert ffd_device_count(sizes, 80 * GI) == ffd
    assert lower_bound(sizes, 80 * GI) == bound


# -- properties ----------------------------------------------------------------------
# Small integers rather than GiB: exact fits and ties, where bugs live, then
# come up often.
@dataclass
class Model:
    devices: list[DeviceCapacity]
    held: list[Held]

    def used(self, uuid: str) -> tuple[int, int, int, bool]:
        mine = [h for h in self.held if h.device_uuid == uuid]
        return (sum(h.memory_bytes for h in mine), sum(h.compute_percent for h in mine), len(mine),
                any(h.exclusive for h in mine))

    def candidates(self, ask: Ask) -> list[DeviceCapacity]:
        return [d for d in self.devices if ask.allowed is None or d.uuid in ask.allowed]

    def fitting(self, ask: Ask) -> list[DeviceCapacity]:
        assert ask.memory_bytes is not None
        out = []
        for d in self.candidates(ask):
            memory, compute, _, exclusive = self.used(d.uuid)
            if not exclusive and d.memory_bytes - memory >= ask.memory_bytes and 100 - compute >= ask.compute_percent:
                out.append(d)
        return out

    def leftover(self, d: DeviceCapacity, ask: Ask) -> int:
        assert ask.memory_bytes is not None
        return d.memory_bytes - self.used(d.uuid)[0] - ask.memory_bytes

    def apply(self, ask: Ask, decision: PackDecision) -> None:
        by_uuid = {d.uuid: d for d in self.devices}
        for uuid in decision.devices:
            if decision.shared:
                assert ask.memory_bytes is not None
                self.held.append(Held(uuid, ask.memory_bytes, ask.compute_percent, exclusive=False))
            else:
                self.held.append(Held(uuid, by_uuid[uuid].memory_bytes, 100, exclusive=True))

    def assert_feasible(self) -> None:
        for d in self.devices:
            memory, compute, leases, exclusive = self.used(d.uuid)
            assert memory <= d.memory_bytes, f"{d.uuid} memory over capacity"
            assert compute <= 100, f"{d.uuid} compute over 100%"
            assert not exclusive or leases == 1, f"{d.uuid} shared while held whole"


@st.composite
def device_sets(draw: st.DrawFn) -> list[DeviceCapacity]:
    n = draw(st.integers(min_value=0, max_value=6))
    sizes = draw(st.lists(st.sampled_from([8, 16, 24, 40, 80]), min_size=n, max_size=n))
    indices = draw(st.permutations(range(n)))
    devices = [DeviceCapacity(f"GPU-{i}", indices[i], sizes[i]) for i in range(n)]
    return draw(st.permutations(devices))


@st.composite
def asks(draw: st.DrawFn, devices: list[DeviceCapacity]) -> Ask:
    allowed = draw(
        st.none()
        | st.frozensets(st.sampled_from([d.uuid for d in devices] + ["GPU-elsewhere"]), max_size=len(devices) + 1)
    )
    if draw(st.integers(0, 4)) == 0:
        return Ask(None, count=draw(st.integers(1, 3)), allowed=allowed)
    return Ask(draw(st.integers(1, 90)), draw(st.integers(1, 100)), allowed=allowed)


def check_decision(model: Model, ask: Ask, decision: PackDecision) -> None:
    assert decision.ok == bool(decision.devices)
    assert decision.shared == (ask.memory_bytes is not None)
    known = {d.uuid for d in model.devices}
    assert set(decision.devices) <= known
    if ask.allowed is not None:
        assert set(decision.devices) <= ask.allowed, "left the pod's packing domain"
    if ask.memory_bytes is not None:
        fitting = model.fitting(ask)
        if not fitting:
            assert not decision.ok
            assert decision.reason in {PackReason.NO_DEVICE_FITS, PackReason.NO_ALLOWED_DEVICES, PackReason.NO_DEVICES}
            return
        assert decision.ok, "a device could take the ask but pack refused"
        assert decision.reason is PackReason.BEST_FIT and len(decision.devices) == 1
        chosen = next(d for d in model.devices if d.uuid == decision.devices[0])
        assert chosen in fitting
        best = min(model.leftover(d, ask) for d in fitting)
        assert model.leftover(chosen, ask) == best, "not the best fit"
        assert chosen.index == min(d.index for d in fitting if model.leftover(d, ask) == best), "tie not lowest index"
    else:
        free = sorted((d for d in model.candidates(ask) if model.used(d.uuid)[2] == 0), key=lambda d: d.index)
        if len(free) >= ask.count:
            assert decision.reason is PackReason.WHOLE_DEVICE
            assert decision.devices == tuple(d.uuid for d in free[: ask.count])
        else:
            assert not decision.ok
            assert decision.reason in {
                PackReason.NOT_ENOUGH_FREE_DEVICES, PackReason.NO_ALLOWED_DEVICES, PackReason.NO_DEVICES,
            }


@settings(max_examples=300)
@given(st.data())
def test_any_sequence_of_decisions_stays_feasible_complete_and_best_fit(data: st.DataObject) -> None:
    devices = data.draw(device_sets())
    model = Model(devices, [])
    for _ in range(data.draw(st.integers(1, 25))):
        if model.held and data.draw(st.integers(0, 5)) == 0:
            # Releases let later asks meet fragmented states, not only a fill-up.
            model.held.pop(data.draw(st.integers(0, len(model.held) - 1)))
            continue
        ask = data.draw(asks(devices))
        decision = pack(ask, devices, model.held)
        check_decision(model, ask, decision)
        # Same state, listed otherwise: same answer, same words.
        assert pack(ask, list(reversed(devices)), list(reversed(model.held))) == decision
        model.apply(ask, decision)
        model.assert_feasible()


@given(st.data())
def test_decisions_on_restored_states_are_feasible_complete_and_best_fit(data: st.DataObject) -> None:
    # Arbitrary (feasible) states that pack itself did not build, e.g. leases
    # restored from the state store after a restart.
    devices = data.draw(device_sets())
    held: list[Held] = []
    for d in devices:
        if data.draw(st.booleans()):
            if data.draw(st.integers(0, 3)) == 0:
                # Whatever a whole-device lease records about its usage, the
                # device is taken: partial figures must not make it look open.
                used = data.draw(st.integers(0, d.memory_bytes))
                held.append(Held(d.uuid, used, data.draw(st.integers(0, 100)), exclusive=True))
                continue
            budget_memory, budget_compute = d.memory_bytes, 100
            for _ in range(data.draw(st.integers(1, 4))):
                if budget_memory < 1 or budget_compute < 1:
                    break
                m = data.draw(st.integers(1, budget_memory))
                c = data.draw(st.integers(1, budget_compute))
                held.append(Held(d.uuid, m, c, exclusive=False))
                budget_memory, budget_compute = budget_memory - m, budget_compute - c
    model = Model(devices, held)
    ask = data.draw(asks(devices))
    decision = pack(ask, devices, held)
    check_decision(model, ask, decision)
    model.apply(ask, decision)
    model.assert_feasible()


items = st.lists(st.tuples(st.integers(1, 80), st.integers(1, 100)), max_size=40)


@given(items)
def test_ffd_between_lower_bound_and_one_device_per_item(sizes: list[tuple[int, int]]) -> None:
    assert lower_bound(sizes, 80) <= ffd_device_count(sizes, 80) <= len(sizes)


@given(items)
def test_online_best_fit_never_beats_the_lower_bound(sizes: list[tuple[int, int]]) -> None:
    devices: list[DeviceCapacity] = []
    held: list[Held] = []
    for memory, compute in sizes:
        decision = pack(Ask(memory, compute), devices, held)
        if not decision.ok:
            devices.append(DeviceCapacity(f"GPU-{len(devices)}", len(devices), 80))
            decision = pack(Ask(memory, compute), devices, held)
        assert decision.ok, "a fresh device always takes an item that fits a device"
        held.append(Held(decision.devices[0], memory, compute, exclusive=False))
    assert len(devices) >= lower_bound(sizes, 80)
