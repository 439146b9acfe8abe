"""The one accept loop: the tunnel port, the origin's streaming server and both sides' port mirrors.

A listening socket's loop must outlive whatever is done to it (these ports are reachable from pods): a
failed accept (out of file descriptors, memory) or a connection that could not be handed on (no thread to
be had) is reported and waited out, doubling the wait up to a second, never the end of the loop. The loop
ends only when the socket is closed, or ``stop`` is set.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable

# After a failed accept or hand-on: wait this long, doubling up to the most, before the next accept.
BACKOFF_S = (0.05, 1.0)
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class NotTaken(Exception):
    """The handler could not take the connection (it closed it): reported and waited out as a failed accept."""


def closed(sock: socket.socket, exc: OSError) -> bool:
    """Whether an accept failed because the socket was closed (by ``close``, from another thread)."""
    return sock.fileno() < 0 or exc.errno in (errno.EBADF, errno.EINVAL)


def accept_loop(accept: Callable[[], tuple[socket.socket, tuple]], handle: Callable[[socket.socket, tuple], None],
                failed: Callable[[OSError | NotTaken], None], *, stop: threading.Event | None = None,
                ended: Callable[[OSError], bool] = lambda _exc: False) -> None:
    """``accept`` (a listening socket's) and hand each connection to ``handle`` until ``ended`` says a failed
    accept means the socket was closed, or ``stop`` is set; ``failed`` hears of each failure before its wait."""
    wait = stop.wait if stop is not None else time.sleep
    backoff = BACKOFF_S[0]
    while stop is None or not stop.is_set():
        try:
            conn, peer = accept()
        except OSError as exc:
            if (stop is not None and stop.is_set()) or ended(exc):
                return
            problem: OSError | NotTaken = exc
        else:
            try:
                handle(conn, peer)
            except NotTaken as exc:
                problem = exc
            else:
                backoff = BACKOFF_S[0]
                continue
        failed(problem)
        wait(backoff)
        backoff = min(BACKOFF_S[1], backoff * 2)
