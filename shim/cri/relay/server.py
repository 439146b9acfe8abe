"""The CRI proxy's data path: an HTTP/2 relay that passes frames through verbatim.

Each connection from kubelet gets its own connection to containerd, and
every frame goes across unchanged, so a CRI method or field newer than our
stubs works, and status codes, details and metadata pass untouched. The
relay reads only what it must: frame boundaries, SETTINGS, and header blocks
(HPACK-decoded in step with both encoders, to learn each request's method
and each response's status). A grpcio forwarder adds ~0.55 ms per call; this
relay adds about what a plain byte pipe does (``weft bench proxy``).

A request whose method weft intercepts (``routes``) is answered by weft: its
HEADERS still go to containerd, immediately followed by RST_STREAM(CANCEL),
so containerd's HPACK decoder stays in step with kubelet's encoder while
containerd never sees a request body (grpc-go runs no handler without one).
weft's own answer is written with header blocks that never touch the dynamic
table (``h2.encode_headers``), so kubelet's decoder stays in step with
containerd's encoder. Flow control stays exact: weft credits kubelet for the
request bytes containerd never sees, and all DATA toward kubelet, containerd's
and weft's, is released against kubelet's own windows.

containerd unreachable: the relay answers that connection's calls itself,
``UNAVAILABLE`` naming containerd's socket, then sends GOAWAY so kubelet
reconnects and finds containerd once it is back.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import socket as socketlib
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from hpack.exceptions import HPACKError

from shim import log
from shim.cri.instrument import Aborted, Instrument, Outcome
from shim.cri.methods import Method, Shape, lookup
from shim.cri.relay import h2
from shim.cri.route import Route
from shim.unixsock import SocketClaim

_log = log.get("weft.cri")

# Request headers that are transport, not metadata (grpc's own reserved names).
_RESERVED = frozenset({b"content-type", b"te", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding",
                       b"user-agent", b"grpc-message-type"})
_GRPC_CODES = {c.value[0]: c for c in grpc.StatusCode}


class RelayContext:
    """The part of ``grpc.ServicerContext`` weft's intercepted handlers use."""

    def __init__(self, metadata: list[tuple[str, str | bytes]], deadline: float | None) -> None:
        self._metadata = tuple(metadata)
        self._deadline = deadline
        self._cancelled = False
        self._callbacks: list[Callable[[], None]] = []
        self.initial_metadata: tuple = ()
        self.trailing_metadata: tuple = ()

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def set_trailing_metadata(self, md) -> None:
        self.trailing_metadata = tuple(md)

    def send_initial_metadata(self, md) -> None:
        self.initial_metadata = tuple(md)

    def is_active(self) -> bool:
        return not self._cancelled

    def add_callback(self, cb: Callable[[], None]) -> bool:
        self._callbacks.append(cb)
        return True

    def cancel(self) -> None:
        if not self._cancelled:
            self._cancelled = True
            for cb in self._callbacks:
                with contextlib.suppress(Exception):
                    cb()


@dataclass(slots=True)
class _Stream:
    sid: int
    method: Method
    intercepted: bool
    start: float
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    window: int = h2.DEFAULT_WINDOW  # kubelet's receive window for this stream (intercepted only)
    responded: bool = False  # response HEADERS went to kubelet
    ctx: RelayContext | None = None
    # A verb whose handler decides by the request body (``pick``): the HEADERS went to containerd, the
    # DATA frames wait here until the body is whole, then go to containerd or the handler answers.
    pick: Callable[[bytes], bool] | None = None
    held: list[bytes] = field(default_factory=list)
    held_wire: int = 0


def _metadata(headers: list[tuple[bytes, bytes]]) -> list[tuple[str, str | bytes]]:
    out: list[tuple[str, str | bytes]] = []
    for k, v in headers:
        if k.startswith(b":") or k in _RESERVED:
            continue
        key = k.decode("latin-1")
        if key.endswith("-bin"):
            out.append((key, base64.b64decode(v + b"=" * (-len(v) % 4))))
        else:
            out.append((key, v.decode("latin-1")))
    return out


def _md_fields(md) -> list[tuple[bytes, bytes]]:
    out = []
    for k, v in md or ():
        if k.endswith("-bin"):
            raw = v if isinstance(v, bytes) else v.encode()
            out.append((k.encode(), base64.b64encode(raw).rstrip(b"=")))
        else:
            out.append((k.encode(), v.encode() if isinstance(v, str) else v))
    return out


class _Connection:
    def __init__(self, relay: RelayServer, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        self.relay = relay
        self.down_r, self.down_w = down_r, down_w
        self.up_r: asyncio.StreamReader | None = None
        self.up_w: asyncio.StreamWriter | None = None
        self.local_reason = ""  # set when containerd could not be reached: we answer alone
        self.req_dec = h2.CachingDecoder()  # kubelet's encoder -> (us and) containerd
        self.resp_dec = h2.CachingDecoder()  # containerd's encoder -> (us and) kubelet
        self.streams: dict[int, _Stream] = {}
        self.last_sid = 0
        # The first frame kubelet gets must be SETTINGS (RFC 7540 3.5): containerd's, or ours.
        self.settings_down = False
        # kubelet's receive side, which all DATA toward kubelet must respect.
        self.k_conn = h2.DEFAULT_WINDOW
        self.k_initial = h2.DEFAULT_WINDOW
        self.k_max_frame = h2.DEFAULT_MAX_FRAME
        # (stream id, DATA length, frame bytes, ends one of our answers)
        self.out: deque[tuple[int, int, bytes, bool]] = deque()
        # Bytes of weft's own DATA that kubelet's connection WINDOW_UPDATEs will credit: that
        # credit is weft's, not containerd's, so it is kept back from what goes upstream.
        self.owed = 0
        # Streams above the id in weft's GOAWAY are left unprocessed (kubelet retries them elsewhere).
        self.goaway_sid: int | None = None
        self._req_hdr: tuple[int, int, list[bytes], list[bytes]] | None = None  # sid, flags, raw, fragments
        self._resp_hdr: tuple[int, int, list[bytes], list[bytes]] | None = None
        self.closed = False
        self.goaway_sent = False
        # Frames for kubelet gathered while handling one read, written with one
        # syscall: a response is usually HEADERS, DATA and trailers at once.
        self.wbuf: list[bytes] = []

    def _flush(self) -> None:
        if self.wbuf:
            data = b"".join(self.wbuf) if len(self.wbuf) > 1 else self.wbuf[0]
            self.wbuf.clear()
            if not self.closed:
                self.down_w.write(data)

    # -- writing toward kubelet ----------------------------------------------------
    def _send_down(self, sid: int, data_len: int, raw: bytes, last: bool = False) -> None:
        """Queue a frame for kubelet; DATA (data_len > 0) waits for kubelet's windows.

        ``last`` marks the final frame of an answer weft writes itself: only
        once it is out may that stream (and its window) be forgotten.
        """
        if not self.out and self._fits(sid, data_len):
            self._consume(sid, data_len)
            self.wbuf.append(raw)
            if last:
                self._answered(sid)
            return
        self.out.append((sid, data_len, raw, last))

    def _answered(self, sid: int) -> None:
        self.streams.pop(sid, None)
        self._close_if_done()

    def _fits(self, sid: int, n: int) -> bool:
        if n == 0:
            return True
        if self.k_conn < n:
            return False
        st = self.streams.get(sid)
        return not (st is not None and st.intercepted and st.window < n)

    def _consume(self, sid: int, n: int) -> None:
        if n:
            self.k_conn -= n
            st = self.streams.get(sid)
            if st is not None and st.intercepted:
                st.window -= n
                self.owed += n

    def _drain(self) -> None:
        while self.out:
            sid, n, raw, last = self.out[0]
            if not self._fits(sid, n):
                break
            self.out.popleft()
            self._consume(sid, n)
            self.wbuf.append(raw)
            if last:
                self._answered(sid)
        self._flush()
        self._close_if_done()

    # -- kubelet -> containerd -----------------------------------------------------
    async def run(self) -> None:
        try:
            preface = await self.down_r.readexactly(len(h2.PREFACE))
        except (asyncio.IncompleteReadError, ConnectionError):
            self._close()
            return
        if preface != h2.PREFACE:
            self._close()
            return
        try:
            self.up_r, self.up_w = await asyncio.wait_for(
                asyncio.open_unix_connection(self.relay.upstream_socket), timeout=2)
        except (OSError, TimeoutError) as exc:
            self.local_reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else repr(exc)
            self.relay.instrument.upstream_unavailable(self.relay.upstream_socket, self.local_reason)
            self.wbuf.append(h2.frame(h2.SETTINGS, 0, 0))
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
                at, up = 0, []
                while len(buf) - at >= 9:
                    length, ftype, flags, sid = h2.parse_header(buf, at)
                    end = at + 9 + length
                    if end > len(buf):
                        break
                    raw = bytes(buf[at:end])
                    self._on_kubelet_frame(ftype, flags, sid, raw, up)
                    at = end
                del buf[:at]
                if up and self.up_w is not None:
                    self.up_w.write(b"".join(up))
                self._drain()
        except (ConnectionError, HPACKError, asyncio.IncompleteReadError) as exc:
            _log.debug("relay.kubelet_closed", error=repr(exc))
        except h2.ProtocolError as exc:
            _log.warning("relay.protocol_error", side="kubelet", error=str(exc))
            with contextlib.suppress(Exception):
                self.down_w.write(h2.goaway(self.last_sid, h2.ERROR_PROTOCOL, str(exc).encode()))
        except Exception:  # noqa: BLE001 - a frame we could not make sense of: end this connection, not the agent
            _log.exception("relay.kubelet_failed")
        finally:
            self._close()

    def _on_kubelet_frame(self, ftype: int, flags: int, sid: int, raw: bytes, up: list[bytes]) -> None:
        payload = raw[9:]
        if ftype in (h2.HEADERS, h2.CONTINUATION):
            if ftype == h2.HEADERS:
                self._req_hdr = (sid, flags, [raw], [h2.header_fragment(ftype, flags, payload)])
            elif self._req_hdr is not None:
                self._req_hdr[2].append(raw)
                self._req_hdr[3].append(payload)
            if flags & h2.FLAG_END_HEADERS and self._req_hdr is not None:
                hsid, hflags, raws, frags = self._req_hdr
                self._req_hdr = None
                self._request_headers(hsid, hflags, b"".join(raws), b"".join(frags), up)
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
                self._credit(sid, len(payload))
                if flags & h2.FLAG_END_STREAM:
                    self._dispatch(st)
            elif self.up_w is None:
                self._credit(sid, len(payload))
            else:
                up.append(raw)
        elif ftype == h2.WINDOW_UPDATE:
            inc = h2.window_increment(payload)
            if sid == 0:
                self.k_conn += inc
                take = min(inc, self.owed)
                self.owed -= take
                if take:  # part of this credit is for weft's own answers: containerd gets the rest
                    if inc > take and self.up_w is not None:
                        up.append(h2.window_update(0, inc - take))
                    return
            elif st is not None and st.intercepted:
                st.window += inc
                return
            if self.up_w is not None:
                up.append(raw)
        elif ftype == h2.SETTINGS:
            if not flags & h2.FLAG_ACK:
                self._kubelet_settings(h2.parse_settings(payload))
                if self.up_w is None:
                    self.wbuf.append(h2.settings_ack())
            if self.up_w is not None:
                up.append(raw)
        elif ftype == h2.RST_STREAM:
            if st is not None:
                self._end_stream(st, grpc.StatusCode.CANCELLED, "cancelled by the client")
                if st.intercepted:
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
            self.wbuf.append(h2.frame(h2.PING, h2.FLAG_ACK, 0, payload))
        elif ftype == h2.PING and self.up_w is None:
            pass  # an ack of a ping containerd sent before it went away
        elif self.up_w is not None:  # PING acks, PRIORITY, GOAWAY and anything newer: not ours to judge
            up.append(raw)

    def _decide(self, st: _Stream, up: list[bytes]) -> None:
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
            self._credit(st.sid, st.held_wire)
            self._dispatch(st)
        else:
            if st.method.shape is Shape.SERVER_STREAM:
                self.relay.instrument.stream_opened(st.method)
            up.extend(st.held)
        st.held = []

    def _kubelet_settings(self, settings: Mapping[int, int]) -> None:
        if h2.SETTINGS_INITIAL_WINDOW_SIZE in settings:
            delta = settings[h2.SETTINGS_INITIAL_WINDOW_SIZE] - self.k_initial
            self.k_initial = settings[h2.SETTINGS_INITIAL_WINDOW_SIZE]
            for st in self.streams.values():
                if st.intercepted:
                    st.window += delta
        if h2.SETTINGS_MAX_FRAME_SIZE in settings:
            self.k_max_frame = settings[h2.SETTINGS_MAX_FRAME_SIZE]
        if h2.SETTINGS_HEADER_TABLE_SIZE in settings:
            # containerd's encoder may now use a table this large toward kubelet.
            self.resp_dec.max_allowed_table_size = settings[h2.SETTINGS_HEADER_TABLE_SIZE]

    def _credit(self, sid: int, n: int) -> None:
        """Give kubelet back the window of request bytes containerd will never see."""
        if n:
            self.wbuf.append(h2.window_update(0, n) + (h2.window_update(sid, n) if sid else b""))

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
        if self.goaway_sid is not None and sid > self.goaway_sid:
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
        st = _Stream(sid, method, intercepted and pick is None, time.perf_counter(), headers,
                     window=self.k_initial, pick=pick)
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
            self._goaway()

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
                at = 0
                while len(buf) - at >= 9:
                    length, ftype, flags, sid = h2.parse_header(buf, at)
                    end = at + 9 + length
                    if end > len(buf):
                        break
                    self._on_containerd_frame(ftype, flags, sid, bytes(buf[at:end]), length)
                    at = end
                del buf[:at]
                self._flush()
        except (ConnectionError, HPACKError, asyncio.IncompleteReadError) as exc:
            _log.debug("relay.containerd_closed", error=repr(exc))
        except Exception:  # noqa: BLE001 - as above: the calls on this connection end clearly
            _log.exception("relay.containerd_failed")
        if not self.closed:
            self._upstream_lost()

    def _on_containerd_frame(self, ftype: int, flags: int, sid: int, raw: bytes, length: int) -> None:
        if ftype in (h2.HEADERS, h2.CONTINUATION):
            payload = raw[9:]
            if ftype == h2.HEADERS:
                self._resp_hdr = (sid, flags, [raw], [h2.header_fragment(ftype, flags, payload)])
            elif self._resp_hdr is not None:
                self._resp_hdr[2].append(raw)
                self._resp_hdr[3].append(payload)
            if flags & h2.FLAG_END_HEADERS and self._resp_hdr is not None:
                hsid, hflags, raws, frags = self._resp_hdr
                self._resp_hdr = None
                headers = self.resp_dec.decode(b"".join(frags))
                st = self.streams.get(hsid)
                if st is not None and st.intercepted:
                    return  # cannot happen with grpc-go after our RST; never let it reach kubelet's stream
                self._send_down(hsid, 0, b"".join(raws))
                if st is not None and hflags & h2.FLAG_END_STREAM:
                    status = next((v for k, v in headers if k == b"grpc-status"), None)
                    msg = next((v for k, v in headers if k == b"grpc-message"), b"")
                    code = _GRPC_CODES.get(int(status), grpc.StatusCode.UNKNOWN) if status else grpc.StatusCode.OK
                    self._end_stream(st, code, h2.percent_decode(msg))
                elif st is not None:
                    st.responded = True
            return
        st = self.streams.get(sid) if sid else None
        if st is not None and st.intercepted:
            return  # containerd's side of a stream we answer: ignore
        if ftype == h2.DATA:
            self._send_down(sid, length, raw)
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
        self._send_down(sid, 0, raw)

    def _upstream_lost(self) -> None:
        """containerd went away mid-connection: end every open pass-through call clearly, then the connection."""
        message = f"weft: containerd is unavailable at {self.relay.upstream_socket}: connection lost"
        self.relay.instrument.upstream_unavailable(self.relay.upstream_socket, "connection lost")
        if not self.settings_down:  # containerd died before it said anything: our SETTINGS come first
            self.wbuf.insert(0, h2.frame(h2.SETTINGS, 0, 0))
            self.settings_down = True
        for st in list(self.streams.values()):
            if not st.intercepted:
                self._answer_error(st, grpc.StatusCode.UNAVAILABLE, message, ())
        up_w, self.up_w = self.up_w, None
        if up_w is not None:
            with contextlib.suppress(Exception):
                up_w.close()
        self._goaway()

    # -- streams we answer ---------------------------------------------------------
    def _dispatch(self, st: _Stream) -> None:
        deadline = None
        timeout = next((v for k, v in st.headers if k == b"grpc-timeout"), None)
        if timeout is not None:
            seconds = h2.parse_timeout(timeout)
            if seconds is not None:
                deadline = time.monotonic() + seconds
        st.ctx = RelayContext(_metadata(st.headers), deadline)
        messages = h2.split_grpc_messages(bytes(st.body))
        request = messages[0] if messages is not None and len(messages) == 1 else None
        loop = asyncio.get_running_loop()
        handler = self.relay.routes[st.method.path].handle
        future = loop.run_in_executor(self.relay.pool, self.relay.instrument.intercepted, st.method, handler,
                                      request, st.ctx)
        future.add_done_callback(lambda f: self._answer_safely(st, f))

    def _answer_safely(self, st: _Stream, future: asyncio.Future) -> None:
        try:
            if future.cancelled():
                outcome = Outcome(grpc.StatusCode.UNAVAILABLE, "weft: the agent is stopping", None)
            else:
                outcome = future.result()
            self._answer(st, outcome)
        except Exception as exc:  # noqa: BLE001 - the caller must get an answer, never a hang
            _log.exception("relay.answer_failed", method=st.method.name)
            if not self.closed and st.sid in self.streams:
                self._answer_error(st, grpc.StatusCode.INTERNAL, f"weft: could not answer {st.method.name}: {exc!r}",
                                   ())

    def _answer(self, st: _Stream, outcome: Outcome) -> None:
        if self.closed or st.sid not in self.streams:
            return
        ctx = st.ctx
        initial = _md_fields(ctx.initial_metadata if ctx else ())
        trailing = _md_fields(outcome.trailing_metadata)
        if outcome.code is not grpc.StatusCode.OK:
            self._answer_error(st, outcome.code, outcome.details, trailing, initial)
        else:
            block = h2.encode_headers([(b":status", b"200"), (b"content-type", b"application/grpc"), *initial])
            self._send_down(st.sid, 0, h2.headers_frames(st.sid, block, end_stream=False, max_frame=self.k_max_frame))
            body = h2.grpc_message(outcome.response or b"")
            for i in range(0, len(body), self.k_max_frame):
                chunk = body[i:i + self.k_max_frame]
                self._send_down(st.sid, len(chunk), h2.frame(h2.DATA, 0, st.sid, chunk))
            tblock = h2.encode_headers([(b"grpc-status", b"0"), *trailing])
            self._send_down(st.sid, 0, h2.headers_frames(st.sid, tblock, end_stream=True, max_frame=self.k_max_frame),
                            last=True)
        self._flush()

    def _answer_error(self, st: _Stream, code: grpc.StatusCode, details: str, trailing, initial=()) -> None:
        fields = [(b"grpc-status", str(code.value[0]).encode()), (b"grpc-message", h2.percent_encode(details)),
                  *trailing]
        if not st.responded:  # trailers-only
            fields = [(b":status", b"200"), (b"content-type", b"application/grpc"), *initial, *fields]
        block = h2.encode_headers(fields)
        frames = h2.headers_frames(st.sid, block, end_stream=True, max_frame=self.k_max_frame)
        if st.intercepted:
            self._send_down(st.sid, 0, frames, last=True)
        else:
            self._send_down(st.sid, 0, frames)
            self._end_stream(st, code, details)
        self._drain()

    def _end_stream(self, st: _Stream, code: grpc.StatusCode, details: str) -> None:
        if self.streams.pop(st.sid, None) is None:
            return
        if not st.intercepted:
            if st.method.shape is Shape.SERVER_STREAM:
                self.relay.instrument.stream_closed(st.method)
            self.relay.instrument.passthrough(st.method, code, details, time.perf_counter() - st.start)
        self._close_if_done()

    def _close_if_done(self) -> None:
        # After GOAWAY the connection ends once its last call is answered; the
        # short delay lets the final frames leave first.
        if self.goaway_sent and not self.streams and not self.out and not self.closed:
            asyncio.get_running_loop().call_later(0.05, self._close)

    # -- ending ------------------------------------------------------------------
    def _goaway(self) -> None:
        if not self.goaway_sent:
            self.goaway_sent = True
            self.goaway_sid = self.last_sid
            self._send_down(0, 0, h2.goaway(self.last_sid))
            self._flush()
            self._close_if_done()

    def shutdown(self) -> None:
        """Server stopping: no new calls; calls in flight may finish."""
        self._goaway()
        self._drain()

    def _close(self) -> None:
        if self.closed:
            return
        self._flush()
        self.closed = True
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


def _new_loop() -> asyncio.AbstractEventLoop:
    # uvloop's libuv loop takes ~20-40 us off every relayed call; asyncio's own works too.
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class RelayServer:
    """The proxy on a unix socket: claim it, bind it 0600, relay, stop cleanly."""

    def __init__(self, socket_path: Path, upstream_socket: str, routes: Mapping[str, Route],
                 instrument: Instrument, workers: int) -> None:
        self.socket_path = socket_path
        self.upstream_socket = upstream_socket
        self.routes = dict(routes)
        self.instrument = instrument
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weft-cri")
        self.claim = SocketClaim(socket_path)
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Future] = set()
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="weft-relay", daemon=True)
        self._server: asyncio.base_events.Server | None = None

    def start(self) -> None:
        self.claim.acquire()
        sock = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(str(self.socket_path))
        except OSError:
            sock.close()
            self.claim.release()
            raise
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)
        self.claim.bound()
        sock.listen(128)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_unix_server(self._accept, sock=sock), self._loop).result()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Connection(self, reader, writer)
        self.connections.add(conn)
        await conn.run()

    def stop(self, grace: float = 5.0) -> None:
        async def _stop() -> None:
            assert self._server is not None
            self._server.close()
            for conn in list(self.connections):
                conn.shutdown()
            deadline = time.monotonic() + grace
            while self.connections and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            for conn in list(self.connections):
                conn._close()
            for task in self.tasks:
                task.cancel()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(grace + 5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.claim.release()
