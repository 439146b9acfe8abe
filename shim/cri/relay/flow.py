"""Flow control toward kubelet: every frame kubelet gets, containerd's and weft's, within kubelet's windows.

containerd's DATA passes through, and kubelet's WINDOW_UPDATEs for it pass
back to containerd; weft's own answers spend the same connection window, so
the credit kubelet then gives for them is weft's (``owed``) and is kept back
from containerd. An intercepted stream also has a window of its own, which
weft keeps. A frame that does not fit the connection's window waits in
``out``, in order, behind any frame already waiting (containerd's header
blocks must reach kubelet in the order containerd encoded them: HPACK). A
frame of weft's own answer that waits only on its stream's window waits in
that stream's queue (``held``) instead, with the stream's later frames:
weft's header blocks never touch HPACK's table, so a stream kubelet reads
slowly (a GetContainerEvents it is behind on) holds back none of the
connection's other calls. Frames that fit are gathered in ``wbuf`` and
written with one syscall (a response is usually HEADERS, DATA and trailers
at once).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from shim.cri.relay import h2


class Writer(Protocol):
    def write(self, data: bytes) -> None: ...


class Downlink:
    def __init__(self, writer: Writer, streams: Mapping[int, Any], answered: Callable[[int], None]) -> None:
        self.writer = writer
        # The connection's open streams: an intercepted one (``.intercepted``) keeps its ``.window`` here.
        self.streams = streams
        self.answered = answered  # told when the last frame of one of weft's answers went out
        self.conn_window = h2.DEFAULT_WINDOW
        self.initial_window = h2.DEFAULT_WINDOW
        self.max_frame = h2.DEFAULT_MAX_FRAME
        self.out: deque[tuple[int, int, bytes, bool]] = deque()  # (stream id, DATA length, frame, ends an answer)
        self.held: dict[int, deque[tuple[int, int, bytes, bool]]] = {}  # weft's streams waiting on their windows
        self.owed = 0
        self.wbuf: list[bytes] = []
        self.closed = False

    # -- writing ---------------------------------------------------------------------
    def control(self, raw: bytes, *, first: bool = False) -> None:
        """A frame flow control does not hold back (SETTINGS, PING acks, WINDOW_UPDATE, GOAWAY)."""
        if first:
            self.wbuf.insert(0, raw)
        else:
            self.wbuf.append(raw)

    def send(self, sid: int, data_len: int, raw: bytes, last: bool = False) -> None:
        """Queue a frame for kubelet; DATA (``data_len`` > 0) waits for kubelet's windows.

        ``last`` marks the final frame of an answer weft writes itself: only
        once it is out may that stream (and its window) be forgotten.
        """
        item = (sid, data_len, raw, last)
        if sid in self.held:
            self.held[sid].append(item)
        elif not self.out and self._fits(sid, data_len):
            self._write(item)
        elif not self.out and self._stream_bound(sid, data_len):
            self.held[sid] = deque([item])
        else:
            self.out.append(item)

    @property
    def waiting(self) -> bool:
        """Whether any frame is still queued."""
        return bool(self.out or self.held)

    def drain(self) -> None:
        """Send what now fits, in order, and write."""
        self._drain_held()
        while self.out:
            sid, n = self.out[0][:2]
            if sid in self.held or (self.conn_window >= n and not self._fits(sid, n)):
                self.held.setdefault(sid, deque()).append(self.out.popleft())
                continue
            if not self._fits(sid, n):
                break
            self._write(self.out.popleft())
        self._drain_held()
        self.flush()

    def discard(self, sid: int) -> None:
        """Forget the frames of ``sid`` still waiting (a stream ended by reset: they would never be read)."""
        self.held.pop(sid, None)
        if any(q[0] == sid for q in self.out):
            self.out = deque(q for q in self.out if q[0] != sid)

    def _drain_held(self) -> None:
        for sid in list(self.held):
            queue = self.held[sid]
            while queue and self._fits(sid, queue[0][1]):
                self._write(queue.popleft())
            if not queue:
                self.held.pop(sid, None)

    def _write(self, item: tuple[int, int, bytes, bool]) -> None:
        sid, n, raw, last = item
        self._consume(sid, n)
        self.wbuf.append(raw)
        if last:
            self.answered(sid)

    def flush(self) -> None:
        if self.wbuf:
            data = b"".join(self.wbuf) if len(self.wbuf) > 1 else self.wbuf[0]
            self.wbuf.clear()
            if not self.closed:
                self.writer.write(data)

    def _stream_bound(self, sid: int, n: int) -> bool:
        """Whether this frame waits on its own stream's window alone (one of weft's answers)."""
        st = self.streams.get(sid)
        return n > 0 and st is not None and st.intercepted and self.conn_window >= n

    def _fits(self, sid: int, n: int) -> bool:
        if n == 0:
            return True
        if self.conn_window < n:
            return False
        st = self.streams.get(sid)
        return not (st is not None and st.intercepted and st.window < n)

    def _consume(self, sid: int, n: int) -> None:
        if n:
            self.conn_window -= n
            st = self.streams.get(sid)
            if st is not None and st.intercepted:
                st.window -= n
                st.sent += n
                self.owed += n

    # -- what kubelet says -------------------------------------------------------------
    def credit(self, sid: int, n: int) -> None:
        """Give kubelet back the window of request bytes containerd will never see."""
        if n:
            self.wbuf.append(h2.window_update(0, n) + (h2.window_update(sid, n) if sid else b""))

    def window_update(self, sid: int, inc: int) -> int | None:
        """kubelet's WINDOW_UPDATE: what of it containerd gets. None: the frame as it came; 0: nothing;
        a number: a connection WINDOW_UPDATE of that much (the rest was credit for weft's own answers)."""
        if sid == 0:
            self.conn_window += inc
            take = min(inc, self.owed)
            self.owed -= take
            if take:
                return inc - take
            return None
        st = self.streams.get(sid)
        if st is not None and st.intercepted:
            st.window += inc
            return 0
        return None

    def settings(self, settings: Mapping[int, int]) -> None:
        if h2.SETTINGS_INITIAL_WINDOW_SIZE in settings:
            delta = settings[h2.SETTINGS_INITIAL_WINDOW_SIZE] - self.initial_window
            self.initial_window = settings[h2.SETTINGS_INITIAL_WINDOW_SIZE]
            for st in self.streams.values():
                if st.intercepted:
                    st.window += delta
        if h2.SETTINGS_MAX_FRAME_SIZE in settings:
            self.max_frame = settings[h2.SETTINGS_MAX_FRAME_SIZE]
