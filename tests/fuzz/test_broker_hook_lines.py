"""The broker's hook endpoint answers any line with a verdict: never an exception, never a lease it was not asked for.

``_answer`` is what the ``<socket>.hook`` endpoint runs per line; an exception
there would drop the connection without an answer (and the hook would retry
until its deadline), so every input must come back as ``{"ok": ..., ...}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shim.broker.server import _answer
from shim.broker.service import LeaseService
from shim.broker.simulated import SimulatedBackend
from shim.state.leases import LeaseStore

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                max_size=4), max_leaves=12)
FIELDS = ("op", "lease_id", "container_id", "pid", "cgroup", "reason", "sandbox_id", "container")


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[LeaseService]:
    store = LeaseStore(tmp_path)
    service = LeaseService(SimulatedBackend("2x80GiB"), store)
    yield service
    store.close()


def _verdict(answer: dict) -> None:
    assert isinstance(answer["ok"], bool)
    if not answer["ok"]:
        assert answer["code"] in ("INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "PERMISSION_DENIED",
                                  "INTERNAL")
        assert answer["error"]


@FUZZ
@given(line=st.one_of(
    st.binary(max_size=200),
    JSON.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({}, optional={f: JSON for f in FIELDS}).map(lambda d: json.dumps(d).encode()),
    st.tuples(st.sampled_from(["bind", "release"]), st.dictionaries(st.sampled_from(FIELDS), JSON)).map(
        lambda t: json.dumps({**t[1], "op": t[0]}).encode()),
))
def test_any_line_gets_a_verdict(svc: LeaseService, line: bytes) -> None:
    _verdict(_answer(svc, line))
    assert svc.leases() == []


@pytest.mark.parametrize("depth", [10, 10_000, 100_000], ids=["shallow", "deep", "deeper-than-the-parser"])
def test_deeply_nested_json_is_refused_as_malformed(svc: LeaseService, depth: int) -> None:
    answer = _answer(svc, b"[" * depth + b"]" * depth)
    assert answer["ok"] is False and answer["code"] == "INVALID_ARGUMENT"
    assert "malformed hook request" in answer["error"]


@pytest.mark.parametrize("owner", [{}, {"sandbox_id": "sb"}, {"container": "app"}, {"sandbox_id": "", "container": ""}],
                         ids=["none", "no-container", "no-sandbox", "empty"])
@pytest.mark.parametrize("op", ["bind", "release"])
def test_a_hook_request_that_names_no_owner_touches_no_lease(svc: LeaseService, op: str, owner: dict) -> None:
    """A pause container (no container name) or a hand-made line must not bind or release a pod's lease."""
    rec = svc.acquire(key="sb/app/0", namespace="ns", pod="p", pod_uid="u", container="app", sandbox_id="sb",
                      memory_bytes=1 << 30, compute_percent=10, count=0, allowed=[])
    line = json.dumps({"op": op, "lease_id": rec.lease_id, "container_id": "c" * 64, "pid": 1, **owner})
    answer = _answer(svc, line.encode())
    assert (answer["ok"], answer["code"]) == (False, "PERMISSION_DENIED")
    assert [(r.lease_id, r.state.value) for r in svc.leases()] == [(rec.lease_id, "acquired")]
    ok = _answer(svc, json.dumps({"op": "release", "lease_id": rec.lease_id, "sandbox_id": "sb",
                                  "container": "app"}).encode())
    assert ok == {"ok": True, "released": True}
