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

from shim.cri.instrument import Instrument, Outcome
from shim.cri.relay import h2
from shim.cri.relay.connection import Connection, Stream
from shim.cri.route import Route
from shim.metrics import Metrics

PATH = "/runtime.v1.RuntimeService/CreateContainer"
EVENTS = "/runtime.v1.RuntimeService/GetContainerEvents"


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
        self.streamed: set = set()


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
        assert not conn.closed and conn.down.waiting
        _feed(conn, h2.window_update(0, 100_000) + h2.window_update(1, 100_000))
        await asyncio.sleep(0.1)
        assert not conn.down.waiting and conn.closed

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


# -- streamed answers (Route.stream) ----------------------------------------------------------------
class Emitter:
    """A stream handler a test drives: it emits what the test puts, and ends as the test says."""

    def __init__(self) -> None:
        import queue

        self.todo: queue.Queue = queue.Queue()
        self.contexts: list = []
        self.errors: list[BaseException] = []

    def __call__(self, request, ctx, emit) -> None:
        self.contexts.append(ctx)
        ctx.add_callback(lambda: self.todo.put(None))
        while True:
            item = self.todo.get()
            if item is None:
                return
            if isinstance(item, Exception):
                raise item
            try:
                emit(item)
            except Exception as exc:
                self.errors.append(exc)
                raise


def _open_stream(c, sid: int, emitter: Emitter) -> None:
    """kubelet opens the call (its HEADERS and its one request message), on the relay's loop as the relay reads."""
    c.relay.routes[EVENTS] = Route(None, stream=emitter)
    if not isinstance(c.relay.instrument, Instrument):
        c.relay.instrument = Instrument(Metrics())  # the real one: it runs the handler and makes its outcome

    async def opened() -> None:
        _feed(c, _headers(c, sid, EVENTS) + h2.frame(h2.DATA, h2.FLAG_END_STREAM, sid, h2.grpc_message(b"")))

    c.loop.run_until_complete(opened())


def _settle(c, until, timeout: float = 5.0) -> None:
    async def spin() -> None:
        deadline = c.loop.time() + timeout
        while not until():
            assert c.loop.time() < deadline, "the relay never got there"
            await asyncio.sleep(0.005)

    c.loop.run_until_complete(spin())


def _messages(frames, sid: int) -> list[bytes]:
    body = b"".join(p for t, _, s, p in frames if t == h2.DATA and s == sid)
    return h2.split_grpc_messages(body) or []


def _status(frames, sid: int) -> int | None:
    blocks = [p for t, f, s, p in frames if t == h2.HEADERS and s == sid and f & h2.FLAG_END_STREAM]
    if not blocks:
        return None
    fields = dict(Decoder().decode(blocks[-1], raw=True))
    return int(fields[b"grpc-status"])


def test_a_streamed_answer_sends_each_message_as_it_comes_then_trailers(conn) -> None:
    e = Emitter()
    _open_stream(conn, 1, e)
    assert [(t, s) for t, _, s, _ in conn.up_w.frames()] == [(h2.HEADERS, 1), (h2.RST_STREAM, 1)]  # not containerd's
    frames: list = []
    for msg in (b"one", b"two" * 10_000):
        e.todo.put(msg)
        _settle(conn, lambda msg=msg: (frames.extend(conn.down_w.frames()) or
                                       len(_messages(frames, 1)) == (1 if msg == b"one" else 2)))
    assert _messages(frames, 1) == [b"one", b"two" * 10_000]
    assert _status(frames, 1) is None and 1 in conn.streams  # still open
    e.todo.put(None)
    _settle(conn, lambda: frames.extend(conn.down_w.frames()) or _status(frames, 1) is not None)
    assert _status(frames, 1) == 0 and 1 not in conn.streams and not conn.relay.streamed
    assert [t for t, _, s, _ in frames if s == 1].count(h2.HEADERS) == 2  # response HEADERS once, trailers once


def test_kubelet_resetting_a_streamed_call_cancels_its_handler(conn) -> None:
    e = Emitter()
    _open_stream(conn, 1, e)
    _settle(conn, lambda: bool(e.contexts))
    _feed(conn, h2.rst_stream(1))
    _settle(conn, lambda: not conn.relay.streamed)
    assert not e.contexts[0].is_active() and 1 not in conn.streams


def test_a_stream_kubelet_does_not_read_is_ended_before_its_backlog_grows_without_bound(conn, monkeypatch) -> None:
    from shim.cri.relay import connection

    monkeypatch.setattr(connection, "STREAM_BACKLOG", 200_000)
    e = Emitter()
    _open_stream(conn, 1, e)
    for _ in range(10):  # 1 MB at once; kubelet's window is 64 KiB and it never gives more
        e.todo.put(b"x" * 100_000)
    _settle(conn, lambda: not conn.relay.streamed)
    assert e.errors and "has not read" in str(e.errors[0])
    frames = conn.down_w.frames()
    # Trailers would wait behind the backlog forever: the stream is reset (gRPC: RESOURCE_EXHAUSTED) instead.
    assert [p for t, _, s, p in frames if t == h2.RST_STREAM and s == 1] == [b"\0\0\0\x0b"]
    assert sum(len(p) for t, _, s, p in frames if t == h2.DATA and s == 1) <= h2.DEFAULT_WINDOW
    assert 1 not in conn.streams and not conn.down.waiting


def test_the_agent_stopping_ends_a_streamed_call_unavailable_and_closes(conn) -> None:
    e = Emitter()
    _open_stream(conn, 1, e)
    _settle(conn, lambda: bool(e.contexts))

    async def stop() -> None:
        conn.shutdown()

    conn.loop.run_until_complete(stop())
    frames = conn.down_w.frames()
    assert _status(frames, 1) == grpc.StatusCode.UNAVAILABLE.value[0]
    _settle(conn, lambda: conn.closed and not conn.relay.streamed)  # GOAWAY sent, nothing left open


def test_streamed_calls_past_the_cap_are_refused_at_once(conn, monkeypatch) -> None:
    from shim.cri.relay import connection

    monkeypatch.setattr(connection, "MAX_STREAMED", 1)
    first, second = Emitter(), Emitter()
    _open_stream(conn, 1, first)
    _settle(conn, lambda: bool(first.contexts))
    _open_stream(conn, 3, second)
    frames = conn.down_w.frames()
    assert _status(frames, 3) == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and not second.contexts
    first.todo.put(None)
    _settle(conn, lambda: not conn.relay.streamed)


def _fill_stream_window(conn, e: Emitter, sid: int = 1) -> None:
    """The streamed call's window (64 KiB by default) spent, and a message more waiting on it."""
    _feed(conn, h2.window_update(0, 10_000_000))  # the connection's window is not what holds it back
    _open_stream(conn, sid, e)
    e.todo.put(b"x" * 70_000)
    _settle(conn, lambda: conn.down.held)


def test_a_streamed_call_waiting_on_its_window_holds_no_other_call_back(conn) -> None:
    e = Emitter()
    _fill_stream_window(conn, e)
    conn.down_w.frames()
    st = _open_intercepted(conn, 3)
    conn.answer(st, Outcome(grpc.StatusCode.OK, "", b"an answer"))
    frames = conn.down_w.frames()
    assert _status(frames, 3) == 0 and _messages(frames, 3) == [b"an answer"]
    assert 1 in conn.down.held  # the stream's own frames still wait, in order
    _feed(conn, h2.window_update(1, 100_000))
    assert not conn.down.held
    e.todo.put(None)
    _settle(conn, lambda: not conn.relay.streamed and 1 not in conn.streams)


def test_kubelet_resetting_a_stream_drops_what_still_waited_for_it(conn) -> None:
    e = Emitter()
    _fill_stream_window(conn, e)
    conn.down_w.frames()

    async def reset() -> None:
        _feed(conn, h2.rst_stream(1))

    conn.loop.run_until_complete(reset())
    _settle(conn, lambda: not conn.relay.streamed)
    _feed(conn, h2.window_update(1, 100_000) + h2.frame(h2.PING, 0, 0, b"\0" * 8))
    assert not [f for f in conn.down_w.frames() if f[2] == 1] and not conn.down.waiting


def test_the_agent_stopping_with_a_backlog_ends_the_stream_once_and_nothing_follows(conn) -> None:
    e = Emitter()
    _fill_stream_window(conn, e)

    async def stop() -> None:
        conn.shutdown()

    conn.loop.run_until_complete(stop())
    _settle(conn, lambda: not conn.relay.streamed)  # the handler saw the cancel and returned OK: ignored
    e.todo.put(b"late")

    async def credit() -> None:
        _feed(conn, h2.window_update(1, 1_000_000))

    conn.loop.run_until_complete(credit())
    frames = [f for f in conn.down_w.frames() if f[2] == 1]
    ends = [i for i, (t, fl, _, _) in enumerate(frames) if t == h2.HEADERS and fl & h2.FLAG_END_STREAM]
    assert len(ends) == 1 and ends[0] == len(frames) - 1, "one end, and nothing after it"
    assert _status(frames, 1) == grpc.StatusCode.UNAVAILABLE.value[0]


def test_a_cancelled_call_takes_no_callback_as_grpc_does(conn) -> None:
    from shim.cri.relay.context import RelayContext

    ctx = RelayContext([], None)
    ctx.cancel()
    called = []
    assert ctx.add_callback(lambda: called.append(1)) is False and not called
