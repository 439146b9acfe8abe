"""The GPU lease state machine, apart from the code that stores or serves it.

::

    (none) --acquire--> ACQUIRED --bind--> BOUND
                            |                 |  bind again by the same container: no change
                            +---release---> RELEASED <---release---+

A lease is bound to exactly one container; a bind by another container is a
conflict (a lease never serves two). Release is idempotent: releasing what is
released or unknown succeeds. Persisted records carry ``LEASE_SCHEMA``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

LEASE_SCHEMA = 1


class LeaseState(enum.Enum):
    ACQUIRED = "acquired"
    BOUND = "bound"
    RELEASED = "released"


class LeaseEvent(enum.Enum):
    BIND = "bind"
    RELEASE = "release"


TRANSITIONS: dict[tuple[LeaseState, LeaseEvent], LeaseState] = {
    (LeaseState.ACQUIRED, LeaseEvent.BIND): LeaseState.BOUND,
    (LeaseState.BOUND, LeaseEvent.BIND): LeaseState.BOUND,
    (LeaseState.ACQUIRED, LeaseEvent.RELEASE): LeaseState.RELEASED,
    (LeaseState.BOUND, LeaseEvent.RELEASE): LeaseState.RELEASED,
    (LeaseState.RELEASED, LeaseEvent.RELEASE): LeaseState.RELEASED,
}


class LeaseConflict(ValueError):
    """The transition is not allowed; the message says why."""


@dataclass(frozen=True)
class BindCheck:
    next_state: LeaseState
    changed: bool


def check_bind(state: LeaseState, bound_container: str, container_id: str) -> BindCheck:
    """Guard for BIND: a bound lease may only be bound again by the same container."""
    nxt = TRANSITIONS.get((state, LeaseEvent.BIND))
    if nxt is None:
        raise LeaseConflict(f"a {state.value} lease cannot be bound")
    if state is LeaseState.BOUND:
        if bound_container and container_id and bound_container != container_id:
            raise LeaseConflict(f"lease is bound to container {bound_container[:12]}, not {container_id[:12]}")
        return BindCheck(nxt, changed=False)
    return BindCheck(nxt, changed=True)


def release(state: LeaseState | None) -> LeaseState:
    if state is None:
        return LeaseState.RELEASED
    return TRANSITIONS[(state, LeaseEvent.RELEASE)]
