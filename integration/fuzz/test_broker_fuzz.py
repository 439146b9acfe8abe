"""Bad input on both of the broker's endpoints, against a real ``weft broker`` (simulated GPUs).

gRPC: every method gets random bytes, corrupted and unknown-field variants of
a valid request, invalid UTF-8 and huge strings, while a real lease exists for
Bind and Release to hit. After each call the broker still answers, every
failure has a code and a message, and the leases are exactly the ones the
answers account for, never more on a device than it holds.

The hook endpoint (``<socket>.hook``, JSON lines): random bytes, invalid
UTF-8, valid JSON of the wrong shape and types, unknown fields, deeply nested
JSON and lines of megabytes each get one JSON answer line with a code, and the
same connection keeps working for the next line.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from integration.fuzz import wire
from integration.fuzz.agent_fixture import assert_clear, call
from shim._pb import broker_pb2 as pb
from shim.localfabric.broker import BrokerProcess

SVC = "/weft.broker.v1.Broker/"
BASE_KEY = "fuzz-sandbox/base/0"
GI = 1 << 30
_CODES = {c.name for c in grpc.StatusCode}


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    with BrokerProcess(tmp_path_factory.mktemp("broker-fuzz")) as b:
        yield b


@pytest.fixture(scope="module")
def channel(broker: BrokerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"unix://{broker.socket}") as ch:
        yield ch


def _acquire_base(channel: grpc.Channel) -> pb.Lease:
    req = pb.AcquireRequest(key=BASE_KEY, namespace="fuzz", pod="base", pod_uid="u", container="base",
                            sandbox_id="fuzz-sandbox", memory_bytes=4 * GI, compute_percent=10)
    out = call(channel, SVC + "Acquire", req.SerializeToString(), 10)
    assert out.response is not None, out
    return pb.Lease.FromString(out.response)


def _list(channel: grpc.Channel) -> pb.ListResponse:
    out = call(channel, SVC + "List", b"", 10)
    assert out.response is not None, out
    return pb.ListResponse.FromString(out.response)


def _never_over_a_device(listing: pb.ListResponse) -> None:
    for d in listing.devices:
        on = [lease for lease in listing.leases if d.uuid in lease.device_uuids]
        assert sum(lease.memory_bytes if lease.shared else d.memory_total for lease in on) <= d.memory_total, d
        assert sum(lease.compute_percent if lease.shared else 100 for lease in on) <= 100, d
        assert not (any(not lease.shared for lease in on) and len(on) > 1), d


def _valid(method: str, base: pb.Lease) -> bytes:
    return {
        "Devices": pb.DevicesRequest(),
        "List": pb.ListRequest(),
        "Acquire": pb.AcquireRequest(key="fuzz-sandbox/app/0", namespace="fuzz", pod="p", pod_uid="u",
                                     container="app", sandbox_id="fuzz-sandbox", memory_bytes=GI,
                                     compute_percent=25, allowed_uuids=[]),
        "Bind": pb.BindRequest(lease_id=base.lease_id, container_id="c" * 64, pid=os.getpid(), cgroup=""),
        "Release": pb.ReleaseRequest(lease_id=base.lease_id, reason="fuzz"),
        "Reconcile": pb.ReconcileRequest(live_keys=[BASE_KEY]),
        "SimulateUsage": pb.SimulateUsageRequest(processes=[pb.SimulatedProcess(
            pid=os.getpid(), device_uuid=base.device_uuids[0], used_memory=GI)]),
    }[method].SerializeToString()


_STRINGS = {
    "Acquire": ["key", "namespace", "pod", "container", "sandbox_id", "allowed_uuids"],
    "Bind": ["lease_id", "container_id", "cgroup"],
    "Release": ["lease_id", "reason"],
    "Reconcile": ["live_keys"],
}
_REQUESTS = {"Devices": pb.DevicesRequest, "List": pb.ListRequest, "Acquire": pb.AcquireRequest,
             "Bind": pb.BindRequest, "Release": pb.ReleaseRequest, "Reconcile": pb.ReconcileRequest,
             "SimulateUsage": pb.SimulateUsageRequest}
GRPC_CASES = [pytest.param(m, k, id=f"{m}-{k}") for m in _REQUESTS
              for k in ("random", "mutated", "unknown-fields", "invalid-utf8-string", "huge-string")
              if m in _STRINGS or "string" not in k]


@pytest.mark.parametrize(("method", "kind"), GRPC_CASES)
def test_grpc_bad_requests_get_a_clear_status_and_leases_stay_accounted(broker: BrokerProcess,
                                                                        channel: grpc.Channel, method: str,
                                                                        kind: str) -> None:
    base = _acquire_base(channel)
    strings = [wire.number_of(_REQUESTS[method], s) for s in _STRINGS.get(method, [])]
    inputs = wire.bad_inputs(_valid(method, base), [], strings)[kind]

    @wire.fuzz_settings(15 if kind == "mutated" else 5)
    @given(raw=inputs)
    def check(raw: wire.Raw) -> None:
        before = {lease.lease_id for lease in _list(channel).leases}
        out = call(channel, SVC + method, raw.data, 30)
        assert_clear(out, (method, wire.describe(kind, raw.data)))
        assert broker.proc is not None and broker.proc.poll() is None, "the broker exited"
        listing = _list(channel)
        _never_over_a_device(listing)
        now = {lease.lease_id for lease in listing.leases}
        expected = set(before)
        if out.response is not None and method == "Acquire":
            expected.add(pb.Lease.FromString(out.response).lease_id)
        if out.response is not None and method == "Release" and pb.ReleaseResponse.FromString(out.response).released:
            expected.discard(pb.ReleaseRequest.FromString(raw.data).lease_id)
        if out.response is not None and method == "Reconcile":
            expected -= set(pb.ReconcileResponse.FromString(out.response).released)
        assert now == expected, (method, wire.describe(kind, raw.data))
        for lease_id in now - {base.lease_id}:  # what the example acquired goes again
            call(channel, SVC + "Release", pb.ReleaseRequest(lease_id=lease_id).SerializeToString(), 10)
        call(channel, SVC + "SimulateUsage", b"", 10)
        _acquire_base(channel)

    check()


# -- the hook endpoint ------------------------------------------------------------------------
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                max_size=4), max_leaves=12)
_FIELDS = ("op", "lease_id", "container_id", "pid", "cgroup", "reason", "sandbox_id", "container")


LEASE = "@LEASE@"  # replaced by the live lease's ID when the line is sent


def _hook_lines() -> dict[str, st.SearchStrategy[bytes]]:
    good = {"op": "bind", "lease_id": LEASE, "container_id": "c" * 64, "pid": os.getpid(), "cgroup": "",
            "sandbox_id": "fuzz-sandbox", "container": "base"}
    return {
        "random": st.binary(max_size=256).map(lambda b: b.replace(b"\n", b"")),
        "invalid-utf8": wire.INVALID_UTF8.map(lambda b: b'{"op": "' + b.replace(b"\n", b"") + b'"}'),
        "any-json": JSON.map(lambda v: json.dumps(v).encode()),
        "wrong-types": st.fixed_dictionaries({}, optional={f: JSON for f in _FIELDS}).map(
            lambda d: json.dumps(d).encode()),
        "ops": st.tuples(st.sampled_from(["bind", "release"]), st.dictionaries(st.sampled_from(_FIELDS), JSON)).map(
            lambda t: json.dumps({**good, **t[1], "op": t[0]}).encode()),
        "unknown-fields": st.dictionaries(st.text(min_size=1, max_size=12).filter(lambda k: k not in _FIELDS), JSON,
                                          min_size=1, max_size=4).map(
            lambda extra: json.dumps({**extra, "op": "release", "lease_id": "lease-none"}).encode()),
        "nested": st.integers(100, 200_000).map(lambda n: b"[" * n + b"]" * n),
        "huge": st.sampled_from([60 << 10, 1 << 20, 8 << 20]).map(
            lambda n: json.dumps({"op": "release", "lease_id": "x" * n}).encode()),
    }


class HookConn:
    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(str(path))
        self.buf = b""

    def ask(self, line: bytes) -> dict:
        self.sock.sendall(line + b"\n")
        while b"\n" not in self.buf:
            chunk = self.sock.recv(1 << 16)
            assert chunk, f"the hook endpoint closed the connection after {line[:80]!r} ({len(line)} bytes)"
            self.buf += chunk
        answer, self.buf = self.buf.split(b"\n", 1)
        return json.loads(answer)

    def close(self) -> None:
        self.sock.close()


PROBE = json.dumps({"op": "release", "lease_id": "lease-none", "sandbox_id": "s", "container": "c"}).encode()


@pytest.mark.parametrize("kind", list(_hook_lines()))
def test_hook_endpoint_answers_every_line_and_keeps_the_connection(broker: BrokerProcess, channel: grpc.Channel,
                                                                   kind: str) -> None:
    live = [_acquire_base(channel).lease_id]
    conn = HookConn(broker.socket.with_name(broker.socket.name + ".hook"))
    try:

        @wire.fuzz_settings(4 if kind in ("huge", "nested") else 25)
        @given(line=_hook_lines()[kind].map(wire.Raw))
        def check(line: wire.Raw) -> None:
            answer = conn.ask(line.data.replace(LEASE.encode(), live[0].encode()))
            assert isinstance(answer, dict) and isinstance(answer.get("ok"), bool), answer
            if not answer["ok"]:
                assert answer.get("code") in _CODES and answer["code"] not in ("OK", "UNKNOWN"), answer
                assert isinstance(answer.get("error"), str) and answer["error"], answer
            assert conn.ask(PROBE) == {"ok": True, "released": False}
            assert broker.proc is not None and broker.proc.poll() is None, "the broker exited"
            listing = _list(channel)
            _never_over_a_device(listing)
            assert {lease.lease_id for lease in listing.leases} <= {live[0]}, listing
            live[0] = _acquire_base(channel).lease_id

        check()
    finally:
        conn.close()
