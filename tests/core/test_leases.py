"""The GPU lease state machine: the transitions table, the bind guard and idempotent release."""

from __future__ import annotations

import itertools

import pytest

from shim.core.leases import (
    TRANSITIONS,
    BindCheck,
    LeaseConflict,
    LeaseEvent,
    LeaseState,
    check_bind,
    release,
)

ACQUIRED, BOUND, RELEASED = LeaseState.ACQUIRED, LeaseState.BOUND, LeaseState.RELEASED
BIND, RELEASE = LeaseEvent.BIND, LeaseEvent.RELEASE

# The diagram in shim/core/leases.py, written out: None means not allowed.
EXPECTED = {
    (ACQUIRED, BIND): BOUND,
    (BOUND, BIND): BOUND,
    (RELEASED, BIND): None,
    (ACQUIRED, RELEASE): RELEASED,
    (BOUND, RELEASE): RELEASED,
    (RELEASED, RELEASE): RELEASED,
}


@pytest.mark.parametrize(
    ("state", "event"),
    [pytest.param(s, e, id=f"{s.value}-{e.value}") for s, e in itertools.product(LeaseState, LeaseEvent)],
)
def test_transitions_table_matches_the_diagram(state: LeaseState, event: LeaseEvent) -> None:
    assert TRANSITIONS.get((state, event)) is EXPECTED[(state, event)]


def test_every_state_and_event_pair_is_decided() -> None:
    assert set(EXPECTED) == set(itertools.product(LeaseState, LeaseEvent))


@pytest.mark.parametrize(
    ("state", "bound", "binder", "expected"),
    [
        pytest.param(ACQUIRED, "", "c1", BindCheck(BOUND, changed=True), id="acquired-becomes-bound"),
        pytest.param(BOUND, "c1", "c1", BindCheck(BOUND, changed=False), id="same-container-again-is-no-change"),
        pytest.param(BOUND, "", "c1", BindCheck(BOUND, changed=False), id="bound-without-container-id-no-conflict"),
    ],
)
def test_check_bind_allows(state: LeaseState, bound: str, binder: str, expected: BindCheck) -> None:
    assert check_bind(state, bound, binder) == expected


def test_bind_by_another_container_is_a_conflict_naming_both() -> None:
    first, second = "a" * 64, "b" * 64
    with pytest.raises(LeaseConflict) as err:
        check_bind(BOUND, first, second)
    assert first[:12] in str(err.value)
    assert second[:12] in str(err.value)


def test_released_lease_cannot_be_bound() -> None:
    with pytest.raises(LeaseConflict, match="released lease cannot be bound"):
        check_bind(RELEASED, "", "c1")


@pytest.mark.parametrize(
    "state",
    [pytest.param(None, id="unknown-lease"), *(pytest.param(s, id=s.value) for s in LeaseState)],
)
def test_release_is_idempotent(state: LeaseState | None) -> None:
    assert release(state) is RELEASED
    assert release(release(state)) is RELEASED
