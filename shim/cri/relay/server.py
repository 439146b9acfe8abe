"""The CRI proxy's data path: an HTTP/2 relay between kubelet and containerd that passes frames through verbatim.

Each connection from kubelet gets its own connection to containerd, and
every frame goes across unchanged, so a CRI method or field newer than our
stubs works, and status codes, details and metadata pass untouched
(``connection``). The server claims the unix socket, serves it 0600 on an
event loop of its own, runs intercepted handlers in a thread pool, and
stops cleanly (``shutdown``). What the relay costs per call is measured by
``weft bench proxy`` (``docs/benchmarks.md``).
"""

from __future__ import annotations

import asyncio
import os
import socket as socketlib
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from shim.cri.instrument import Instrument
from shim.cri.relay.connection import Connection
from shim.cri.relay.shutdown import cancel_all, stop_all
from shim.cri.route import Route
from shim.unixsock import SocketClaim


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
        self.connections: set[Connection] = set()
        self.tasks: set[asyncio.Future] = set()
        self.streamed: set[int] = set()
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
        conn = Connection(self, reader, writer)
        self.connections.add(conn)
        await conn.run()

    def stop(self, grace: float = 5.0) -> None:
        async def _stop() -> None:
            assert self._server is not None
            self._server.close()
            await stop_all(self.connections, grace)
            cancel_all(self.tasks)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(grace + 5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.claim.release()
