"""The relay's connection logic, fed frame by frame with fake sockets: GOAWAY, flow control, closing.

Each case is a way the relay could corrupt or hang a kubelet connection; the
real-socket behaviour is covered by the integration tests.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hpack import Decoder, Encoder

from shim.cri.instrument import Outcome
from shim.cri.relay import h2
from shim.cri.relay.connection import Connection, Stream
from shim.cri.route import Route

PATH = "/runtime.v1.RuntimeService/CreateContainer"


class FakeWriter:
    def __init__(self) -> None:
        self.buf = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.buf += data

    def close(self) -> None:
        self.closed = True

    def frames(self) -> list[tuple[int, int, int, bytes]]:
        out, at = [], 0
        while at + 9 <= len(self.buf):
            n, ftype, flags, sid = h2.parse_header(self.buf, at)
            out.append((ftype, flags, sid, bytes(self.buf[at + 9:at + 9 + n])))
            at += 9 + n
        del self.buf[:at]
        return out


class QuietInstrument:
    def __getattr__(self, name: str):
        return lambda *a, **k: None


class FakeRelay:
    upstream_socket = "/run/containerd/containerd.sock"

    def __init__(self) -> None:
        self.instrument = QuietInstrument()
        self.routes = {PATH: Route(lambda request, ctx: b"")}
        self.pool = ThreadPoolExecutor(2)
        self.tasks: set = set()
        self.connections: set = set()


@pytest.fixture
def conn():
    async def make():
        c = Connection(FakeRelay(), None, FakeWriter())  # type: ignore[arg-type]
        c.up_w = FakeWriter()  # type: ignore[assignment]
        return c

    loop = asyncio.new_event_loop()
    c = loop.run_until_complete(make())
    c.loop = loop
    c.enc = Encoder()  # kubelet's encoder, in step with this connection's decoder
    yield c
    loop.close()


def _headers(c, sid: int, path: str = PATH) -> bytes:
    block = c.enc.encode([(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "x"),
                             ("content-type", "application/grpc"), ("te", "trailers")])
    return h2.frame(h2.HEADERS, h2.FLAG_END_HEADERS, sid, block)


def _feed(c, raw: bytes) -> None:
    up, at = [], 0
    while at < len(raw):
        n, ftype, flags, sid = h2.parse_header(raw, at)
        c.on_kubelet_frame(ftype, flags, sid, bytes(raw[at:at + 9 + n]), up)
        at += 9 + n
    if up:
        c.up_w.write(b"".join(up))
    c.drain()


def _open_intercepted(c, sid: int) -> Stream:
    _feed(c, _headers(c, sid))  # no END_STREAM: the body has not come, so nothing is dispatched yet
    return c.streams[sid]


def _data_sent(c, sid: int) -> int:
    return sum(len(p) for t, _, s, p in c.down_w.frames() if t == h2.DATA and s == sid)


def test_no_call_is_started_after_our_goaway(conn) -> None:
    _open_intercepted(conn, 1)
    conn.goaway()  # GOAWAY(1): stream 3, already on its way, will be retried by kubelet elsewhere
    conn.up_w.frames()
    _feed(conn, _headers(conn, 3, "/runtime.v1.RuntimeService/Version"))
    upstream = conn.up_w.frames()
    assert [(t, s) for t, _, s, _ in upstream] == [(h2.HEADERS, 3), (h2.RST_STREAM, 3)]  # HPACK in step, no call
    assert 3 not in conn.streams and conn.last_sid == 1


def test_credit_for_our_own_answers_is_not_passed_to_containerd(conn) -> None:
    forwarded = 0
    for i in range(10):
        sid = 2 * i + 1
        st = _open_intercepted(conn, sid)
        conn.answer(st, Outcome(grpc.StatusCode.OK, "", b"x" * 5_000))
        got = _data_sent(conn, sid)
        _feed(conn, h2.window_update(0, got))  # kubelet credits what it received, as grpc-go does
        forwarded += sum(h2.window_increment(p) for t, _, s, p in conn.up_w.frames()
                         if t == h2.WINDOW_UPDATE and s == 0)
    assert forwarded == 0 and conn.down.owed == 0


def test_a_queued_answer_keeps_to_the_stream_window(conn) -> None:
    _feed(conn, h2.window_update(0, 10_000_000))  # a large connection window, the default stream window
    st = _open_intercepted(conn, 1)
    conn.answer(st, Outcome(grpc.StatusCode.OK, "", b"x" * 200_000))
    sent = _data_sent(conn, 1)
    _feed(conn, h2.frame(h2.PING, 0, 0, b"\0" * 8))  # any later frame drains the queue
    sent += _data_sent(conn, 1)
    assert sent <= h2.DEFAULT_WINDOW
    _feed(conn, h2.window_update(1, 200_000))
    assert sent + _data_sent(conn, 1) == 200_005  # all of it, once the stream window allows
    assert 1 not in conn.streams


def test_never_closes_with_frames_still_queued(conn) -> None:
    async def scenario() -> None:
        st = _open_intercepted(conn, 1)
        conn.answer(st, Outcome(grpc.StatusCode.OK, "", b"x" * 100_000))  # more than the windows allow
        conn.goaway()
        await asyncio.sleep(0.1)
        assert not conn.closed and conn.down.out
        _feed(conn, h2.window_update(0, 100_000) + h2.window_update(1, 100_000))
        await asyncio.sleep(0.1)
        assert not conn.down.out and conn.closed

    conn.loop.run_until_complete(scenario())


def test_containerds_answer_to_a_call_weft_answers_leaves_kubelets_decoder_in_step(conn) -> None:
    """grpc-go answers a method it does not know at once, before our RST lands; that block fills its
    encoder's table but never reaches kubelet, whose decoder must still read every later block."""
    containerd, kubelet = Encoder(), Decoder()
    _open_intercepted(conn, 1)
    unknown = [(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "12"),
               ("grpc-message", "unknown service weft.agent.v1.Admin")]
    conn._on_containerd_frame(h2.HEADERS, h2.FLAG_END_HEADERS | h2.FLAG_END_STREAM, 1,
                              h2.frame(h2.HEADERS, h2.FLAG_END_HEADERS | h2.FLAG_END_STREAM, 1,
                                       containerd.encode(unknown)))
    _feed(conn, _headers(conn, 3, "/runtime.v1.RuntimeService/Version"))
    reply = containerd.encode([(":status", "200"), ("content-type", "application/grpc"),
                               ("grpc-message", "unknown service weft.agent.v1.Admin")])  # indexed now
    conn._on_containerd_frame(h2.HEADERS, h2.FLAG_END_HEADERS, 3, h2.frame(h2.HEADERS, h2.FLAG_END_HEADERS, 3, reply))
    conn.down.flush()
    blocks = [(f, p) for t, f, s, p in conn.down_w.frames() if t == h2.HEADERS and s == 3]
    assert len(blocks) == 1 and not blocks[0][0] & h2.FLAG_END_STREAM
    assert [(bytes(k), bytes(v)) for k, v in kubelet.decode(blocks[0][1], raw=True)] == [
        (b":status", b"200"), (b"content-type", b"application/grpc"),
        (b"grpc-message", b"unknown service weft.agent.v1.Admin")]
