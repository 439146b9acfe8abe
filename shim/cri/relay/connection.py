"""One kubelet connection and its own connection to containerd: which frame goes where.

Every frame goes across unchanged; the relay reads only frame boundaries,
SETTINGS and header blocks (HPACK-decoded in step with both encoders, to
learn each request's method and each response's status). One exception:
once containerd answered a call weft answers (grpc-go does at once for a
method it does not know) and that block changed its HPACK table, kubelet's
decoder no longer matches containerd's encoder, and containerd's later
blocks reach kubelet re-encoded without the dynamic table.

A request whose path has a route that applies (``route.Route``) is answered
by weft: its HEADERS still go to containerd, immediately followed by
RST_STREAM(CANCEL), so containerd's HPACK decoder stays in step with
kubelet's encoder while containerd never sees a request body (grpc-go runs
no handler without one). A route with a ``pick`` holds the request's body
until it is whole, then weft answers or containerd gets it as it came.
A route with a ``stream`` answers a server-streaming call for its whole
life, on a thread of its own: each message it emits goes to kubelet as it
comes, within kubelet's windows, and a stream kubelet does not read is ended
(``RESOURCE_EXHAUSTED``) before its backlog grows past ``STREAM_BACKLOG``.
Flow control (``flow``), weft's answers (``answers``) and the end of the
connection (``shutdown``) are their own modules.

containerd unreachable: the connection's calls are answered here,
``UNAVAILABLE`` naming containerd's socket, then GOAWAY, so kubelet
reconnects and finds containerd once it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from hpack.exceptions import HPACKError

from shim import log
from shim.cri.instrument import Aborted, Instrument, Outcome, ids_of
from shim.cri.methods import Method, Shape, lookup
from shim.cri.relay import answers, h2
from shim.cri.relay.context import RelayContext, header_fields, metadata_of
from shim.cri.relay.flow import Downlink
from shim.cri.relay.frames import HeaderBlocks, take_frames
from shim.cri.relay.shutdown import CLOSE_DELAY_S, Ending
from shim.cri.route import Route

_log = log.get("weft.cri")
# Streamed answers (``Route.stream``) at once, per relay: each holds a thread for the call's life.
MAX_STREAMED = 32
# Bytes of a streamed answer queued for kubelet and not yet sent: past this, kubelet is not reading.
STREAM_BACKLOG = 8 << 20
_GRPC_CODES = {c.value[0]: c for c in grpc.StatusCode}


class Relay(Protocol):
    """What a connection needs of the server it belongs to (``server.RelayServer``)."""

    upstream_socket: str
    routes: Mapping[str, Route]
    instrument: Instrument
    pool: Executor
    tasks: set[asyncio.Future]
    connections: set[Connection]
    streamed: set[int]  # ids of the streamed answers running now, all connections together


@dataclass(slots=True)
class Stream:
    sid: int
    method: Method
    intercepted: bool
    start: float
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    window: int = h2.DEFAULT_WINDOW  # kubelet's receive window for this stream (intercepted only)
    responded: bool = False  # response HEADERS went to kubelet
    ctx: RelayContext | None = None
    # A route that decides by the request body (``pick``): the HEADERS went to containerd, the
    # DATA frames wait here until the body is whole, then go to containerd or the handler answers.
    pick: Callable[[bytes], bool] | None = None
    held: list[bytes] = field(default_factory=list)
    held_wire: int = 0
    ids: dict[str, str] | None = None  # what a pass-through call is about, for its log line (non-polling only)
    streamed: bool = False  # weft answers it with a stream of messages (``Route.stream``)
    emitted: int = 0  # bytes of a streamed answer handed to the relay (by its thread)
    sent: int = 0  # ... and of those, sent to kubelet (``flow.Downlink``)
    overrun: bool = False  # ended for a backlog kubelet did not read: reset, not trailers behind the backlog
    finished: bool = False  # weft's final frames for it are queued: nothing more may follow them


class Connection:
    def __init__(self, relay: Relay, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        self.relay = relay
        self.down_r, self.down_w = down_r, down_w
        self.up_r: asyncio.StreamReader | None = None
        self.up_w: asyncio.StreamWriter | None = None
        self.local_reason = ""  # set when containerd could not be reached: we answer alone
        self.req_dec = h2.CachingDecoder()  # kubelet's encoder -> (us and) containerd
        self.resp_dec = h2.CachingDecoder()  # containerd's encoder -> (us and) kubelet
        # Set once a block containerd wrote changed its table but never reached kubelet (its answer on a
        # stream weft answered): from then on containerd's blocks reach kubelet re-encoded without the table.
        self.resp_reencode = False
        self.streams: dict[int, Stream] = {}
        self.last_sid = 0
        # The first frame kubelet gets must be SETTINGS (RFC 7540 3.5): containerd's, or ours.
        self.settings_down = False
        self.down = Downlink(down_w, self.streams, self._answered)
        self.ending = Ending()
        self._requests = HeaderBlocks()
        self._responses = HeaderBlocks()

    @property
    def closed(self) -> bool:
        return self.ending.closed

    # -- kubelet -> containerd -----------------------------------------------------
    async def run(self) -> None:
        try:
            preface = await self.down_r.readexactly(len(h2.PREFACE))
        except (asyncio.IncompleteReadError, ConnectionError):
            self.close()
            return
        if preface != h2.PREFACE:
            self.close()
            return
        try:
            self.up_r, self.up_w = await asyncio.wait_for(
                asyncio.open_unix_connection(self.relay.upstream_socket), timeout=2)
        except (OSError, TimeoutError) as exc:
            self.local_reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else repr(exc)
            self.relay.instrument.upstream_unavailable(self.relay.upstream_socket, self.local_reason)
            self.down.control(h2.frame(h2.SETTINGS, 0, 0))
            self.settings_down = True
        else:
            self.relay.instrument.upstream_reached()
            self.up_w.write(preface)
            task = asyncio.ensure_future(self._from_containerd())
            self.relay.tasks.add(task)
            task.add_done_callback(self.relay.tasks.discard)
        await self._from_kubelet()

    async def _from_kubelet(self) -> None:
        buf = bytearray()
        try:
            while not self.closed:
                data = await self.down_r.read(1 << 16)
                if not data:
                    break
                buf += data
                up: list[bytes] = []
                for ftype, flags, sid, raw in take_frames(buf):
                    self.on_kubelet_frame(ftype, flags, sid, raw, up)
                if up:
                    self._to_containerd(b"".join(up))
                self.drain()
        except (ConnectionError, HPACKError, asyncio.IncompleteReadError) as exc:
            _log.debug("relay.kubelet_closed", error=repr(exc))
        except h2.ProtocolError as exc:
            _log.warning("relay.protocol_error", side="kubelet", error=str(exc))
            with contextlib.suppress(Exception):
                self.down_w.write(h2.goaway(self.last_sid, h2.ERROR_PROTOCOL, str(exc).encode()))
        except Exception:  # noqa: BLE001 - a frame we could not make sense of: end this connection, not the agent
            _log.exception("relay.kubelet_failed")
        finally:
            self.close()

    def _to_containerd(self, data: bytes) -> None:
        """containerd's end may close before its reader has seen it (``_upstream_lost`` then answers every open
        call): what kubelet sends meanwhile is dropped, and must not end kubelet's connection before those
        answers reach it."""
        w = self.up_w
        if w is None or w.is_closing():
            return
        with contextlib.suppress(RuntimeError, ConnectionError):  # uvloop refuses a write on a closed transport
            w.write(data)

    def on_kubelet_frame(self, ftype: int, flags: int, sid: int, raw: bytes, up: list[bytes]) -> None:
        payload = raw[9:]
        if ftype in (h2.HEADERS, h2.CONTINUATION):
            block = self._requests.add(ftype, flags, sid, raw)
            if block is not None:
                self._request_headers(*block, up)
            return
        st = self.streams.get(sid) if sid else None
        if ftype == h2.DATA:
            if st is not None and st.pick is not None:
                st.body += h2.data_payload(flags, payload)
                st.held.append(raw)
                st.held_wire += len(payload)
                if flags & h2.FLAG_END_STREAM:
                    self._decide(st, up)
            elif st is not None and st.intercepted:
                st.body += h2.data_payload(flags, payload)
                self.down.credit(sid, len(payload))
                if flags & h2.FLAG_END_STREAM:
                    self._dispatch(st)
            elif self.up_w is None:
                self.down.credit(sid, len(payload))
            else:
                up.append(raw)
                if st is not None and st.ids is None and st.method.id_field and not st.method.polling:
                    st.ids = ids_of(st.method, h2.data_payload(flags, payload)[5:])  # past gRPC's own header
        elif ftype == h2.WINDOW_UPDATE:
            forward = self.down.window_update(sid, h2.window_increment(payload))
            if self.up_w is not None and forward is None:
                up.append(raw)
            elif self.up_w is not None and forward:
                up.append(h2.window_update(0, forward))
        elif ftype == h2.SETTINGS:
            if not flags & h2.FLAG_ACK:
                self._kubelet_settings(h2.parse_settings(payload))
                if self.up_w is None:
                    self.down.control(h2.settings_ack())
            if self.up_w is not None:
                up.append(raw)
        elif ftype == h2.RST_STREAM:
            if st is not None:
                self._end_stream(st, grpc.StatusCode.CANCELLED, "cancelled by the client")
                if st.intercepted:
                    st.finished = True
                    self.down.discard(sid)  # what still waits for kubelet would go out on a closed stream
                    if st.ctx is not None:
                        st.ctx.cancel()
                    return
            if self.up_w is not None:
                up.append(raw)
        elif ftype == h2.PING and not flags & h2.FLAG_ACK and (self.settings_down or self.up_w is None):
            # kubelet's pings (keepalive, and gRPC's bandwidth probes after each answer) are answered here:
            # forwarded, those after calls weft answered itself would count against containerd's ping
            # policy (no data of its own went out), and it would end the connection with GOAWAY
            # "too_many_pings", failing the calls in flight on it. (Before containerd's SETTINGS reached
            # kubelet, nothing else may: such an early ping goes to containerd as it came.)
            self.down.control(h2.frame(h2.PING, h2.FLAG_ACK, 0, payload))
        elif ftype == h2.PING and self.up_w is None:
            pass  # an ack of a ping containerd sent before it went away
        elif self.up_w is not None:  # PING acks, PRIORITY, GOAWAY and anything newer: not ours to judge
            up.append(raw)

    def _decide(self, st: Stream, up: list[bytes]) -> None:
        """The body of a ``pick`` stream is whole: weft answers it, or containerd gets it as it came."""
        pick, st.pick = st.pick, None
        messages = h2.split_grpc_messages(bytes(st.body))
        try:
            ours = messages is not None and len(messages) == 1 and pick(messages[0])
        except Exception:  # noqa: BLE001 - a body the handler cannot read is containerd's to answer
            ours = False
        if ours:
            st.intercepted = True
            up.append(h2.rst_stream(st.sid))
            self.down.credit(st.sid, st.held_wire)
            self._dispatch(st)
        else:
            if st.method.shape is Shape.SERVER_STREAM:
                self.relay.instrument.stream_opened(st.method)
            up.extend(st.held)
        st.held = []

    def _kubelet_settings(self, settings: dict[int, int]) -> None:
        self.down.settings(settings)
        if h2.SETTINGS_HEADER_TABLE_SIZE in settings:
            # containerd's encoder may now use a table this large toward kubelet.
            self.resp_dec.max_allowed_table_size = settings[h2.SETTINGS_HEADER_TABLE_SIZE]

    def _request_headers(self, sid: int, flags: int, raw: bytes, block: bytes, up: list[bytes]) -> None:
        headers = self.req_dec.decode(block)
        st = self.streams.get(sid)
        if st is not None:  # trailers from the client (client streaming): pass, or ours to read
            if st.intercepted:
                if flags & h2.FLAG_END_STREAM:
                    self._dispatch(st)
            elif self.up_w is not None:
                up.append(raw)
            return
        if self.ending.refuses(sid):
            # After our GOAWAY: kubelet retries this call on a new connection, so nothing
            # may run it here. containerd still sees the block (HPACK), then a reset.
            if self.up_w is not None:
                up.append(raw)
                up.append(h2.rst_stream(sid))
            return
        path = next((v for k, v in headers if k == b":path"), b"").decode("latin-1")
        method = lookup(path)
        self.last_sid = max(self.last_sid, sid)
        route = self.relay.routes.get(path)
        intercepted = route is not None and route.applies()
        pick = route.pick if route is not None and intercepted and self.up_w is not None else None
        st = Stream(sid, method, intercepted and pick is None, time.perf_counter(), headers,
                    window=self.down.initial_window, pick=pick)
        self.streams[sid] = st
        if pick is not None:
            up.append(raw)  # containerd decodes this block now, in kubelet's order (HPACK); the body waits
            if flags & h2.FLAG_END_STREAM:
                self._decide(st, up)
            return
        if method.shape is Shape.SERVER_STREAM and not intercepted:
            self.relay.instrument.stream_opened(method)
        if intercepted:
            if self.up_w is not None:  # containerd's decoder must see the block; no body follows
                up.append(raw)
                up.append(h2.rst_stream(sid))
            if flags & h2.FLAG_END_STREAM:
                self._dispatch(st)
        elif self.up_w is not None:
            up.append(raw)
        else:
            message = f"weft: containerd is unavailable at {self.relay.upstream_socket}: {self.local_reason}"
            self._answer_error(st, grpc.StatusCode.UNAVAILABLE, message, ())
            self.goaway()

    # -- containerd -> kubelet -----------------------------------------------------
    async def _from_containerd(self) -> None:
        assert self.up_r is not None
        buf = bytearray()
        try:
            while True:
                data = await self.up_r.read(1 << 16)
                if not data:
                    break
                buf += data
                for ftype, flags, sid, raw in take_frames(buf):
                    self._on_containerd_frame(ftype, flags, sid, raw)
                self.down.flush()
        except (ConnectionError, HPACKError, asyncio.IncompleteReadError) as exc:
            _log.debug("relay.containerd_closed", error=repr(exc))
        except Exception:  # noqa: BLE001 - as above: the calls on this connection end clearly
            _log.exception("relay.containerd_failed")
        if not self.closed:
            self._upstream_lost()

    def _on_containerd_frame(self, ftype: int, flags: int, sid: int, raw: bytes) -> None:
        if ftype in (h2.HEADERS, h2.CONTINUATION):
            block = self._responses.add(ftype, flags, sid, raw)
            if block is not None:
                self._response_headers(*block)
            return
        st = self.streams.get(sid) if sid else None
        if st is not None and st.intercepted:
            return  # containerd's side of a stream we answer: ignore
        if ftype == h2.DATA:
            self.down.send(sid, len(raw) - 9, raw)
            if st is not None and flags & h2.FLAG_END_STREAM:
                self._end_stream(st, grpc.StatusCode.OK, "")
            return
        if ftype == h2.SETTINGS and not flags & h2.FLAG_ACK:
            self.settings_down = True
            settings = h2.parse_settings(raw[9:])
            if h2.SETTINGS_HEADER_TABLE_SIZE in settings:
                self.req_dec.max_allowed_table_size = settings[h2.SETTINGS_HEADER_TABLE_SIZE]
        elif ftype == h2.RST_STREAM and st is not None:
            self._end_stream(st, grpc.StatusCode.CANCELLED, "reset by containerd")
        self.down.send(sid, 0, raw)

    def _response_headers(self, sid: int, flags: int, raw: bytes, block: bytes) -> None:
        headers = self.resp_dec.decode(block)
        st = self.streams.get(sid)
        if st is not None and st.intercepted:
            # containerd's own answer to a call weft answers: grpc-go sends one at once, before our RST
            # lands, for a method it does not know (weft's Admin service, a newer CRI verb). kubelet must
            # not get it, and then its decoder no longer matches containerd's encoder.
            self.resp_reencode = self.resp_reencode or self.resp_dec.changed
            return
        if self.resp_reencode:
            raw = h2.headers_frames(sid, h2.encode_headers(headers), end_stream=bool(flags & h2.FLAG_END_STREAM),
                                    max_frame=self.down.max_frame)
        self.down.send(sid, 0, raw)
        if st is not None and flags & h2.FLAG_END_STREAM:
            status = next((v for k, v in headers if k == b"grpc-status"), None)
            msg = next((v for k, v in headers if k == b"grpc-message"), b"")
            code = _GRPC_CODES.get(int(status), grpc.StatusCode.UNKNOWN) if status else grpc.StatusCode.OK
            self._end_stream(st, code, h2.percent_decode(msg))
        elif st is not None:
            st.responded = True

    def _upstream_lost(self) -> None:
        """containerd went away mid-connection: end every open pass-through call clearly, then the connection."""
        message = f"weft: containerd is unavailable at {self.relay.upstream_socket}: connection lost"
        self.relay.instrument.upstream_unavailable(self.relay.upstream_socket, "connection lost")
        if not self.settings_down:  # containerd died before it said anything: our SETTINGS come first
            self.down.control(h2.frame(h2.SETTINGS, 0, 0), first=True)
            self.settings_down = True
        for st in list(self.streams.values()):
            if not st.intercepted:
                self._answer_error(st, grpc.StatusCode.UNAVAILABLE, message, ())
        up_w, self.up_w = self.up_w, None
        if up_w is not None:
            with contextlib.suppress(Exception):
                up_w.close()
        self.goaway()

    # -- streams we answer ---------------------------------------------------------
    def _dispatch(self, st: Stream) -> None:
        st.ctx = RelayContext(metadata_of(st.headers), answers.deadline(st.headers))
        request = answers.request_of(bytes(st.body))
        route = self.relay.routes[st.method.path]
        if route.stream is not None:
            self._dispatch_stream(st, route.stream, request)
            return
        handler = route.handle
        future = asyncio.get_running_loop().run_in_executor(
            self.relay.pool, self.relay.instrument.intercepted, st.method, handler, request, st.ctx)
        future.add_done_callback(lambda f: self._answer_safely(st, f))

    def _dispatch_stream(self, st: Stream, fn, request: bytes | None) -> None:
        """A streamed answer: ``fn`` runs on its own thread and emits messages; its return ends the call."""
        st.streamed = True
        if len(self.relay.streamed) >= MAX_STREAMED:
            self._answer_error(st, grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"weft: {MAX_STREAMED} streamed calls are open on this agent already", ())
            return
        loop = asyncio.get_running_loop()
        ctx = st.ctx
        assert ctx is not None
        key = id(st)
        self.relay.streamed.add(key)
        self.relay.instrument.stream_opened(st.method)

        def emit(message: bytes) -> None:
            if not ctx.is_active():
                raise Aborted(grpc.StatusCode.CANCELLED, "cancelled by the client")
            if st.emitted - st.sent > STREAM_BACKLOG:
                st.overrun = True
                raise Aborted(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"weft: {st.method.name}: the client has not read {st.emitted - st.sent} bytes")
            st.emitted += len(message) + 5
            loop.call_soon_threadsafe(self._emit, st, message)

        def run() -> None:
            try:
                outcome = self.relay.instrument.intercepted(
                    st.method, lambda req, c: fn(req, c, emit) or b"", request, ctx)
            finally:
                self.relay.streamed.discard(key)
                self.relay.instrument.stream_closed(st.method)
            with contextlib.suppress(RuntimeError):  # the loop was closed: nothing is left to answer
                loop.call_soon_threadsafe(self.answer, st, outcome)

        threading.Thread(target=run, name=f"weft-cri-{st.method.name}", daemon=True).start()

    def _emit(self, st: Stream, message: bytes) -> None:
        if self.closed or st.finished or st.sid not in self.streams:
            return
        if not st.responded:
            st.responded = True
            initial = header_fields(st.ctx.initial_metadata if st.ctx else ())
            self.down.send(st.sid, 0, answers.stream_headers(st.sid, initial, self.down.max_frame))
        for n, raw in answers.message_frames(st.sid, message, self.down.max_frame):
            self.down.send(st.sid, n, raw)
        self.down.flush()

    def _answer_safely(self, st: Stream, future: asyncio.Future) -> None:
        try:
            if future.cancelled():
                outcome = Outcome(grpc.StatusCode.UNAVAILABLE, "weft: the agent is stopping", None)
            else:
                outcome = future.result()
            self.answer(st, outcome)
        except Exception as exc:  # noqa: BLE001 - the caller must get an answer, never a hang
            _log.exception("relay.answer_failed", method=st.method.name)
            if not self.closed and st.sid in self.streams:
                self._answer_error(st, grpc.StatusCode.INTERNAL, f"weft: could not answer {st.method.name}: {exc!r}",
                                   ())

    def answer(self, st: Stream, outcome: Outcome) -> None:
        if self.closed or st.finished or st.sid not in self.streams:
            return  # answered already (the agent stopping ends a streamed call itself), or kubelet reset it
        initial = header_fields(st.ctx.initial_metadata if st.ctx else ())
        trailing = header_fields(outcome.trailing_metadata)
        if outcome.code is grpc.StatusCode.OK or st.overrun:
            st.finished = True
        if st.overrun:  # trailers would wait behind what kubelet does not read: drop it, reset the stream
            _log.warning("relay.stream_overrun", method=st.method.name, unsent=st.emitted - st.sent)
            self.down.discard(st.sid)
            self.down.send(st.sid, 0, h2.rst_stream(st.sid, h2.ERROR_ENHANCE_YOUR_CALM), last=True)
        elif outcome.code is not grpc.StatusCode.OK:
            self._answer_error(st, outcome.code, outcome.details, trailing, initial)
        elif st.streamed:
            self.down.send(st.sid, 0, answers.stream_end_frames(st.sid, initial, trailing, responded=st.responded,
                                                               max_frame=self.down.max_frame), last=True)
        else:
            frames = answers.response_frames(st.sid, outcome, initial, trailing, self.down.max_frame)
            for i, (n, raw) in enumerate(frames):
                self.down.send(st.sid, n, raw, last=i == len(frames) - 1)
        self.down.flush()

    def _answer_error(self, st: Stream, code: grpc.StatusCode, details: str, trailing, initial=()) -> None:
        if st.finished:
            return
        st.finished = True
        frames = answers.error_frames(st.sid, code, details, trailing, initial, responded=st.responded,
                                      max_frame=self.down.max_frame)
        if st.intercepted:
            self.down.send(st.sid, 0, frames, last=True)
        else:
            self.down.send(st.sid, 0, frames)
            self._end_stream(st, code, details)
        self.drain()

    def _answered(self, sid: int) -> None:
        """The last frame of one of weft's answers is out: the stream (and its window) may go."""
        self.streams.pop(sid, None)
        self._close_if_done()

    def _end_stream(self, st: Stream, code: grpc.StatusCode, details: str) -> None:
        if self.streams.pop(st.sid, None) is None:
            return
        if not st.intercepted:
            if st.method.shape is Shape.SERVER_STREAM:
                self.relay.instrument.stream_closed(st.method)
            self.relay.instrument.passthrough(st.method, code, details, time.perf_counter() - st.start, st.ids)
        self._close_if_done()

    def drain(self) -> None:
        self.down.drain()
        self._close_if_done()

    # -- ending (shutdown) ---------------------------------------------------------
    def _close_if_done(self) -> None:
        if self.ending.may_close(self.streams, self.down.waiting):
            asyncio.get_running_loop().call_later(CLOSE_DELAY_S, self.close)

    def goaway(self) -> None:
        frame = self.ending.goaway(self.last_sid)
        if frame is not None:
            self.down.send(0, 0, frame)
            self.down.flush()
            self._close_if_done()

    def shutdown(self) -> None:
        """Server stopping: no new calls; calls in flight may finish, streamed answers end now (they never
        would), UNAVAILABLE: a client may open its stream again on the agent that comes next."""
        self.goaway()
        for st in list(self.streams.values()):
            if st.streamed and st.ctx is not None and not st.finished:
                st.ctx.cancel()
                self._answer_error(st, grpc.StatusCode.UNAVAILABLE, "weft: the agent is stopping", ())
        self.drain()

    def close(self) -> None:
        if self.closed:
            return
        self.down.flush()
        self.ending.closed = self.down.closed = True
        for st in list(self.streams.values()):
            if st.ctx is not None:
                st.ctx.cancel()
            if not st.intercepted:
                self._end_stream(st, grpc.StatusCode.CANCELLED, "connection closed")
        self.streams.clear()
        for w in (self.down_w, self.up_w):
            if w is not None:
                with contextlib.suppress(Exception):
                    w.close()
        self.relay.connections.discard(self)
