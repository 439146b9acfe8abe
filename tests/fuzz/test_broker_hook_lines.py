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
        assert answer["code"] in ("INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "INTERNAL")
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
